"""How long the web UI takes to answer with a million lmqs behind one lite topic and 1,000 topics
(issue #18: a page under a second; issue #33: the overview under 300 ms).

    .venv/bin/python -m bench.ui_pages [--lmqs 1000000] [--topics 1000] [--repeat 5] [--out bench/results]

A private Redis (``EmbeddedRedis``, never 127.0.0.1:6379) and a worker: one
lmq of topic ``big`` is made for real (PUB, SUB, PULL, ACK through the worker),
then its meta hash is copied (DUMP/RESTORE, pipelined) to ``--lmqs`` lmq names,
so every lmq is what the fences leave behind, at rest (and the broker's totals
count them as the fences would have: ``queues:l`` and ``lmqs|l:big``). Then
``--topics`` plain topics are made through the worker, each with a group, three
messages and, for one in ten, a checkout (so the busiest table, the lease
schedule and the totals have something to show). Then the dashboard
(``fencemq.ui``, on a thread, as ``fencemq dashboard`` serves it) is asked, over
HTTP, each page ``--repeat`` times: the topic's first queues page, the next
page by its cursor, an lmq found by exact name, a glob search, and one lmq's
queue page, and the overview — each time with a fresh sample of the broker (the
sampler's last one thrown away first: what the first operator to open it
waits for). Writes ``<out>/ui_pages.json``: median and worst wall time per page.
"""

from __future__ import annotations

import argparse
import json
import os
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
from fencemq.ui.pages import UI
from fencemq.ui.serving import DashboardThread

GOAL_S = 1.0
OVERVIEW_GOAL_S = 0.3
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
    direct.hincrby(keys.totals, "queues:l", n - 1)  # the copies, counted as the fences count an lmq
    direct.hincrby(keys.totals, f"lmqs|l:{TOPIC}", n - 1)
    direct.close()


def plain_topics(port: int, n: int) -> None:
    """n topics through the worker: a group, three messages, a checkout for one in ten."""
    r = redis.Redis(port=port, protocol=2)
    r.execute_command("HELLO", 2, "SETNAME", "bench-topics")
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.execute_command("SUB", f"t{i:04d}", "GROUP", "g")
        pipe.execute_command("MPUB", f"t{i:04d}", 3, "a", "b", "c")
    handles = pipe.execute()[::2]
    pipe = r.pipeline(transaction=False)
    for i, reply in enumerate(handles):
        if i % 10 == 0:
            pipe.execute_command("PULL", dict(zip(reply[::2], reply[1::2]))[b"handle"], "COUNT", 1)
    pipe.execute()
    r.close()


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
    ap.add_argument("--topics", type=int, default=1_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    results: dict[str, dict] = {}
    with EmbeddedRedis() as server, WorkerThread(Config(redis_url=server.url, port=0)) as worker:
        t0 = time.perf_counter()
        populate(server.url, worker.port, args.lmqs)
        print(f"{args.lmqs:,} lmqs in {time.perf_counter() - t0:.1f} s", flush=True)
        plain_topics(worker.port, args.topics)
        ui = UI(server.url, interval=5.0)
        with DashboardThread(ui) as dash, \
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
            pages["overview, a fresh sample"] = ("/", {})
            for name, (path, params) in pages.items():
                goal = OVERVIEW_GOAL_S if path == "/" else GOAL_S
                load = [round(x, 2) for x in os.getloadavg()]
                if path == "/":
                    times, text = [], ""
                    for _ in range(args.repeat):
                        ui.sampler.sampled_at = 0.0  # stale: this request samples the broker itself
                        t, text = timed(http, path, params, 1)
                        times += t
                    assert f"{args.topics + 1:,}" in text or "Busiest" in text
                else:
                    times, text = timed(http, path, params, args.repeat)
                assert "That did not work" not in text, f"{name}: error page"
                results[name] = {"path": path, "params": params, "median_s": round(statistics.median(times), 4),
                                 "worst_s": round(max(times), 4), "goal_s": goal, "under_goal": max(times) < goal,
                                 "loadavg_before": load, "cpus": os.cpu_count()}
                print(f"{name:24} median {statistics.median(times) * 1000:7.1f} ms, worst {max(times) * 1000:7.1f} ms",
                      flush=True)
    out = {"lmqs": args.lmqs, "topics": args.topics, "repeat": args.repeat, "goal_s": GOAL_S,
           "overview_goal_s": OVERVIEW_GOAL_S, "pages": results, "commit": git_commit(),
           "machine": {"python": platform.python_version(), "platform": platform.platform()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ui_pages.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out / 'ui_pages.json'}")


if __name__ == "__main__":
    main()
