"""Every operator read sees an lmq at rest as it saw it with a meta key of its own.

An lmq at rest keeps its meta hash as a field of its slot's rest hash and has no meta key
(fences/at_rest.py). A broker with plain topics, busy lmqs and idle ones is read by each reader
twice — every lmq's meta a key (woken by hand), then the idle ones at rest (tests/resting.py,
as the fence rests them) — and each reader answers the same: listing with and without filters and
page by page, the rows of a listing, inspection of a queue and of a session, ``fencemq status``,
the dashboard's looks, the full count behind the totals, ``top`` and a snapshot.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from fencemq.cli import status
from fencemq.model.keys import Keyspace, QueueRef, queue_ref
from fencemq.ops import dashboard, inspection, maintenance, operations, totals
from fencemq.ops.operations import QueueFilter
from fencemq.ops.snapshot import take_snapshot
from tests.helpers import as_map, client, deliveries, direct, direct_async, worker
from tests.resting import rest_all, wake_all

KEYS = Keyspace("fmq")
IDLE = [f"s-{i}" for i in range(1, 9)]  # chat lmqs whose owner holds nothing: they may rest
FILTERS = {
    "all": QueueFilter(),
    "lite": QueueFilter(kind="lite"),
    "plain": QueueFilter(kind="plain"),
    "topic chat": QueueFilter(topic="chat"),
    "topic room, lite": QueueFilter(kind="lite", topic="room"),
    "lmq glob": QueueFilter(kind="lite", topic="chat", match="s-[1-4]", match_lmq=True),
    "topic glob": QueueFilter(match="r*"),
}
# what depends on the moment of reading, not on the state read
MOMENT = {"now_ms", "idle_s", "expires_in_s", "age_s", "since_ms", "deadline_ms", "lease_expires_in_s",
          "ms_since_poll", "taken_ms", "oldest_pending_ms", "at_ms", "elapsed_s", "alive", "snapshot_ms"}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def timeless(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: timeless(v) for k, v in value.items() if k not in MOMENT and not k.endswith("_in_s")}
    if isinstance(value, list | tuple):
        return [timeless(v) for v in value]
    return value


@pytest.fixture
def broker(redis_url: str):
    """orders (plain, a checkout held), chat[s-1..s-8] idle with an owner each (s-8 after a message
    it acked), chat[busy] with unread messages, room[a], room[b] idle. The worker is stopped before
    the test reads: nothing but the readers touches the state (its sweeper would wake an lmq)."""
    with worker(redis_url) as w:
        pub = client(w.port, 2, "producer")
        pub.execute_command("MPUB", "orders", 3, "o1", "o2", "o3")
        c1 = client(w.port, 2, "c1")
        h = as_map(c1.execute_command("SUB", "orders", "GROUP", "billing", "LOCK", 60_000))["handle"]
        assert len(deliveries(c1.execute_command("PULL", h, "COUNT", 1))) == 1
        owners = {}
        for lmq in IDLE:
            owners[lmq] = client(w.port, 2, f"own-{lmq}")
            handle = as_map(owners[lmq].execute_command("SUB", "chat", "LMQ", lmq))["handle"]
            if lmq == "s-8":
                pub.execute_command("PUB", "chat", "hello", "LMQ", lmq)
                (d,) = deliveries(owners[lmq].execute_command("PULL", handle, "COUNT", 1))
                assert owners[lmq].execute_command("ACK", handle, d["tag"]) == 1
        busy = client(w.port, 2, "busy-owner")
        busy.execute_command("SUB", "chat", "LMQ", "busy")
        pub.execute_command("PUB", "chat", "one", "LMQ", "busy")
        pub.execute_command("PUB", "chat", "two", "LMQ", "busy")
        for lmq in ("a", "b"):
            owners[lmq] = client(w.port, 2, f"room-{lmq}")
            owners[lmq].execute_command("SUB", "room", "LMQ", lmq)
    yield


def qids_of(url: str) -> list[str]:
    async def main() -> list[str]:
        r = direct_async(url)
        try:
            return sorted((await operations.scan_queues(r, KEYS, limit=10_000)).qids)
        finally:
            await r.aclose()
    return run(main())


def every_page(url: str, flt: QueueFilter, limit: int, keys: Keyspace = KEYS) -> list[list[str]]:
    """A whole listing, page by page, each page's cursor given back as the CLI would."""
    async def main() -> list[list[str]]:
        r = direct_async(url)
        pages, cursor = [], None
        try:
            while True:
                page = await operations.scan_queues(r, keys, flt, limit=limit, cursor=cursor)
                if cursor is not None and cursor.startswith("rest:"):
                    assert len(page.qids) <= limit, f"a page among the lmqs at rest is longer than {limit}"
                pages.append(page.qids)
                cursor = page.cursor
                if cursor is None:
                    return [p for p in pages if p]
        finally:
            await r.aclose()
    return run(main())


def read_everything(url: str, qids: list[str], out: Path) -> dict[str, Any]:
    """What every reader says of the broker: plain data, the moment of reading left out."""
    async def main() -> dict[str, Any]:
        r = direct_async(url)
        try:
            now = await operations.now_ms(r)
            seen: dict[str, Any] = {}
            for name, flt in FILTERS.items():
                seen[f"list {name}"] = sorted((await operations.scan_queues(r, KEYS, flt, limit=10_000)).qids)
            seen["rows"] = timeless(sorted(await operations.queue_rows(r, KEYS, qids, now), key=lambda x: x["qid"]))
            listed = await operations.list_queues(r, KEYS, QueueFilter(kind="lite", topic="chat"), limit=100)
            seen["list_queues rows"] = timeless(listed.rows)
            for qid in qids:
                seen[f"inspect {qid}"] = timeless(await inspection.inspect_queue(r, KEYS, queue_ref(qid)))
            for lmq in IDLE:
                seen[f"session own-{lmq}"] = timeless(await inspection.inspect_session(r, KEYS, f"own-{lmq}"))
                ref = QueueRef("chat", lmq)
                seen[f"member {lmq}"] = timeless(await inspection.inspect_member(r, KEYS, ref, "default", f"own-{lmq}"))
                seen[f"group {lmq}"] = timeless(await inspection.inspect_group(r, KEYS, ref, "default"))
            seen["looks"] = timeless(await dashboard.queue_looks(r, KEYS, qids))
            seen["full count"] = await totals.full_count(r, KEYS)
            top = await maintenance.top_sample(r, KEYS, maintenance.TopState(), limit=100)
            seen["top"] = (top["queues_seen"], timeless(sorted(top["queues"], key=lambda row: row["qid"])))
            manifest = await take_snapshot(r, KEYS, out)
            seen["snapshot queues"] = manifest.queues
            seen["snapshot errors"] = manifest.errors
        finally:
            await r.aclose()
        table = pq.read_table(out / "queues.parquet").to_pylist()
        seen["snapshot"] = timeless(sorted(table, key=lambda row: row["queue"]))
        return seen

    seen = run(main())
    seen["status"] = timeless(status.collect(direct(url))["queues"])
    return seen


def test_every_reader_sees_an_lmq_at_rest_as_it_saw_it_with_a_meta_key(broker, redis_url: str,
                                                                       tmp_path: Path) -> None:
    r = direct(redis_url)
    qids = qids_of(redis_url)
    wake_all(r, KEYS, qids)  # the fences may have rested them already: every meta a key first
    assert all(r.exists(KEYS.queue_by_id(q).meta) for q in qids)
    before = read_everything(redis_url, qids, tmp_path / "keys")

    rested = rest_all(r, KEYS, qids)
    assert sorted(rested) == sorted([QueueRef("chat", lmq).qid for lmq in IDLE] + ["l:room:a", "l:room:b"])
    assert not any(r.exists(KEYS.queue_by_id(q).meta) for q in rested)
    after = read_everything(redis_url, qids, tmp_path / "rest")

    assert after.keys() == before.keys()
    for what in before:
        assert after[what] == before[what], f"{what} reads otherwise with the lmqs at rest"


def test_a_listing_page_by_page_lists_each_queue_once_with_its_lmqs_at_rest(broker, redis_url: str) -> None:
    r = direct(redis_url)
    qids = qids_of(redis_url)
    wake_all(r, KEYS, qids)
    rest_all(r, KEYS, qids)
    for name, flt in FILTERS.items():
        expected = sorted(q for q in qids if flt.accepts(q))
        for limit in (1, 2, 3, 100):
            listed = [q for page in every_page(redis_url, flt, limit) for q in page]
            assert sorted(listed) == expected, f"{name}, pages of {limit}"
            assert len(listed) == len(set(listed)), f"{name}, pages of {limit}: a queue listed twice"


def test_a_slot_holding_more_lmqs_at_rest_than_a_page_is_listed_across_pages(redis_url: str) -> None:
    """Many lmqs at rest in one slot (a hash tag's worth, made by hand): a page stops between two of
    them and the next starts after the last one listed."""
    r = direct(redis_url)
    keys = Keyspace("crowd")
    k = keys.queue_by_id("l:t:x")
    names = [f"l:t:{i:03d}" for i in range(25)]
    packed = b"\x82\xa1z\xa1o"  # any value: the listing reads the fields only
    r.hset(k.rest, mapping=dict.fromkeys(names, packed))
    pages = every_page(redis_url, QueueFilter(kind="lite", topic="t"), 4, keys)
    assert all(len(p) == 4 for p in pages[:-1]) and sum(pages, []) == names
    assert every_page(redis_url, QueueFilter(kind="lite", topic="t", match="01?", match_lmq=True), 3, keys) == \
        [[f"l:t:01{i}" for i in range(3)], [f"l:t:01{i}" for i in range(3, 6)], [f"l:t:01{i}" for i in range(6, 9)],
         ["l:t:019"]]
