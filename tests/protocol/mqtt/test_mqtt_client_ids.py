"""Any client identifier MQTT allows names a FenceMQ session: itself when it is a session name
already, else percent-encoded, else cut and hashed — never two identifiers one session."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fencemq.model.keys import check_name
from fencemq.protocol.mqtt.client_ids import session_name

# what MQTT allows in a UTF-8 string: any scalar value but U+0000 (MQTT-1.5.4-2)
identifiers = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1,
                      max_size=200)


def test_an_identifier_that_is_a_session_name_already_names_the_session_of_that_name() -> None:
    assert session_name("sensor-1") == "sensor-1"
    assert session_name("a" * 128) == "a" * 128


def test_spaces_bars_percents_and_non_ascii_are_percent_encoded() -> None:
    assert session_name("clean retained") == "clean%20retained"
    assert session_name("a|b") == "a%7Cb"
    assert session_name("100%") == "100%25"
    assert session_name("capteur-é") == "capteur-%C3%A9"
    assert session_name("温度") == "%E6%B8%A9%E5%BA%A6"


def test_an_identifier_too_long_to_encode_within_128_bytes_is_cut_and_hashed() -> None:
    longest = "é" * 32767  # 65,534 bytes of UTF-8
    name = session_name(longest)
    assert len(name) <= 128 and "%~" in name
    assert name.startswith("%C3%A9" * 10)
    assert session_name("a" * 129) != session_name("a" * 130)
    assert session_name("a" * 129).startswith("a" * 64 + "%~")


@settings(max_examples=500)
@given(identifiers)
def test_every_identifier_names_a_valid_session_and_the_plain_ones_themselves(client_id: str) -> None:
    name = session_name(client_id)
    assert check_name(name, "client") == name
    assert (name == client_id) == ("%" not in name)


@settings(max_examples=500)
@given(identifiers, identifiers)
def test_two_identifiers_never_name_one_session(a: str, b: str) -> None:
    assert (session_name(a) == session_name(b)) == (a == b)


@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=60))
def test_the_encoded_name_decodes_back_to_the_identifier(client_id: str) -> None:
    from urllib.parse import unquote

    name = session_name(client_id)
    if "%~" not in name:
        assert unquote(name, errors="strict") == client_id
