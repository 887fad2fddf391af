"""MQTT topic names and filters (broker/topics.py), without a server.

Validation errors must name the rule that was broken; ``matches`` follows the
examples of MQTT 5.0 §4.7 (wildcards, ``$`` topics); ``FilterIndex.match``
must find exactly what matching every filter one by one finds.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fencemq.errors import BadArgument
from fencemq.model.topics import (
    FilterIndex,
    FilterTarget,
    check_filter,
    check_topic_name,
    has_wildcard,
    matches,
    parse_target,
)

# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["a", "a/b/c", "/", "a//b", "/leading", "trailing/", "$SYS/broker", "a/$b", "sport/tennis player1",
     "温度/センサー/1", "x" * 512, "é" * 256],
)
def test_valid_topic_names_are_accepted_as_they_are(name):
    assert check_topic_name(name) == name


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("", "empty"),
        ("a/+", "wildcards belong in filters"),
        ("a/#", "wildcards belong in filters"),
        ("+", "wildcards belong in filters"),
        ("a+b/c", "wildcards belong in filters"),
        ("sport#", "wildcards belong in filters"),
        ("a/\x00/b", "NUL"),
        ("x" * 513, "longer than 512 bytes"),
        ("é" * 257, "longer than 512 bytes"),  # 514 bytes in UTF-8, 257 characters
    ],
    ids=["empty", "plus-level", "hash-level", "plus-alone", "plus-in-level", "hash-in-level", "nul", "513-bytes",
         "257-two-byte-chars"],
)
def test_an_invalid_topic_name_is_badarg_naming_the_rule_it_breaks(name, rule):
    with pytest.raises(BadArgument, match=rule):
        check_topic_name(name)


@pytest.mark.parametrize(
    "filt",
    ["#", "+", "+/+", "/+", "+/", "a/+/c", "a/#", "/#", "a/+/#", "$SYS/#", "$share", "a//b", "+/+/+/#", "x" * 512],
)
def test_valid_topic_filters_are_accepted_as_they_are(filt):
    assert check_filter(filt) == filt


@pytest.mark.parametrize(
    ("filt", "rule"),
    [
        ("", "empty"),
        ("a/#/b", "'#' must be a whole level and the last one"),
        ("#/a", "'#' must be a whole level and the last one"),
        ("a/b#", "'#' must be a whole level and the last one"),
        ("sport/tennis#", "'#' must be a whole level and the last one"),
        ("##", "'#' must be a whole level and the last one"),
        ("a+/b", "'\\+' must be a whole level"),
        ("a/+b", "'\\+' must be a whole level"),
        ("++", "'\\+' must be a whole level"),
        ("a/\x00", "NUL"),
        ("x" * 513, "longer than 512 bytes"),
    ],
)
def test_an_invalid_topic_filter_is_badarg_naming_the_rule_it_breaks(filt, rule):
    with pytest.raises(BadArgument, match=rule):
        check_filter(filt)


def test_has_wildcard_is_true_for_plus_or_hash_anywhere():
    assert has_wildcard("a/+") and has_wildcard("#") and has_wildcard("a+b")
    assert not has_wildcard("a/b") and not has_wildcard("$share/g/a")


@pytest.mark.parametrize(
    ("target", "parsed"),
    [
        ("a/+", FilterTarget("a/+")),
        ("a/b", FilterTarget("a/b")),
        ("$share/g/a/#", FilterTarget("a/#", "g")),
        ("$share/consumers/sport/+/player1", FilterTarget("sport/+/player1", "consumers")),
        ("$share/g/#", FilterTarget("#", "g")),
        ("$share/g//x", FilterTarget("/x", "g")),  # the filter may itself start with an empty level
        ("$SYS/#", FilterTarget("$SYS/#")),
    ],
)
def test_parse_target_splits_a_shared_subscription_into_share_name_and_filter(target, parsed):
    assert parse_target(target) == parsed


@pytest.mark.parametrize(
    ("target", "rule"),
    [
        ("$share//x", "ShareName is empty"),
        ("$share/g+/x", "ShareName 'g\\+' may not contain"),
        ("$share/g#/x", "ShareName 'g#' may not contain"),
        ("$share/+/x", "ShareName '\\+' may not contain"),
        ("$share/g/a/#/b", "'#' must be a whole level and the last one"),
        ("$share/g/", "the filter is missing"),
    ],
)
def test_a_malformed_shared_subscription_is_badarg_naming_the_rule_it_breaks(target, rule):
    with pytest.raises(BadArgument, match=rule):
        parse_target(target)


def test_a_shared_subscription_without_a_filter_is_badarg_saying_the_filter_is_missing():
    with pytest.raises(BadArgument) as info:
        parse_target("$share/g")
    assert "ShareName is empty" not in info.value.message and "filter" in info.value.message


# -- matching (MQTT 5.0 §4.7.1-4.7.2 examples) -------------------------------------------------

MQTT_EXAMPLES = [
    # '#': the parent level and any number of child levels
    ("sport/tennis/player1/#", "sport/tennis/player1", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
    ("sport/#", "sport", True),
    ("#", "sport/tennis/player1", True),
    ("#", "/", True),
    ("sport/tennis/#", "sport/tennisplayer1", False),
    # '+': exactly one level, which may be empty
    ("sport/tennis/+", "sport/tennis/player1", True),
    ("sport/tennis/+", "sport/tennis/player2", True),
    ("sport/tennis/+", "sport/tennis/player1/ranking", False),
    ("sport/+", "sport", False),
    ("sport/+", "sport/", True),
    ("+/+", "/finance", True),
    ("/+", "/finance", True),
    ("+", "/finance", False),
    ("+", "sport", True),
    ("+/tennis/#", "sport/tennis/player1", True),
    ("sport/+/player1", "sport/tennis/player1", True),
    ("a/+/b", "a//b", True),
    # levels are case-sensitive and compared whole
    ("ACCOUNTS", "Accounts", False),
    ("sport/tennis", "sport/tennis", True),
    ("sport/tennis", "sport/tennis/", False),
    # '$' topics are not matched by a leading wildcard, only by a filter naming '$…'
    ("#", "$SYS/monitor/Clients", False),
    ("+/monitor/Clients", "$SYS/monitor/Clients", False),
    ("$SYS/#", "$SYS/monitor/Clients", True),
    ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
    ("$SYS/#", "$SYS", True),
    ("+", "$SYS", False),
    ("#", "$", False),
    ("a/+", "a/$b", True),  # '$' matters only at the start of the topic
    ("a/#", "a/$b/c", True),
]


@pytest.mark.parametrize(("filt", "topic", "expected"), MQTT_EXAMPLES)
def test_matches_follows_the_mqtt_5_examples(filt, topic, expected):
    assert matches(filt, topic) is expected


@pytest.mark.parametrize(("filt", "topic", "expected"), MQTT_EXAMPLES)
def test_a_filter_index_holding_one_filter_matches_like_matches(filt, topic, expected):
    index = FilterIndex()
    index.add("q", filt)
    assert (index.match(topic) == {"q"}) is expected


# -- FilterIndex -----------------------------------------------------------------------------

LEVELS = ["a", "b", "", "$x", "$SYS"]
topic_levels = st.lists(st.sampled_from(LEVELS), min_size=1, max_size=4)
topics = topic_levels.map("/".join).filter(bool)  # "" is no topic name


@st.composite
def filters(draw) -> str:
    levels = draw(st.lists(st.sampled_from([*LEVELS, "+"]), min_size=1, max_size=4))
    if draw(st.booleans()):
        levels = draw(st.sampled_from([levels, levels[:-1]])) + ["#"]
    filt = "/".join(levels)
    return filt or "/"  # "" is no filter; "/" (two empty levels) is


@settings(max_examples=300, deadline=None)
@given(st.lists(filters(), max_size=25), st.lists(topics, min_size=1, max_size=10))
def test_filter_index_match_equals_matching_every_filter_one_by_one(filts, topic_list):
    index = FilterIndex()
    for i, f in enumerate(filts):
        check_filter(f)
        index.add(f"e{i}", f)
    assert len(index) == len(filts)
    for topic in topic_list:
        expected = {f"e{i}" for i, f in enumerate(filts) if matches(f, topic)}
        assert index.match(topic) == expected, topic


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove"]), st.integers(0, 5), filters()), max_size=30),
       st.lists(topics, min_size=1, max_size=8))
def test_filter_index_after_any_adds_and_removes_matches_what_is_left(ops, topic_list):
    index, current = FilterIndex(), {}
    for op, n, f in ops:
        entry = f"e{n}"
        if op == "add":
            index.add(entry, f)
            current[entry] = f
        else:
            index.remove(entry)
            current.pop(entry, None)
    assert len(index) == len(current) and index.filters == current
    for topic in topic_list:
        assert index.match(topic) == {e for e, f in current.items() if matches(f, topic)}, topic


def test_adding_an_entry_again_replaces_its_filter():
    index = FilterIndex()
    index.add("q", "a/#")
    index.add("q", "b/+")
    assert len(index) == 1
    assert index.match("a/x") == set() and index.match("b/x") == {"q"}


def test_entries_with_the_same_filter_are_all_found_and_removed_one_at_a_time():
    index = FilterIndex()
    for entry in ("f:c1:a/+", "f:c2:a/+", "f:$share/g:a/+"):
        index.add(entry, "a/+")
    assert index.match("a/b") == {"f:c1:a/+", "f:c2:a/+", "f:$share/g:a/+"}
    index.remove("f:c2:a/+")
    assert index.match("a/b") == {"f:c1:a/+", "f:$share/g:a/+"}


def test_removing_an_unknown_entry_changes_nothing():
    index = FilterIndex()
    index.add("q", "a/#")
    index.remove("nope")
    assert len(index) == 1 and index.match("a") == {"q"}


def test_overlapping_filters_are_each_matched_once():
    index = FilterIndex()
    for entry, f in {"plus": "a/+", "hash": "a/#", "exact": "a/b", "root": "#", "other": "b/#"}.items():
        index.add(entry, f)
    assert index.match("a/b") == {"plus", "hash", "exact", "root"}
    assert index.match("a") == {"hash", "root"}
    assert index.match("$a/b") == set()
