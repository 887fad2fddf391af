"""Snapshots: every queue's whole state, one atomic fence call per queue, as Parquet.

``take_snapshot`` walks the queues (SCAN for their meta hashes, on every
master of a Cluster, then the lmqs at rest in their slots' rest hashes:
ops/listing.py), runs ``lua/snapshot.lua`` on each (pipelined, ``batch``
queues per round trip) and writes one Parquet file per table plus
``manifest.json`` (written last: a directory without it is not a finished
snapshot).

Consistency is per queue, which is where every invariant lives: all of one
queue's rows come from one fence call. Push mailboxes are the only keys whose
names the fence cannot know in advance (Cluster wants every key in KEYS), so
a queue with push members is read twice: the first call's meta says which
members have a mailbox, the second call passes their mailbox keys and is
kept only if its own meta names exactly the same members (up to
``MAILBOX_ATTEMPTS`` calls; a queue whose push members keep changing is
kept with null mailbox depths and counted in the manifest). Queues without
push members cost one call.

Incremental snapshots (``since``: an earlier snapshot's directory): every
queue is still visited (SCAN finds the queues that exist now), but each fence
call carries the digest of the queue's state as the base snapshot read it;
a queue whose state still hashes the same answers with its digest alone and
gets one row in ``unchanged`` instead of its rows. Every fence write changes
the state it hashes, whichever fence it was (a publish, a pull, an ack, a
sweep, a preemption), so this is exact where a write time kept by some
fences only would not be. The manifest names its ``base``; the analytics
job reads the chain (spark/analytics.py ``load_tables``). A queue with push
members is always read in full (its first call cannot name its mailboxes).

The tables, their schemas and how a fence reply becomes rows: broker/ops/snapshot_tables.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from fencemq.fences.operator import SNAPSHOT
from fencemq.fences.lua_sources import sources
from fencemq.model.keys import Keyspace
from fencemq.model.values import text as _s
from fencemq.ops import listing
from fencemq.ops.journal_buckets import DEFAULT_BUCKETS
from fencemq.ops.operations import is_cluster_client, primaries, scan_step
from fencemq.ops.snapshot_tables import SCHEMA_VERSION, SCHEMAS, Manifest, TableWriter, decode_reply

__all__ = ["SCHEMAS", "Manifest", "SnapshotError", "take_snapshot"]

MAILBOX_ATTEMPTS = 4
MAX_ERRORS_LISTED = 100

Progress = Callable[[int, "int | None"], None]


class SnapshotError(Exception):
    pass


def base_digests(base: str | Path) -> dict[str, str]:
    """Each queue's state digest in a finished snapshot (the queues it read and the ones it found unchanged)."""
    import pyarrow.parquet as pq

    root = Path(base)
    if not (root / "manifest.json").is_file():
        raise SnapshotError(f"no finished snapshot at {root} (manifest.json missing)")
    found = Manifest.load(root)
    if found.schema_version != SCHEMA_VERSION:
        raise SnapshotError(f"snapshot at {root} has schema version {found.schema_version}; an incremental "
                            f"snapshot builds on version {SCHEMA_VERSION}: take a full one first")
    digests: dict[str, str] = {}
    for table in ("queues", "unchanged"):
        path = root / f"{table}.parquet"
        if path.exists():
            t = pq.read_table(path, columns=["queue", "digest"])
            digests.update(zip(t.column("queue").to_pylist(), t.column("digest").to_pylist(), strict=True))
    return digests


def _source_of(redis: Any) -> str:
    """Where the client points, without any password."""
    if is_cluster_client(redis):
        nodes = ",".join(f"{n.host}:{n.port}" for n in redis.get_primaries())
        return f"redis-cluster://{nodes}"
    kw = getattr(getattr(redis, "connection_pool", None), "connection_kwargs", {}) or {}
    if "path" in kw:
        return f"unix://{kw['path']}?db={kw.get('db', 0)}"
    scheme = "rediss" if kw.get("ssl") else "redis"
    user = f"{kw['username']}@" if kw.get("username") else ""
    return f"{scheme}://{user}{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


async def _scan(redis: Any, node: Any, pattern: str, count: int):
    """Yield batches of queue ids from one master (each at most once)."""
    seen: set[bytes] = set()
    cursor = 0
    while True:
        cursor, keys = await scan_step(redis, node, cursor, pattern, count)
        fresh = []
        for k in keys:
            if k not in seen:
                seen.add(k)
                fresh.append(Keyspace.qid_from_meta_key(_s(k)))
        if fresh:
            yield fresh
        if cursor == 0:
            return


class _Fence:
    """The snapshot fence by EVALSHA, (re)loaded on every master when a server does not know it."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.source = sources()["snapshot"]
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def load(self) -> None:
        await self.redis.script_load(self.source)  # on a Cluster: every master

    async def run(self, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        for attempt in range(3):
            pipe = self.redis.pipeline(transaction=False)
            for keys, args in calls:
                # (not pipe.evalsha: redis-py's Cluster pipeline blocks that name, not the command)
                pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
            results = await pipe.execute(raise_on_error=False)
            if not any(isinstance(r, NoScriptError) or (isinstance(r, ResponseError) and "NOSCRIPT" in str(r))
                       for r in results) or attempt == 2:
                return results
            await self.load()
        return results  # pragma: no cover


def _relative(base: str | Path, out: Path) -> str:
    """The base as a path relative to the new snapshot (a chain moves as one directory tree)."""
    return os.path.relpath(Path(base).resolve(), out.resolve())


async def take_snapshot(
    redis: Any,
    keyspace: Keyspace,
    out_dir: str | Path,
    progress: Progress | None = None,
    *,
    batch: int = 100,
    log_entries: int = 0,
    journal_entries: int = -1,
    source: str | None = None,
    since: str | Path | None = None,
    journal_buckets: int = DEFAULT_BUCKETS,
) -> Manifest:
    """Snapshot every queue under ``keyspace`` into ``out_dir``; returns the manifest.

    ``redis`` is a ``redis.asyncio.Redis`` or ``redis.asyncio.RedisCluster``
    (bytes replies, i.e. without decode_responses). ``progress(done, total)``
    is called after each pipeline round (total is None: SCAN does not know it).
    ``log_entries``: per queue, list this many log entries (oldest first) in
    ``messages``; ``journal_entries``: the newest this many journal events per
    queue (-1 = all that Redis keeps). ``since``: a finished snapshot to build
    on (incremental: queues whose state it read as it is now are not read
    again; see the module docstring). ``journal_buckets``: the journal is
    written as this many files bucketed by queue (broker/ops/journal_buckets.py;
    the analytics job runs one task per bucket).
    """
    if batch < 1:
        raise ValueError("batch must be at least 1")
    out = Path(out_dir)
    digests = base_digests(since) if since is not None else {}
    if since is not None and Path(since).resolve() == out.resolve():
        raise SnapshotError("an incremental snapshot cannot replace its own base: give it another directory")
    out.mkdir(parents=True, exist_ok=True)
    stale = out / "manifest.json"
    if stale.exists():
        stale.unlink()  # a half-rewritten directory must not look finished
    journal = out / "journal.parquet"
    if journal.is_dir():
        shutil.rmtree(journal)  # another bucket count would leave stale buckets behind
    elif journal.exists():
        journal.unlink()  # a snapshot from before the buckets
    started_wall, started = datetime.now(UTC), time.perf_counter()
    fence = _Fence(redis)
    await fence.load()
    writer = TableWriter(out, journal_entries, journal_buckets)
    nodes = await primaries(redis)
    done = vanished = unsettled = same = 0
    errors: list[str] = []
    error_count = 0
    first_ms: int | None = None
    last_ms: int | None = None
    def calls_for(qids: list[str], guess: dict[str, list[tuple[str, str]]]) -> list[tuple[list[str], list[Any]]]:
        calls = []
        for qid in qids:
            k = keyspace.queue_by_id(qid)
            boxes = [k.mailbox(g, m) for g, m in guess.get(qid, [])]
            # a second call (mailboxes named) must read in full: the first found a change
            calls.append((SNAPSHOT.key_list(k, {}, boxes),
                          [log_entries, journal_entries, "" if qid in guess else digests.get(qid, "")]))
        return calls

    async def finish(qids: list[str], fetching: asyncio.Task) -> None:
        """Decode one batch (and read again the queues whose push members it did not know)."""
        nonlocal done, vanished, unsettled, same, error_count, first_ms, last_ms
        guess: dict[str, list[tuple[str, str]]] = {}
        todo, results = qids, await fetching
        for attempt in range(MAILBOX_ATTEMPTS):
            redo = []
            for qid, res in zip(todo, results, strict=True):
                if isinstance(res, Exception):
                    error_count += 1
                    if len(errors) < MAX_ERRORS_LISTED:
                        errors.append(f"{qid}: {type(res).__name__}: {res}")
                    continue
                if len(res) == 3 and res[1] == b"unchanged":
                    now = int(res[0])
                    writer.unchanged(qid, now, _s(res[2]))
                    done += 1
                    same += 1
                    first_ms = now if first_ms is None else min(first_ms, now)
                    last_ms = now if last_ms is None else max(last_ms, now)
                    continue
                q = decode_reply(qid, res)
                if q is None:
                    vanished += 1
                    continue
                asked = guess.get(qid, [])
                if q.push != asked and attempt < MAILBOX_ATTEMPTS - 1:
                    guess[qid] = q.push
                    redo.append(qid)
                    continue
                if q.push != asked:
                    unsettled += 1
                    boxes = None
                else:
                    boxes = dict(zip(asked, (int(d) for d in res[7]), strict=True))
                writer.add(q, boxes)
                done += 1
                first_ms = q.now if first_ms is None else min(first_ms, q.now)
                last_ms = q.now if last_ms is None else max(last_ms, q.now)
            if not redo:
                break
            todo = redo
            results = await fence.run(calls_for(todo, guess))
        if progress:
            progress(done, None)

    async def batches():
        listed: set[str] = set()  # an lmq that came to rest after its key was read is not read twice
        pending: list[str] = []
        for node in nodes:
            async for qids in _scan(redis, node, keyspace.queue_pattern(), 1000):
                listed.update(qids)
                pending.extend(qids)
                while len(pending) >= batch:
                    yield pending[:batch]
                    pending = pending[batch:]
            if pending:
                yield pending
                pending = []
        # the lmqs at rest have no meta key: their slots' rest hashes name them (the fence reads the rest)
        async for qids in listing.rested_qids(redis, keyspace):
            pending.extend(q for q in qids if q not in listed)
            while len(pending) >= batch:
                yield pending[:batch]
                pending = pending[batch:]
        if pending:
            yield pending

    # One batch in flight while the previous one is decoded: Redis runs the fences of the next
    # batch while Python turns the last one into rows.
    in_flight: tuple[list[str], asyncio.Task] | None = None
    try:
        async for qids in batches():
            task = asyncio.create_task(fence.run(calls_for(qids, {})))
            await asyncio.sleep(0)  # let it send its pipeline
            if in_flight is not None:
                await finish(*in_flight)
            in_flight = (qids, task)
        if in_flight is not None:
            await finish(*in_flight)
            in_flight = None
    finally:
        if in_flight is not None and not in_flight[1].done():
            in_flight[1].cancel()
        counts = writer.close()

    elapsed = time.perf_counter() - started
    manifest = Manifest(
        schema_version=SCHEMA_VERSION,
        created=started_wall.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        source=source or _source_of(redis),
        prefix=keyspace.prefix,
        nodes=len(nodes),
        queues=done,
        counts=counts,
        tables={name: f"{name}.parquet" for name in SCHEMAS},
        first_snapshot_ms=first_ms,
        last_snapshot_ms=last_ms,
        duration_s=round(elapsed, 3),
        queues_per_s=round(done / elapsed, 1) if elapsed > 0 else 0.0,
        log_entries=log_entries,
        journal_entries=journal_entries,
        vanished=vanished,
        mailbox_unsettled=unsettled,
        errors=errors,
        error_count=error_count,
        base=_relative(since, out) if since is not None else None,
        unchanged=same,
        journal_buckets=journal_buckets,
    )
    tmp = out / "manifest.json.tmp"
    tmp.write_text(manifest.to_json() + "\n")
    tmp.replace(out / "manifest.json")
    return manifest
