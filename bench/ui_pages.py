"""How long the web UI takes to answer with a million lmqs behind one lite topic (issue #18: under a second).

    .venv/bin/python -m bench.ui_pages [--lmqs 1000000] [--repeat 5] [--out bench/results]

A private Redis (``EmbeddedRedis``, never 127.0.0.1:6379) and a worker: one
lmq of topic ``big`` is made for real (PUB, SUB, PULL, ACK through the worker),
then its meta hash is copied (DUMP/RESTORE, pipelined) to ``--lmqs`` lmq names,
so every lmq is what the fences leave behind, at rest. Then the dashboard
(``fencemq.ui``, on a thread, as ``fencemq dashboard`` serves it) is asked, over
HTTP, each page ``--repeat`` times: the topic's first queues page, the next
page by its cursor, an lmq found by exact name, a glob search, and one lmq's
queue page. Writes ``<out>/ui_pages.json``: median and worst wall time per page.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import time
from pathlib import Path

import httpx
import redis

from bench.harness import ROOT, git_commit
from fencemq.config import Config
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.server.embedded import EmbeddedRedis
from fencemq.server.runner import WorkerThread
from fencemq.ui.app import UI
from fencemq.ui.serving import DashboardThread

GOAL_S = 1.0
TOPIC = "big"


def populate(url: str, port: int, n: int) -> None:
    r = redis.Redis(port=port, protocol=2)
    r.execute_command("HELLO", 2, "SETNAME", "bench-ui")
    r.execute_command("PUB", TOPIC, "hello", "LMQ", "m0000000")
    r.close()
    direct = redis.Redis.from_url(url)
    keys = Keyspace("fmq")
    template = keys.queue(QueueRef(TOPIC, "m0000000")).meta
    dump = direct.dump(template)
    pipe = direct.pipeline(transaction=False)
    for i in range(1, n):
        pipe.restore(keys.queue(QueueRef(TOPIC, f"m{i:07d}")).meta, 0, dump, replace=True)
        if i % 10_000 == 0:
            pipe.execute()
    pipe.execute()
    direct.close()


def timed(http: httpx.Client, path: str, params: dict, repeat: int) -> tuple[list[float], str]:
    times, text = [], ""
    for _ in range(repeat):
        t0 = time.perf_counter()
        resp = http.get(path, params=params)
        times.append(time.perf_counter() - t0)
        resp.raise_for_status()
        text = resp.text
    return times, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lmqs", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    results: dict[str, dict] = {}
    with EmbeddedRedis() as server, WorkerThread(Config(redis_url=server.url, port=0)) as worker:
        t0 = time.perf_counter()
        populate(server.url, worker.port, args.lmqs)
        print(f"{args.lmqs:,} lmqs in {time.perf_counter() - t0:.1f} s", flush=True)
        with DashboardThread(UI(server.url, interval=5.0)) as dash, \
                httpx.Client(base_url=dash.url.rstrip("/"), timeout=60) as http:
            pages = {"queues, first page": ("/queues", {"topic": TOPIC, "limit": 50})}
            _, first = timed(http, *pages["queues, first page"], 1)
            cursor = re.search(r'cursor=(\d+)', first)
            if cursor:
                pages["queues, next page"] = ("/queues", {"topic": TOPIC, "limit": 50, "cursor": cursor.group(1)})
            last = f"m{args.lmqs - 1:07d}"
            pages["lmq search, exact name"] = ("/lmqs", {"topic": TOPIC, "name": last})
            pages["lmq search, glob"] = ("/lmqs", {"topic": TOPIC, "name": f"{last[:-2]}*"})
            pages["one lmq's page"] = ("/queue", {"q": QueueRef(TOPIC, last).qid})
            for name, (path, params) in pages.items():
                times, text = timed(http, path, params, args.repeat)
                assert "That did not work" not in text, f"{name}: error page"
                results[name] = {"path": path, "params": params, "median_s": round(statistics.median(times), 4),
                                 "worst_s": round(max(times), 4), "under_goal": max(times) < GOAL_S}
                print(f"{name:24} median {statistics.median(times) * 1000:7.1f} ms, worst {max(times) * 1000:7.1f} ms",
                      flush=True)
    out = {"lmqs": args.lmqs, "repeat": args.repeat, "goal_s": GOAL_S, "pages": results, "commit": git_commit(),
           "machine": {"python": platform.python_version(), "platform": platform.platform()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ui_pages.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out / 'ui_pages.json'}")


if __name__ == "__main__":
    main()
