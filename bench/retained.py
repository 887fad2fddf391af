"""Retained messages found by what a filter can match, among 1,000,000 (issue #30).

    .venv/bin/python -m bench.retained [--topics 1000000] [--repeat 5] [--out bench/results]

A fresh private Redis (``fencemq.server.embedded.EmbeddedRedis``) gets ``--topics`` retained
messages of ~100 B through ``lua/retain.lua`` (the fence a ``PUB … RETAIN`` runs: the message and
its index by topic level), on topics ``s<i // 1000>/d<i % 1000>/t``: 1,000 sites of 1,000 devices.
Then, for each filter, what a SUBSCRIBE reads (``fencemq.fences.retained.Retained.matching``, as
the worker calls it), against what it read before the index (the whole hash, ``HGETALL``, filtered
in Python) measured beside it on the same Redis:

* the bytes Redis sent (``INFO stats total_net_output_bytes`` around the lookup): what it
  costs Redis and the network;
* the wall time (median of ``--repeat``);
* the matches found (the same both ways: checked).

Also the index's memory: ``MEMORY USAGE`` of its two sorted sets, per retained topic. Writes
``<out>/retained.json`` and ``<out>/retained.png`` (bytes read per lookup, both ways, log scale).
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import redis
import redis.asyncio

from bench.bulk_fences import Bulk
from bench.harness import ROOT, git_commit
from bench.resp import RespConn
from bench.stats import run_and_write
from fencemq.config import Config
from fencemq.fences.core import Core
from fencemq.fences.lua_sources import sources
from fencemq.model.messages import pack_body
from fencemq.model.topics import matches
from fencemq.server.embedded import EmbeddedRedis

FILTERS = ["s17/d342/t", "s17/+/t", "+/d342/t", "s17/#", "s17/d342/+", "+/+/t"]


def topic(i: int) -> str:
    return f"s{i // 1000}/d{i % 1000}/t"


async def load(url: str, port: int, n: int) -> None:
    r = redis.Redis.from_url(url)
    src = sources()["retain"]
    sha = r.script_load(src)
    assert sha == hashlib.sha1(src.encode()).hexdigest()
    keys = Core(redis.asyncio.Redis.from_url(url), Config(redis_url=url)).keys
    names = [keys.retained, keys.retained_topics, keys.retained_levels, keys.retained_indexed]
    conn = await RespConn.open("127.0.0.1", port)
    body = b"x" * 64
    await Bulk(conn).run(["EVALSHA", sha, 4, *names, topic(i), pack_body(body, None, 1, "bench", topic(i)), 0]
                         for i in range(n))
    await conn.close()


def sent(r: redis.Redis) -> int:
    return int(r.info("stats")["total_net_output_bytes"])


def info_reply_bytes(r: redis.Redis) -> int:
    """What one INFO reply adds to the count (subtracted from every measure)."""
    return min(-sent(r) + sent(r) for _ in range(3))


async def main(args: argparse.Namespace) -> dict[str, Any]:
    server = EmbeddedRedis().start()
    try:
        url = server.url
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        t0 = time.perf_counter()
        await load(url, port, args.topics)
        load_s = time.perf_counter() - t0
        r = redis.Redis.from_url(url)
        ar = redis.asyncio.Redis.from_url(url)
        core = Core(ar, Config(redis_url=url))
        retained, keys = core.shared.retained, core.keys
        index_bytes = sum(r.memory_usage(k) or 0 for k in (keys.retained_topics, keys.retained_levels))
        info = info_reply_bytes(r)
        async for _ in retained.matching("warm/up"):  # the index checked once per worker: not a lookup's cost
            pass
        # the read every SUBSCRIBE made before the index: the whole hash, filtered here (once: it is
        # the same read whatever the filter)
        slow = redis.asyncio.Redis.from_url(url, socket_timeout=None)
        before, t = sent(r), time.perf_counter()
        whole = await slow.hgetall(keys.retained)
        whole_s, whole_bytes = time.perf_counter() - t, sent(r) - before - info
        await slow.aclose()
        rows = []
        for filt in FILTERS:
            indexed_s, indexed_bytes, found = [], 0, set()
            for _ in range(args.repeat):
                before, t = sent(r), time.perf_counter()
                found = {b async for bodies in retained.matching(filt) for b in bodies}
                indexed_s.append(time.perf_counter() - t)
                indexed_bytes = sent(r) - before - info
            t = time.perf_counter()
            wanted = {b for name, b in whole.items() if matches(filt, name.decode())}
            filtered_s = whole_s + time.perf_counter() - t
            assert found == wanted, f"{filt}: {len(found)} found, {len(wanted)} match"
            rows.append({
                "filter": filt, "matches": len(found),
                "indexed": {"bytes": indexed_bytes, "ms": round(statistics.median(indexed_s) * 1000, 2)},
                "whole_hash": {"bytes": whole_bytes, "ms": round(filtered_s * 1000, 1)},
                "bytes_ratio": round(whole_bytes / max(indexed_bytes, 1), 1),
                "time_ratio": round(filtered_s / max(statistics.median(indexed_s), 1e-9), 1),
            })
            print(f"{filt:>12}: {len(found):>7} matches, {indexed_bytes:>10} B in "
                  f"{statistics.median(indexed_s) * 1000:8.2f} ms (index) vs {whole_bytes:>11} B in "
                  f"{filtered_s * 1000:8.1f} ms (whole hash)")
        await ar.aclose()
        result = {
            "bench": "retained", "commit": git_commit(), "machine": platform.node(), "topics": args.topics,
            "load_seconds": round(load_s, 1), "index_bytes_per_topic": round(index_bytes / args.topics, 1),
            "lookups": rows,
            "note": "bytes = Redis's total_net_output_bytes around one lookup; the whole-hash read is what "
                    "every SUBSCRIBE did before the index, measured on the same Redis in the same run",
        }
        plot(rows, Path(args.out) / "retained.png", args.topics)
        return result
    finally:
        server.stop()


def plot(rows: list[dict[str, Any]], path: Path, n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [row["indexed"]["bytes"] for row in rows], 0.4, label="index by topic level")
    ax.bar([x + 0.2 for x in xs], [row["whole_hash"]["bytes"] for row in rows], 0.4, label="whole hash (before)")
    ax.set_yscale("log")
    ax.set_xticks(list(xs), [f"{row['filter']}\n{row['matches']} matches" for row in rows])
    ax.set_ylabel("bytes Redis sends per SUBSCRIBE")
    ax.set_title(f"Retained messages read per SUBSCRIBE, {n:,} retained")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topics", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    run_and_write("retained", main, parser.parse_args())
