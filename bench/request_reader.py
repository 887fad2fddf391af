"""The worker's request reader alone: RequestParser (a Python walk over every header)
against RequestReader (hiredis reads the frames), on the requests of the e2e bench.

    python -m bench.request_reader [--seconds 1.0] [--out bench/results]

Each workload is a pipeline of requests cut into 64 KiB reads, as the worker
receives it; the figure is CPU time per request (best of 5 repeats).
Writes <out>/request_reader.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.harness import ROOT
from fencemq.protocol.request_reader import RequestReader
from fencemq.protocol.resp import RequestParser

READ_SIZE = 65536


def mb(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def workloads(size: int) -> dict[str, bytes]:
    payload = b"p" * size
    tags = [b"%d" % (1_000_000 + i) for i in range(100)]
    return {
        f"PUB {size} B": mb(b"PUB", b"orders", payload) * 2000,
        f"MPUB 100 x {size} B": mb(b"MPUB", b"orders", b"100", *[payload] * 100) * 40,
        "ACK 100 tags": mb(b"ACK", b"t:orders|g|c1", *tags) * 400,
        "PULL COUNT 100 BLOCK 1000": mb(b"PULL", b"t:orders|g|c1", b"COUNT", b"100", b"BLOCK", b"1000") * 4000,
    }


def per_request_us(make, data: bytes, requests: int, seconds: float) -> float:
    chunks = [data[i : i + READ_SIZE] for i in range(0, len(data), READ_SIZE)]
    best = float("inf")
    for _ in range(5):
        rounds, t0 = 0, time.process_time()
        while (elapsed := time.process_time() - t0) < seconds / 5:
            reader = make()
            got = 0
            for chunk in chunks:
                reader.feed(chunk)
                while reader.gets() is not None:
                    got += 1
            assert got == requests, (got, requests)
            rounds += 1
        best = min(best, elapsed / (rounds * requests) * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=1.0, help="CPU seconds per reader and workload")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    opts = ap.parse_args()
    rows = []
    for name, data in workloads(opts.size).items():
        requests = sum(1 for _ in _split(data))
        parser = per_request_us(RequestParser, data, requests, opts.seconds)
        reader = per_request_us(RequestReader, data, requests, opts.seconds)
        rows.append({"workload": name, "requests": requests, "parser_us_per_request": round(parser, 3),
                     "reader_us_per_request": round(reader, 3), "speedup": round(parser / reader, 2)})
        print(f"{name:<28} RequestParser {parser:8.2f} us   RequestReader {reader:8.2f} us   x{parser / reader:.1f}")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "request_reader.json").write_text(json.dumps({"read_size": READ_SIZE, "results": rows}, indent=2) + "\n")


def _split(data: bytes):
    parser = RequestParser()
    parser.feed(data)
    while (cmd := parser.gets()) is not None:
        yield cmd


if __name__ == "__main__":
    main()
