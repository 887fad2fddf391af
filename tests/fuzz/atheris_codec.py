"""An atheris (libFuzzer) target for the request codec, for runs longer than CI's.

    pip install atheris
    python tests/fuzz/atheris_codec.py -max_total_time=3600 -rss_limit_mb=1024 [corpus_dir]

Bytes are fed to the worker's RequestReader in pieces cut where the input
says, and the exact RequestParser gets the same bytes whole. Both must agree
command for command (or both refuse), never raise anything but RequestError,
never return an argument over the limits, and never hold more than the
bytes they were given (RequestReader.buffered). Not collected by pytest.
"""

from __future__ import annotations

import sys

from fencemq.protocol.request_reader import RequestReader
from fencemq.protocol.resp import RequestError, RequestParser

LIMITS = {"max_bulk": 4096, "max_args": 64, "max_inline": 1024}


def drain(reader) -> tuple[list[list[bytes]], bool]:
    out: list[list[bytes]] = []
    try:
        while (cmd := reader.gets()) is not None:
            out.append(cmd)
    except RequestError:
        return out, True
    return out, False


def one_input(data: bytes) -> None:
    if not data:
        return
    cut_every = data[0] % 17 + 1
    body = data[1:]
    pieces = RequestReader(**LIMITS)
    got: list[list[bytes]] = []
    refused = False
    for i in range(0, len(body), cut_every):
        pieces.feed(body[i : i + cut_every])
        more, refused = drain(pieces)
        got += more
        assert pieces.buffered <= len(body), "the reader holds more than it was given"
        if refused:
            break
    whole = RequestParser(**LIMITS)
    whole.feed(body)
    expected, whole_refused = drain(whole)
    assert got == expected[: len(got)], "the pieces and the whole read different commands"
    assert refused == whole_refused or not refused, "the pieces refused what the whole accepted"
    for cmd in got:
        assert len(cmd) <= LIMITS["max_args"] and all(len(a) <= LIMITS["max_bulk"] for a in cmd)


def main() -> None:
    import atheris

    atheris.instrument_all()
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
