"""The PySpark analytics job (spark/analytics.py) and the `snapshot`/`analyze` CLI commands.

Every Spark test shares ONE SparkSession (session fixture ``spark``: local[2],
UI off, 2 shuffle partitions): starting one costs seconds. Every figure the
job writes is checked against the same figure computed here in plain Python
(pyarrow + loops, no Spark) from the same snapshot; the fence audit is checked
on a clean snapshot (all zero) and on one seeded with violations.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
import typer
from redis.asyncio import Redis
from typer.testing import CliRunner

from fencemq.config import Config
from fencemq.fences.core import Core
from fencemq.model.handles import Handle
from fencemq.ops.journal_buckets import bucket_of, buckets_of, spark_hash, write_buckets

from fencemq.server.embedded import free_port
from tests.helpers import publish_then_settle_one
from tests.ops.test_snapshot import run, run_workload, snapshot_to

pyspark = pytest.importorskip("pyspark", reason="the [spark] extra (pyspark) is not installed")

from fencemq.spark.analytics import AGE_BUCKETS, RESULT_TABLES, analyze, build_session

# Every test here uses the one session (directly or through the CLI, which reuses a running one).
# A cold JVM on a busy 2-core machine can take a minute for the first job: more than the default timeout.
pytestmark = [pytest.mark.usefixtures("spark"), pytest.mark.timeout(600)]


@pytest.fixture(scope="session")
def spark():
    session = build_session("local[2]", shuffle_partitions=2,  # every snapshot here is small: a JVM for short jobs
                            conf={"spark.ui.showConsoleProgress": "false"}, small_input=True)
    yield session
    session.stop()


@pytest.fixture(scope="module")
def snapshot_dir(redis_server, tmp_path_factory) -> Path:
    """The scripted workload of tests/test_snapshot.py, snapshotted once for this module."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    run(run_workload(redis_server.url))
    out = tmp_path_factory.mktemp("analytics") / "snap"
    run(snapshot_to(redis_server.url, out))
    return out


@pytest.fixture(scope="module")
def analysis(spark, snapshot_dir: Path) -> tuple[dict[str, Any], Path]:
    out = snapshot_dir.parent / "analysis"
    return analyze(spark, snapshot_dir, out), out


# -- plain-Python reference implementation ------------------------------------------------------


def table(directory: Path, name: str) -> list[dict[str, Any]]:
    path = directory / f"{name}.parquet"
    if path.is_dir():  # a Spark output directory
        return pq.read_table(path).to_pylist() if any(path.glob("*.parquet")) else []
    return pq.read_table(path).to_pylist()


def result(out: Path, name: str) -> list[dict[str, Any]]:
    files = sorted((out / name).glob("*.parquet"))
    return [row for f in files for row in pq.read_table(f).to_pylist()]


def keyed(rows: list[dict[str, Any]], *key: str) -> dict[tuple, dict[str, Any]]:
    out = {}
    for row in rows:
        k = tuple(row[c] for c in key)
        assert k not in out, f"duplicate key {k}"
        out[k] = row
    return out


class Reference:
    """Every analytics figure, computed from the snapshot's Parquet files with loops."""

    def __init__(self, snap: Path) -> None:
        self.queues = {q["queue"]: q for q in table(snap, "queues")}
        self.groups = table(snap, "groups")
        self.members = table(snap, "members")
        self.ready = table(snap, "ready")
        self.checkouts = table(snap, "checkouts")
        self.journal = sorted(table(snap, "journal"), key=lambda e: (e["queue"], e["seq"]))

    def name(self, queue: str) -> tuple[str, str | None]:
        q = self.queues.get(queue)
        return (q["topic"], q["lmq"]) if q else (None, None)

    def backlog(self) -> dict[tuple, dict[str, Any]]:
        out = {}
        for g in self.groups:
            q = self.queues[g["queue"]]
            key = (g["queue"], g["group"])
            unread = max(0, q["seq"] - max(g["cursor"], q["first"]) + 1)
            ready = sum(1 for r in self.ready if (r["queue"], r["group"]) == key and r["due_ms"] is None)
            delayed = sum(1 for r in self.ready if (r["queue"], r["group"]) == key and r["due_ms"] is not None)
            checkouts = sum(1 for c in self.checkouts if (c["queue"], c["group"]) == key)
            age = q["snapshot_ms"] - g["oldest_pending_ms"] if g["oldest_pending_ms"] is not None else None
            out[key] = dict(topic=q["topic"], lmq=q["lmq"], unread=unread, ready=ready, delayed=delayed,
                            checkouts=checkouts, backlog=unread + ready, oldest_unacked_age_ms=age)
        return out

    def backlog_by_topic(self) -> dict[tuple, dict[str, Any]]:
        out: dict[tuple, dict[str, Any]] = {}
        for (queue, group), b in self.backlog().items():
            row = out.setdefault((b["topic"], group), dict(queues=0, queues_with_backlog=0, unread=0, ready=0,
                                                           delayed=0, checkouts=0, backlog=0,
                                                           max_oldest_unacked_age_ms=None))
            row["queues"] += 1
            row["queues_with_backlog"] += b["backlog"] > 0
            for k in ("unread", "ready", "delayed", "checkouts", "backlog"):
                row[k] += b[k]
            age = b["oldest_unacked_age_ms"]
            if age is not None and (row["max_oldest_unacked_age_ms"] is None or age > row["max_oldest_unacked_age_ms"]):
                row["max_oldest_unacked_age_ms"] = age
        return out

    def group_activity(self) -> dict[tuple, dict[str, Any]]:
        names = {"out": "outs", "ack": "acks", "nack": "nacks", "discard": "discards", "dead": "dead_letters",
                 "timeout": "timeouts", "preempt": "preemptions", "evict": "evictions", "fenced": "fenced_pulls",
                 "seek": "seeks", "sub": "subscribes", "leave": "leaves", "purge": "purges",
                 "replay": "replays"}
        out: dict[tuple, dict[str, Any]] = {}
        for e in self.journal:
            if e["group"] is None:
                continue
            row = out.setdefault((e["queue"], e["group"]), {**{v: 0 for v in names.values()}, "redeliveries": 0,
                                                              "max_acquisitions": None, "first_ms": e["ms"],
                                                              "last_ms": e["ms"]})
            if e["event"] in names:
                row[names[e["event"]]] += 1
            if e["event"] == "out":
                acq = int(e["extra"])
                row["redeliveries"] += acq > 1
                row["max_acquisitions"] = max(row["max_acquisitions"] or 0, acq)
            row["first_ms"], row["last_ms"] = min(row["first_ms"], e["ms"]), max(row["last_ms"], e["ms"])
        return out

    def per_message(self) -> dict[tuple, int]:
        best: dict[tuple, int] = {}
        for e in self.journal:
            if e["event"] == "out":
                k = (e["queue"], e["group"], e["id"])
                best[k] = max(best.get(k, 0), int(e["extra"]))
        return best

    def delivery_counts(self) -> dict[int, dict[str, int]]:
        events = Counter(int(e["extra"]) for e in self.journal if e["event"] == "out")
        messages = Counter(self.per_message().values())
        return {n: dict(out_events=events.get(n, 0), messages=messages.get(n, 0)) for n in set(events) | set(messages)}

    def consumers(self) -> dict[tuple, dict[str, Any]]:
        out: dict[tuple, dict[str, Any]] = {}

        def row(key: tuple) -> dict[str, Any]:
            return out.setdefault(key, dict(outs=0, acks=0, nacks=0, lock_expiries=0, suspicions=0,
                                            suspected_now=False, evicted_by=None, delivered=None))

        sweeps = defaultdict(set)
        for e in self.journal:
            if e["member"] is None or e["event"] not in ("out", "ack", "nack", "discard", "timeout"):
                continue
            r = row((e["queue"], e["group"], e["member"]))
            if e["event"] == "out":
                r["outs"] += 1
            elif e["event"] == "ack":
                r["acks"] += 1
            elif e["event"] in ("nack", "discard"):
                r["nacks"] += 1
            else:
                r["lock_expiries"] += 1
                sweeps[(e["queue"], e["group"], e["member"])].add(e["ms"])
        for key, times in sweeps.items():
            out[key]["suspicions"] = len(times)
        for m in self.members:
            r = row((m["queue"], m["group"], m["member"]))
            r.update(suspected_now=m["suspected"], evicted_by=m["marker"], delivered=m["delivered"])
        return out

    def preemptions(self) -> dict[tuple, dict[str, Any]]:
        out: dict[tuple, dict[str, Any]] = {}
        for e in self.journal:
            if e["event"] not in ("preempt", "evict", "fenced"):
                continue
            r = out.setdefault((e["queue"], e["group"]), dict(preemptions=0, evictions=0, fenced_pulls=0,
                                                                owners=set(), evicted=set(), first_ms=None,
                                                                last_ms=None))
            r["owners"].add(e["member"])  # every client around the churn, as the meta counters name them
            if e["event"] == "fenced":
                r["fenced_pulls"] += 1
                continue
            if e["event"] == "preempt":
                r["preemptions"] += 1
                r["owners"].add(e["extra"])
                r["evicted"].add(e["extra"])
            else:
                r["evictions"] += 1
                r["evicted"].add(e["member"])
            r["first_ms"] = e["ms"] if r["first_ms"] is None else min(r["first_ms"], e["ms"])
            r["last_ms"] = e["ms"] if r["last_ms"] is None else max(r["last_ms"], e["ms"])
        for r in out.values():
            r["owners"], r["evicted"] = len(r["owners"]), len(r["evicted"])
            r["source"] = "journal"
        # the counters in meta (every lmq, journal or not): each figure is the larger of the two
        for g in self.groups:
            if not (g["preemptions"] or g["evictions"] or g["fenced_pulls"]):
                continue
            key = (g["queue"], g["group"])
            j = out.get(key)
            m = dict(preemptions=g["preemptions"], evictions=g["evictions"], fenced_pulls=g["fenced_pulls"],
                     owners=len(g["churn_clients"]), evicted=0, first_ms=g["first_churn_ms"],
                     last_ms=g["last_churn_ms"], source="meta")
            if j is not None:
                m = {k: max(m[k], j[k]) for k in ("preemptions", "evictions", "fenced_pulls", "owners", "evicted")} | dict(
                    first_ms=min(x for x in (m["first_ms"], j["first_ms"]) if x is not None),
                    last_ms=max(x for x in (m["last_ms"], j["last_ms"]) if x is not None), source="meta+journal")
            out[key] = m
        return out

    def seeks(self) -> dict[tuple, dict[str, Any]]:
        groups = {(g["queue"], g["group"]): g for g in self.groups}
        out: dict[tuple, dict[str, Any]] = {}
        for e in self.journal:
            if e["event"] != "seek":
                continue
            key = (e["queue"], e["group"])
            r = out.setdefault(key, dict(seeks=0, earliest=0, latest=0, id=0, time=0, last_seek_ms=0,
                                         max_seek_epoch=0, epoch=groups[key]["epoch"], cursor=groups[key]["cursor"]))
            r["seeks"] += 1
            r[e["extra"]] += 1
            r["last_seek_ms"] = max(r["last_seek_ms"], e["ms"])
            r["max_seek_epoch"] = max(r["max_seek_epoch"], e["epoch"])
        return out

    def audit(self) -> dict[str, set[tuple]]:
        """A state machine over each queue's journal, in journal order."""
        rewind_on_preempt = {(g["queue"], g["group"]) for g in self.groups if g["on_preempt"] == "earliest"}
        evicted_out, stale, doubles = set(), set(), set()
        by_queue = defaultdict(list)
        for e in self.journal:
            by_queue[e["queue"]].append(e)
        for queue, events in by_queue.items():
            fenced: dict[tuple, bool] = {}
            epoch: dict[str, int] = {}
            generation: dict[str, int] = defaultdict(int)
            acked: Counter = Counter()
            for e in events:
                g, ev = e["group"], e["event"]
                if ev in ("sub", "seek", "preempt"):
                    epoch[g] = max(epoch.get(g, e["epoch"]), e["epoch"])
                if ev == "preempt":
                    fenced[(g, e["extra"])] = True
                    if (queue, g) in rewind_on_preempt:
                        generation[g] += 1
                elif ev == "evict":
                    fenced[(g, e["member"])] = True
                elif ev == "sub":
                    fenced[(g, e["member"])] = False
                elif ev == "seek":
                    generation[g] += 1
                elif ev == "out":
                    if fenced.get((g, e["member"])):
                        evicted_out.add((queue, g, e["member"], e["seq"]))
                    if g in epoch and e["epoch"] < epoch[g]:
                        stale.add((queue, g, e["member"], e["seq"]))
                elif ev == "ack":
                    acked[(g, e["id"], generation[g])] += 1
            doubles |= {(queue, g, i, n) for (g, i, _gen), n in acked.items() if n > 1}
        return {"evicted_out": evicted_out, "stale_epoch": stale, "double_ack": doubles}


def spark_audit(out: Path) -> dict[str, set[tuple]]:
    return {
        "evicted_out": {(r["queue"], r["group"], r["member"], r["seq"]) for r in result(out, "audit_evicted_out")},
        "stale_epoch": {(r["queue"], r["group"], r["member"], r["seq"]) for r in result(out, "audit_stale_epoch")},
        "double_ack": {(r["queue"], r["group"], r["id"], r["acks"]) for r in result(out, "audit_double_ack")},
    }


def pick(row: dict[str, Any], *cols: str) -> dict[str, Any]:
    return {c: row[c] for c in cols}


# =====================================================================================


@pytest.mark.long  # `make test-long` (.ci/run) runs it, to keep make test short
def test_every_figure_matches_an_independent_computation(analysis, snapshot_dir: Path) -> None:
    summary, out = analysis
    ref = Reference(snapshot_dir)

    for name in RESULT_TABLES:
        assert (out / name).is_dir(), name
        assert summary["tables"][name] == len(result(out, name)), name

    backlog = keyed(result(out, "backlog"), "queue", "group")
    expected = ref.backlog()
    assert backlog.keys() == expected.keys()
    for key, exp in expected.items():
        assert pick(backlog[key], *exp) == exp, key

    by_topic = keyed(result(out, "backlog_by_topic"), "topic", "group")
    expected = ref.backlog_by_topic()
    assert by_topic.keys() == expected.keys()
    for key, exp in expected.items():
        assert pick(by_topic[key], *exp) == exp, key

    activity = keyed(result(out, "group_activity"), "queue", "group")
    expected = ref.group_activity()
    assert activity.keys() == expected.keys()
    for key, exp in expected.items():
        assert pick(activity[key], *exp) == exp, key
        assert (activity[key]["topic"], activity[key]["lmq"]) == ref.name(key[0])

    redeliveries = keyed(result(out, "redeliveries"), "queue", "group")
    per_message = ref.per_message()
    expected = {k: dict(outs=a["outs"], redeliveries=a["redeliveries"], max_acquisitions=a["max_acquisitions"],
                        messages=sum(1 for (q, g, _i) in per_message if (q, g) == k))
                for k, a in ref.group_activity().items() if a["outs"]}
    assert redeliveries.keys() == expected.keys()
    for key, exp in expected.items():
        assert pick(redeliveries[key], *exp) == exp, key

    counts = keyed(result(out, "delivery_counts"), "acquisitions")
    assert {k[0]: pick(v, "out_events", "messages") for k, v in counts.items()} == ref.delivery_counts()

    consumers = keyed(result(out, "consumers"), "queue", "group", "member")
    expected = ref.consumers()
    assert consumers.keys() == expected.keys()
    for key, exp in expected.items():
        assert pick(consumers[key], *exp) == exp, key

    preemptions = keyed(result(out, "preemptions"), "queue", "group")
    expected = ref.preemptions()
    assert preemptions.keys() == expected.keys()
    for key, exp in expected.items():
        assert pick(preemptions[key], *exp) == exp, key
    by_group = keyed(result(out, "preemptions_by_group"), "topic", "group")
    exp_by_group: dict[tuple, dict[str, int]] = {}
    for (queue, group), p in expected.items():
        r = exp_by_group.setdefault((ref.name(queue)[0], group), dict(queues=0, preemptions=0, evictions=0,
                                                                     fenced_pulls=0))
        r["queues"] += 1
        for k in ("preemptions", "evictions", "fenced_pulls"):
            r[k] += p[k]
    assert {k: pick(v, *next(iter(exp_by_group.values()))) for k, v in by_group.items()} == exp_by_group

    seeks = keyed(result(out, "seeks"), "queue", "group")
    expected = ref.seeks()
    assert seeks.keys() == expected.keys()
    for key, exp in expected.items():
        assert pick(seeks[key], *exp) == exp, key

    assert {r["event"]: r["count"] for r in result(out, "events")} == Counter(e["event"] for e in ref.journal)

    # totals in the summary
    t = summary["totals"]
    b, a = ref.backlog(), ref.group_activity()
    assert t["queues"] == len(ref.queues) and t["lmqs"] == sum(1 for q in ref.queues.values() if q["kind"] == "lmq")
    assert t["groups"] == len(ref.groups) and t["members"] == len(ref.members)
    assert t["journal_events"] == len(ref.journal)
    for k in ("backlog", "unread", "ready", "delayed", "checkouts"):
        assert t[k] == sum(x[k] for x in b.values()), k
    assert t["max_oldest_unacked_age_ms"] == max(x["oldest_unacked_age_ms"] for x in b.values()
                                                 if x["oldest_unacked_age_ms"] is not None)
    for k in ("outs", "redeliveries", "acks", "nacks", "timeouts", "seeks"):
        assert t[k] == sum(x[k] for x in a.values()), k
    churn = ref.preemptions()
    for k in ("preemptions", "evictions", "fenced_pulls"):
        assert t[k] == sum(x[k] for x in churn.values()), k
    cons = ref.consumers()
    assert t["suspicions"] == sum(c["suspicions"] for c in cons.values())
    assert t["suspected_now"] == sum(1 for c in cons.values() if c["suspected_now"])


@pytest.mark.long  # `make test-long` (.ci/run) runs it, to keep make test short
def test_figures_reflect_the_workload(analysis) -> None:
    """The scripted workload's known facts, as the analytics report them."""
    summary, out = analysis
    consumers = keyed(result(out, "consumers"), "queue", "group", "member")
    c3 = consumers[("t:orders", "audit", "c3")]
    assert (c3["lock_expiries"], c3["suspicions"], c3["suspected_now"]) == (3, 1, True)
    assert consumers[("l:chat:room1", "default", "alice")]["evicted_by"] == "bob"
    preemptions = keyed(result(out, "preemptions"), "queue", "group")
    room1, room2 = preemptions[("l:chat:room1", "default")], preemptions[("l:chat:room2", "default")]
    assert (room1["preemptions"], room1["evictions"], room1["fenced_pulls"], room1["owners"]) == (1, 0, 1, 2)
    assert room1["clients"] == ["alice", "bob"] and room1["source"] == "meta+journal"
    assert (room2["preemptions"], room2["evictions"], room2["fenced_pulls"]) == (0, 1, 1)
    room4 = preemptions[("l:chat:room4", "default")]
    assert (room4["preemptions"], room4["owners"], room4["evicted"]) == (1, 2, 1)
    activity = keyed(result(out, "group_activity"), "queue", "group")
    assert activity[("l:chat:room4", "default")]["acks"] == 3  # id 1 acked again after the rewind: legitimate
    seeks = keyed(result(out, "seeks"), "queue", "group")
    assert pick(seeks[("t:orders", "replay")], "seeks", "earliest", "epoch") == dict(seeks=1, earliest=1, epoch=1)
    counts = {r["acquisitions"]: r for r in result(out, "delivery_counts")}
    assert counts[2]["out_events"] >= 3  # id 3 in billing, ids 1 and 2 in room1
    backlog = keyed(result(out, "backlog"), "queue", "group")
    assert backlog[("t:orders", "audit")]["ready"] == 3 and backlog[("t:orders", "billing")]["delayed"] == 1
    assert all(b["oldest_unacked_age_ms"] >= 0 for b in backlog.values() if b["oldest_unacked_age_ms"] is not None)
    assert verdicts(summary) == {"verdict": "PASS", "evicted_out": 0, "stale_epoch": 0, "double_ack": 0,
                                 "marked_holding": 0, "stale_checkout": 0}


@pytest.mark.long  # `make test-long` (.ci/run) runs it, to keep make test short
def test_clean_snapshot_passes_the_audit_and_the_report_shows_it(analysis, snapshot_dir: Path) -> None:
    _, out = analysis
    assert spark_audit(out) == Reference(snapshot_dir).audit() == {"evicted_out": set(), "stale_epoch": set(),
                                                                   "double_ack": set()}
    html = (out / "report.html").read_text()
    assert "<div class='verdict PASS'>PASS</div>" in html
    # one file that opens offline: every plot inlined, nothing fetched
    images = re.findall(r"src='([^']*)'", html)
    assert len(images) == 6 and all(src.startswith("data:image/png;base64,") for src in images)
    for src in images:
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert not re.search(r"(href|src)=['\"]?(https?:|//)", html) and "<script" not in html
    assert not list(out.glob("*.png"))
    assert json.loads((out / "summary.json").read_text())["audit"]["verdict"] == "PASS"
    assert all(label.replace("<", "&lt;").replace(">", "&gt;") in html for _, label in AGE_BUCKETS)
    # the audit comes first, then the sections in reading order
    order = [html.index(h) for h in ("1. Fence audit", "2. Backlog", "3. Redeliveries", "4. Consumers",
                                     "5. Preemption churn", "6. Seeks")]
    assert order == sorted(order)


def verdicts(summary: dict[str, Any]) -> dict[str, Any]:
    audit = summary["audit"]
    return {k: audit[k] for k in ("verdict", "evicted_out", "stale_epoch", "double_ack", "marked_holding",
                                  "stale_checkout")}


def seed_violations(src: Path, dst: Path) -> dict[str, set[tuple]]:
    """Copy a snapshot and append, to its journal, what a broken fence would have written."""
    shutil.copytree(src, dst)
    path = dst / "journal.parquet"
    journal = pq.read_table(path)
    rows = sorted(journal.to_pylist(), key=lambda r: (r["queue"], r["seq"]))
    last = defaultdict(int)
    for r in rows:
        last[r["queue"]] = max(last[r["queue"]], r["seq"])

    def add(queue: str, **fields: Any) -> int:
        last[queue] += 1
        base = dict(queue=queue, seq=last[queue], ms=rows[-1]["ms"], event=None, group=None, member=None, id=None,
                    tag=None, epoch=None, extra=None)
        rows.append({**base, **fields})
        return last[queue]

    # (a) alice was preempted in room1 and never subscribed again: a checkout to her now is a breach
    a = add("l:chat:room1", event="out", group="default", member="alice", id=3, tag="901", epoch=0, extra="1")
    # (b) the replay group sought to epoch 1: a checkout under epoch 0 afterwards is stale
    b = add("t:orders", event="out", group="replay", member="c4", id=5, tag="902", epoch=0, extra="1")
    # (c) billing's id 1 was acked once; acking it again with no seek between is a double ack
    add("t:orders", event="ack", group="billing", member="c2", id=1, tag="903", epoch=0)
    # not violations: an ack again after a seek, an out to bob (the owner), an out after alice subscribes again
    add("t:orders", event="ack", group="replay", member="c4", id=2, tag="904", epoch=1)
    add("l:chat:room1", event="out", group="default", member="bob", id=3, tag="905", epoch=0, extra="2")
    add("l:chat:room2", event="sub", group="default", member="alice", id=3, epoch=0, extra="exclusive")
    add("l:chat:room2", event="out", group="default", member="alice", id=3, tag="906", epoch=0, extra="1")
    shutil.rmtree(path)  # written again in its buckets: each queue's rows where Spark looks for them
    write_buckets(pa.Table.from_pylist(rows, schema=journal.schema), path,
                  json.loads((dst / "manifest.json").read_text())["journal_buckets"])
    return {"evicted_out": {("l:chat:room1", "default", "alice", a)},
            "stale_epoch": {("t:orders", "replay", "c4", b)},
            "double_ack": {("t:orders", "billing", 1, 2)}}


# -- the CLI (typer's runner, on an app of our own with register(app)) -----------------------------


@pytest.fixture
def cli() -> typer.Typer:
    from fencemq.cli.analytics import register

    app = typer.Typer(add_completion=False)
    register(app)
    return app


@pytest.mark.long  # `make test-long` (.ci/run) runs it, to keep make test short
def test_seeded_violations_are_caught_via_the_cli(cli: typer.Typer, snapshot_dir: Path, tmp_path: Path) -> None:
    seeded = tmp_path / "seeded"
    expected = seed_violations(snapshot_dir, seeded)
    assert Reference(seeded).audit() == expected  # the reference agrees on what is a violation

    res = CliRunner().invoke(cli, ["analyze", str(seeded), "--out", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 3, res.output  # audit failed
    summary = json.loads(res.stdout)
    assert verdicts(summary) == {"verdict": "FAIL", "evicted_out": 1, "stale_epoch": 1, "double_ack": 1,
                                 "marked_holding": 0, "stale_checkout": 0}
    assert spark_audit(tmp_path / "out") == expected
    row = result(tmp_path / "out", "audit_evicted_out")[0]
    assert (row["evicted_by"], row["topic"], row["lmq"]) == ("bob", "chat", "room1")
    assert row["resubscribed_at"] is None and row["evicted_at"] < row["seq"]
    row = result(tmp_path / "out", "audit_double_ack")[0]
    assert (row["members"], row["tags"]) == (["c1", "c2"], [row["tags"][0], "903"])
    html = (tmp_path / "out" / "report.html").read_text()
    assert "<div class='verdict FAIL'>FAIL</div>" in html
    for tag in ("901", "902", "903"):
        assert f"{tag}</td>" in html


@pytest.mark.long  # `make test-long` (.ci/run) runs it, to keep make test short
def test_the_journal_buckets_put_each_queue_where_spark_hashes_it(spark) -> None:
    from pyspark.sql import functions as F

    ids = ["", "a", "ab", "abc", "abcd", "t:orders", "l:chat:room1", "l:bench:lmq-0000042", "f:c1:a/+/#",
           "l:t%3Ax:%7Broom%7D", "l:caf\u00e9:\u00fc\u20ac\U0001f600", "x" * 41, "\x7f\x80\xff"]
    for buckets in (1, 2, 8, 13):
        df = spark.createDataFrame([(q,) for q in ids], "queue string")
        rows = df.select("queue", F.hash("queue").alias("h"), F.pmod(F.hash("queue"), F.lit(buckets)).alias("b"))
        spark_says = {r["queue"]: (r["h"], r["b"]) for r in rows.collect()}
        assert {q: (spark_hash(q), bucket_of(q, buckets)) for q in ids} == spark_says
        assert list(buckets_of(pa.array(ids), buckets)) == [spark_says[q][1] for q in ids]


@pytest.mark.long  # a Spark job or two more: `make test-long` runs it
def test_a_journal_in_one_file_gives_the_same_tables_as_its_buckets(spark, analysis, snapshot_dir: Path,
                                                                    tmp_path: Path) -> None:
    """A snapshot from before the buckets: the job shuffles its journal instead, to the same result."""
    summary, out = analysis
    assert json.loads((snapshot_dir / "manifest.json").read_text())["journal_buckets"] == 8
    assert sorted(p.name for p in (snapshot_dir / "journal.parquet").iterdir()) == [
        f"bucket_{b:05d}.parquet" for b in range(8)]
    old = tmp_path / "one-file"
    shutil.copytree(snapshot_dir, old)
    journal = pq.read_table(old / "journal.parquet")
    shutil.rmtree(old / "journal.parquet")
    pq.write_table(journal, old / "journal.parquet")
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["journal_buckets"]
    (old / "manifest.json").write_text(json.dumps(manifest))

    again = analyze(spark, old, tmp_path / "out", report=False)
    assert summary["journal_bucketed"] and not again["journal_bucketed"]
    assert again["totals"] == summary["totals"] and again["audit"] == summary["audit"]
    for name in RESULT_TABLES:
        def rows(directory: Path) -> list[tuple]:
            return sorted((tuple(sorted((k, repr(v)) for k, v in r.items())) for r in result(directory, name)))
        assert rows(tmp_path / "out") == rows(out), name
    # the job's bucketed table is gone, the snapshot's files are not, and the catalog left no
    # spark-warehouse/ where the job ran
    assert not [t for t in spark.catalog.listTables() if t.name.startswith("fencemq_journal_")]
    assert not Path("spark-warehouse").exists()
    assert len(list((snapshot_dir / "journal.parquet").iterdir())) == 8


@pytest.mark.long  # `make test-long` (.ci/run) runs it, to keep make test short
def test_a_small_snapshot_gives_the_same_tables_with_the_settings_for_small_inputs_as_without(
        spark, analysis, snapshot_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings for small inputs (one partition, no adaptive plans, no generated code) are an
    optimisation: held against the settings every larger snapshot runs with."""
    from fencemq.spark import session

    summary, out = analysis
    assert session.is_small(snapshot_dir)
    monkeypatch.setattr(session, "SMALL_ROWS", -1)  # as if it were large
    assert not session.is_small(snapshot_dir)
    settings = {key: spark.conf.get(key, None) for key in session.SMALL_INPUT_CONF}
    large = analyze(spark, snapshot_dir, tmp_path / "large", report=False)
    assert large["totals"] == summary["totals"] and large["audit"] == summary["audit"]
    for name in RESULT_TABLES:
        def rows(directory: Path) -> list[tuple]:
            return sorted((tuple(sorted((k, repr(v)) for k, v in r.items())) for r in result(directory, name)))
        assert rows(tmp_path / "large") == rows(out), name
    assert {key: spark.conf.get(key, None) for key in session.SMALL_INPUT_CONF} == settings, "settings left behind"


async def lite_churn_workload(url: str) -> None:
    """What a new user tries, with the default config (lmqs keep no journal): 4 lmq preemptions
    (two of them one room flapping between two clients) and an operator eviction."""
    r = Redis.from_url(url)
    q = Core(r, Config(redis_url=url))
    try:
        for room in ("r1", "r2", "r3"):
            await q.publishing.publish("rooms", [b"hello", b"again"], lmq=room)
        await q.subscriptions.subscribe("ann", "rooms", lmq="r1")
        await q.subscriptions.subscribe("ben", "rooms", lmq="r1")  # 1
        await q.subscriptions.subscribe("ann", "rooms", lmq="r1")  # 2
        await q.subscriptions.subscribe("ben", "rooms", lmq="r1")  # 3
        ann2 = Handle.decode((await q.subscriptions.subscribe("ann", "rooms", lmq="r2")).handle)
        await q.leases.pull(ann2, 1)
        await q.subscriptions.subscribe("cat", "rooms", lmq="r2")  # 4: ann's checkout goes back
        assert (await q.leases.pull(ann2, 1)).status == "evicted"  # a fenced pull
        dan3 = Handle.decode((await q.subscriptions.subscribe("dan", "rooms", lmq="r3")).handle)
        assert await q.lite.evict(dan3, by="ops") == 0  # the operator's eviction
    finally:
        await r.aclose()


@pytest.mark.long  # a Spark job or two more: `make test-long` runs it
def test_lite_churn_without_a_journal_is_in_the_report_and_the_audit_says_what_it_proved(
        cli: typer.Typer, redis_url: str, tmp_path: Path) -> None:
    run(lite_churn_workload(redis_url))
    snap = tmp_path / "snap"
    run(snapshot_to(redis_url, snap))
    assert pq.read_table(snap / "journal.parquet").num_rows == 0, "no journal: lmqs keep none by default"

    res = CliRunner().invoke(cli, ["analyze", str(snap), "--out", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    t = summary["totals"]
    assert (t["preemptions"], t["evictions"], t["fenced_pulls"], t["lmqs_with_churn"]) == (4, 1, 1, 3)
    churn = keyed(result(tmp_path / "out", "preemptions"), "lmq")
    assert pick(churn[("r1",)], "preemptions", "evictions", "owners", "clients", "source") == dict(
        preemptions=3, evictions=0, owners=2, clients=["ann", "ben"], source="meta")
    assert pick(churn[("r2",)], "preemptions", "fenced_pulls", "clients") == dict(
        preemptions=1, fenced_pulls=1, clients=["ann", "cat"])
    assert pick(churn[("r3",)], "preemptions", "evictions", "clients") == dict(
        preemptions=0, evictions=1, clients=["dan"])
    assert all(r["first_ms"] <= r["last_ms"] for r in churn.values())

    # the audit: state checks on all 3 lmqs, history checks on none of them, said plainly
    audit = summary["audit"]
    assert audit["verdict"] == "PASS"
    assert audit["scope"]["history_not_checked"] == {"lmq": 3}
    assert audit["scope"]["state"]["marked_members"] == 3  # ann in r1 and r2, dan in r3 (ben's went with his SUB)
    by_check = {c["check"]: c for c in audit["checks"]}
    assert (by_check["marked_holding"]["queues"], by_check["marked_holding"]["kind"]) == (3, "state")
    assert (by_check["evicted_out"]["queues"], by_check["evicted_out"]["kind"]) == (0, "history")

    html = (tmp_path / "out" / "report.html").read_text()
    churn_section = html[html.index("5. Preemption churn"):html.index("6. Seeks")]
    assert "4 preemptions, 1 operator evictions and 1 fenced pulls in 3 subscriptions, 3 of them on lmqs" in \
        churn_section
    assert "ann, ben" in churn_section and "nothing to show" not in churn_section
    assert "did not run on 3 lmq queues" in html
    human = CliRunner().invoke(cli, ["analyze", str(snap), "--out", str(tmp_path / "out2")])
    assert "history checks not run on 3 lmq queues" in human.stdout
    assert "preemptions 4, evictions 1 (3 lmqs churned)" in human.stdout


@pytest.mark.long  # `make test-long` (.ci/run) runs it, to keep make test short
def test_an_evicted_client_holding_a_checkout_fails_the_state_audit(cli: typer.Typer, snapshot_dir: Path,
                                                                   tmp_path: Path) -> None:
    seeded = tmp_path / "seeded"
    shutil.copytree(snapshot_dir, seeded)
    path = seeded / "checkouts.parquet"
    rows = pq.read_table(path).to_pylist()
    # alice was preempted in room1 (her marker says bob): holding a checkout there is a breach
    rows.append(dict(queue="l:chat:room1", tag="999", group="default", member="alice", id=3, epoch=0,
                     acquisitions=1, failures=0, deadline_ms=None))
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(path)), path)
    res = CliRunner().invoke(cli, ["analyze", str(seeded), "--out", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 3, res.output
    assert verdicts(json.loads(res.stdout)) == {"verdict": "FAIL", "evicted_out": 0, "stale_epoch": 0,
                                                "double_ack": 0, "marked_holding": 1, "stale_checkout": 0}
    row = result(tmp_path / "out", "audit_marked_holding")[0]
    assert pick(row, "lmq", "member", "marker", "tag") == dict(lmq="room1", member="alice", marker="bob", tag="999")


@pytest.mark.long  # a Spark job or two more: `make test-long` runs it
def test_analyze_reads_a_chain_of_incremental_snapshots_as_one_full_snapshot(redis_url: str, spark,
                                                                               tmp_path: Path) -> None:
    run(lite_churn_workload(redis_url))
    run(snapshot_to(redis_url, tmp_path / "s0"))

    async def more() -> None:
        r = Redis.from_url(redis_url)
        q = Core(r, Config(redis_url=redis_url))
        try:
            await q.subscriptions.subscribe("ann", "rooms", lmq="r2")  # a 5th preemption
            await q.publishing.publish("rooms", [b"new"], lmq="r4")
        finally:
            await r.aclose()

    s1 = run(snapshot_to(redis_url, tmp_path / "s1", since=tmp_path / "s0"))
    run(more())
    s2 = run(snapshot_to(redis_url, tmp_path / "s2", since=tmp_path / "s1"))
    assert s1.unchanged == 3 and s2.unchanged == 2 and s2.counts["groups"] == 1  # r2 read again, r4 new
    run(snapshot_to(redis_url, tmp_path / "full"))

    chained = analyze(spark, tmp_path / "s2", tmp_path / "a-chain")
    full = analyze(spark, tmp_path / "full", tmp_path / "a-full")
    assert chained["totals"]["preemptions"] == 5 and chained["chain"] == [str(tmp_path / "s2"), "../s1", "../s0"]
    assert chained["journal_bucketed"] and full["journal_bucketed"]  # the chain's buckets line up
    def same(totals: dict[str, Any]) -> dict[str, Any]:  # the oldest message's age grows between the two
        return {k: v for k, v in totals.items() if k != "max_oldest_unacked_age_ms"}

    assert same(chained["totals"]) == same(full["totals"])
    for name in ("backlog", "preemptions", "consumers"):
        def rows(out: Path) -> list[tuple]:
            return sorted(tuple(sorted((k, str(v)) for k, v in r.items() if k != "oldest_unacked_age_ms"))
                          for r in result(out, name))
        assert rows(tmp_path / "a-chain") == rows(tmp_path / "a-full"), name


@pytest.mark.long  # a Spark job or two more: `make test-long` runs it
def test_a_chain_reads_its_journals_in_their_buckets_to_the_same_tables_as_a_full_snapshot(
        redis_url: str, spark, tmp_path: Path) -> None:
    run(run_workload(redis_url))  # lmqs with journals: the unchanged ones' events come from the base
    run(snapshot_to(redis_url, tmp_path / "s0"))

    run(publish_then_settle_one(redis_url, Config(redis_url=redis_url, lite_journal_cap=10_000),
                                publish_to="room3", settle_on="room3", client="carol", pull=2))
    s1 = run(snapshot_to(redis_url, tmp_path / "s1", since=tmp_path / "s0"))
    assert s1.unchanged == 3 and s1.journal_buckets == 8  # rooms 1, 2 and 4
    run(snapshot_to(redis_url, tmp_path / "full"))

    chained = analyze(spark, tmp_path / "s1", tmp_path / "a-chain", report=False)
    full = analyze(spark, tmp_path / "full", tmp_path / "a-full", report=False)
    assert chained["journal_bucketed"] and chained["totals"]["journal_events"] == full["totals"]["journal_events"]
    aging = ("oldest_unacked_age_ms", "max_oldest_unacked_age_ms")  # grows between the two snapshots
    assert {k: v for k, v in chained["totals"].items() if k not in aging} == {
        k: v for k, v in full["totals"].items() if k not in aging}
    for name in RESULT_TABLES:
        def rows(out: Path) -> list[tuple]:
            return sorted(tuple(sorted((k, repr(v)) for k, v in r.items() if k not in aging))
                          for r in result(out, name))
        assert rows(tmp_path / "a-chain") == rows(tmp_path / "a-full"), name


@pytest.mark.long  # a Spark job or two more: `make test-long` runs it
def test_cli_snapshot_then_analyze(cli: typer.Typer, redis_url: str, tmp_path: Path) -> None:
    run(run_workload(redis_url))
    snap = tmp_path / "snap"
    runner = CliRunner()
    res = runner.invoke(cli, ["snapshot", "--redis-url", redis_url, "--out", str(snap), "--json",
                              "--journal-buckets", "3"])
    assert res.exit_code == 0, res.output
    manifest = json.loads(res.stdout)
    assert manifest["queues"] == 5 and manifest["schema_version"] == 3 and manifest["source"] == redis_url
    assert manifest["journal_buckets"] == 3 and len(list((snap / "journal.parquet").iterdir())) == 3
    for name, rows in manifest["counts"].items():
        assert pq.read_table(snap / f"{name}.parquet").num_rows == rows

    human = runner.invoke(cli, ["snapshot", "--redis-url", redis_url, "--out", str(tmp_path / "again")])
    assert human.exit_code == 0, human.output
    assert "5 queues from 1 master(s)" in human.stdout
    since = runner.invoke(cli, ["snapshot", "--redis-url", redis_url, "--out", str(tmp_path / "next"),
                                "--since", str(snap), "--json"])
    assert since.exit_code == 0, since.output
    # t:orders has a push member: read in full; the lmqs are as snap read them
    assert pick(json.loads(since.stdout), "queues", "unchanged", "base") == dict(queues=5, unchanged=4, base="../snap")
    missing = runner.invoke(cli, ["snapshot", "--redis-url", redis_url, "--out", str(tmp_path / "x"),
                                  "--since", str(tmp_path / "nothing")])
    assert missing.exit_code == 1 and "no snapshot at" in missing.stderr and not (tmp_path / "x").exists()

    res = runner.invoke(cli, ["analyze", str(snap), "--out", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["audit"]["verdict"] == "PASS" and summary["totals"]["queues"] == 5
    assert summary["report"] == str(tmp_path / "out" / "report.html")
    assert (tmp_path / "out" / "report.html").is_file()

    # a chain whose snapshots have other buckets (3, then the default 8) is shuffled, to the same figures
    chained = runner.invoke(cli, ["analyze", str(tmp_path / "next"), "--out", str(tmp_path / "out2"), "--json",
                                  "--no-report"])
    assert chained.exit_code == 0, chained.output
    chained_summary = json.loads(chained.stdout)
    assert summary["journal_bucketed"] and not chained_summary["journal_bucketed"]
    aging = "max_oldest_unacked_age_ms"
    assert {k: v for k, v in chained_summary["totals"].items() if k != aging} == {
        k: v for k, v in summary["totals"].items() if k != aging}

    from pyspark import SparkContext
    assert SparkContext._active_spark_context is not None  # the CLI reused the session and left it running


def test_cli_errors(cli: typer.Typer, tmp_path: Path) -> None:
    runner = CliRunner()
    url = f"redis://127.0.0.1:{free_port()}/0"
    res = runner.invoke(cli, ["snapshot", "--redis-url", url, "--out", str(tmp_path / "s")])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and url in lines[0] and lines[0].startswith("fencemq snapshot: cannot reach Redis")
    assert not (tmp_path / "s" / "manifest.json").exists()

    res = runner.invoke(cli, ["snapshot", "--redis-url", "redis://:secret@127.0.0.1:1/0", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "secret" not in res.stderr and "***" in res.stderr

    res = runner.invoke(cli, ["analyze", str(tmp_path / "nothing-here")])
    assert res.exit_code == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "no snapshot at" in lines[0] and "manifest.json" in lines[0]

    (tmp_path / "v4").mkdir()
    (tmp_path / "v4" / "manifest.json").write_text(json.dumps({"schema_version": 4}))
    res = runner.invoke(cli, ["analyze", str(tmp_path / "v4")])
    assert res.exit_code == 1 and "schema version 4" in res.stderr


def test_python_dash_m_spark_help() -> None:
    import subprocess

    res = subprocess.run([sys.executable, "-m", "spark", "--help"], capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0 and "SNAPSHOT" in res.stdout.upper()


def as_version_2(src: Path, dst: Path) -> None:
    """``src`` rewritten as a version-2 snapshot would hold it: without the scheduled and priority columns."""
    shutil.copytree(src, dst)
    for name, columns in (("queues", ("scheduled", "priority", "held_by_level")), ("groups", ("unread_by_level",))):
        table = pq.read_table(dst / f"{name}.parquet")
        pq.write_table(table.drop_columns(list(columns)), dst / f"{name}.parquet")
    manifest = json.loads((dst / "manifest.json").read_text())
    (dst / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 2}))


@pytest.mark.long  # runs two analyses
def test_priority_levels_and_scheduled_counts_are_analysed_and_an_older_snapshot_reads_without_them(
        spark, redis_url: str, tmp_path: Path) -> None:
    from tests.helpers import client, worker
    from tests.ops.test_snapshot import priority_workload

    with worker(redis_url) as w:
        c = client(w.port, 2, "p1")
        priority_workload(redis_url, c)
        c.close()
    run(snapshot_to(redis_url, tmp_path / "snap"))
    summary = analyze(spark, tmp_path / "snap", tmp_path / "out", report=False)
    assert (summary["totals"]["scheduled"], summary["totals"]["priority_queues"]) == (2, 1)
    levels = sorted((r["queue"], r["level"], r["group"], r["held"], r["unread"])
                    for r in result(tmp_path / "out", "priority_levels"))
    assert levels == [("t:urgent", 0, "fast", 1, 1), ("t:urgent", 0, "slow", 1, 1),
                      ("t:urgent", 1, "fast", 3, 2), ("t:urgent", 1, "slow", 3, 3),
                      ("t:urgent", 9, "fast", 2, 0), ("t:urgent", 9, "slow", 2, 1)]
    backlog = keyed(result(tmp_path / "out", "backlog"), "queue", "group")
    assert backlog[("t:urgent", "slow")]["unread"] == 5  # per level, not seq - its low-water cursor (6)
    assert backlog[("t:urgent", "slow")]["unread_by_level"] == [1, 3, 0, 0, 0, 0, 0, 0, 0, 1]

    as_version_2(tmp_path / "snap", tmp_path / "old")
    old = analyze(spark, tmp_path / "old", tmp_path / "old-out", report=False)
    assert (old["totals"]["scheduled"], old["totals"]["priority_queues"]) == (0, 0)
    assert result(tmp_path / "old-out", "priority_levels") == []
    assert keyed(result(tmp_path / "old-out", "backlog"), "queue", "group")[("t:urgent", "slow")][
        "unread_by_level"] is None
