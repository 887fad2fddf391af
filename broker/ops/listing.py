"""Listing queues: a page of queue ids at a time, and the cursor to continue from.

Listing is SCAN-based (``MATCH`` on the queues' meta hashes, ``TYPE hash``),
one master after another on a Cluster, then walks the lmqs at rest, which have
no meta key (the rest hashes, slot after slot: below); a page
stops at ``limit`` queues and returns the cursor to continue from (``"<n>"`` on
one server, ``"<host:port>/<n>"`` on a Cluster: which master, and its SCAN
cursor; ``"rest:<slot>:<the last lmq listed in it>"`` among the lmqs at rest).
SCAN's own guarantees apply: a queue that exists for the whole walk is listed
at least once (a rehash may list it twice across pages), one created or
deleted meanwhile may or may not be; so may an lmq that comes to rest or wakes
during the walk (it moves between the two parts of the walk). The rows of a
page are broker/ops/operations.py's (``queue_rows``, ``list_queues``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fencemq.errors import BadArgument
from fencemq.model.keys import Keyspace, escape, queue_ref
from fencemq.model.slots import SLOTS, key_slot
from fencemq.model.values import text as _s

Progress = Callable[[int, "int | None"], None]

KINDS = {"plain": "t", "lite": "l", "filter": "f"}
KIND_NAMES = {"t": "plain", "l": "lite", "f": "filter"}
SCAN_COUNT = 1000


# -- the server: single or Cluster -------------------------------------------------------


def is_cluster_client(redis: Any) -> bool:
    try:
        from redis.asyncio.cluster import RedisCluster
    except ImportError:  # pragma: no cover
        return False
    return isinstance(redis, RedisCluster)


async def primaries(redis: Any) -> list[Any]:
    """[None] for one server; every master of a Cluster, by name (a stable order for cursors)."""
    if not is_cluster_client(redis):
        return [None]
    await redis.initialize()  # a fresh client knows no node before its first command
    return sorted(redis.get_primaries(), key=lambda n: n.name)


# -- listing -----------------------------------------------------------------------------


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _prefilter(glob: str | None) -> str:
    """A Redis MATCH piece matching (at least) every escaped name the fnmatch glob matches."""
    if not glob or any(c in glob for c in "[]\\"):
        return "*"
    pieces = re.split(r"([*?])", glob)
    out = "".join("*" if p in ("*", "?") else _glob_escape(escape(p)) for p in pieces)
    return re.sub(r"\*+", "*", out)


@dataclass
class QueueFilter:
    """Which queues a listing keeps. ``match`` is an fnmatch glob (case-sensitive) over
    the topic (the filter of a filter queue), or over the lmq name when ``match_lmq``."""

    kind: str | None = None  # plain | lite | filter
    topic: str | None = None
    match: str | None = None
    match_lmq: bool = False

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in KINDS:
            raise BadArgument(f"kind must be one of {', '.join(KINDS)}, not {self.kind!r}")

    def pattern(self, keys: Keyspace, topic_kind: str | None = None) -> str:
        """The SCAN MATCH pattern: as narrow as the filter allows, never narrower."""
        kind = self.kind or topic_kind
        letter = KINDS[kind] if kind else "[tlf]"
        base = f"{keys.prefix}:{{"
        topic = _glob_escape(escape(self.topic)) if self.topic is not None else None
        lmq_part = _prefilter(self.match) if self.match_lmq else "*"
        topic_part = topic if topic is not None else (_prefilter(self.match) if not self.match_lmq else "*")
        if letter == "t":
            return f"{base}t:{topic_part}}}"
        if letter == "l":
            return f"{base}l:{topic_part}:{lmq_part}}}"
        if letter == "f":
            return f"{base}f:*:{topic_part}}}"
        return keys.queue_pattern()

    def rest_match(self, keys: Keyspace, topic_kind: str | None = None) -> str | None:
        """The HSCAN MATCH of the lmqs at rest (their fields are queue ids): the SCAN pattern's hash
        tag; None when the filter keeps no lmq."""
        tag = self.pattern(keys, topic_kind)[len(keys.prefix) + 2 : -1]
        return tag if tag[:1] in ("l", "[") else None

    def accepts(self, qid: str) -> bool:
        if not qid[:2] in ("t:", "l:", "f:"):
            return False
        if self.kind is not None and qid[0] != KINDS[self.kind]:
            return False
        ref = queue_ref(qid)
        if self.topic is not None and ref.topic != self.topic:
            return False
        if self.match is not None:
            name = ref.lmq if self.match_lmq else ref.topic
            if name is None or not fnmatch.fnmatchcase(name, self.match):
                return False
        return True


@dataclass
class Page:
    qids: list[str]
    cursor: str | None  # where the next page starts; None: the walk is complete
    scanned: int  # keys SCAN returned, and lmqs at rest read (before our own filtering)
    nodes: int
    pattern: str
    rows: list[dict[str, Any]] = field(default_factory=list)


_REST_CURSOR = re.compile(r"rest:(\d+):((?:l:.*)?)\Z", re.S)


def _parse_cursor(text: str | None, nodes: list[Any]) -> tuple[int, int] | tuple[int, str]:
    """(master, SCAN cursor) in the walk of the meta keys, or (slot, last lmq) among the lmqs at rest."""
    rest = _REST_CURSOR.match(text or "")
    if rest is not None:
        return int(rest[1]), rest[2]
    if text is None or text in ("", "0"):
        return 0, 0
    name, slash, number = text.rpartition("/")
    try:
        cursor = int(number)
        if cursor < 0:
            raise ValueError
    except ValueError:
        raise BadArgument(f"cursor {text!r} is not one a listing printed; start without --cursor") from None
    if nodes == [None]:
        if slash:
            raise BadArgument(f"cursor {text!r} names a Cluster master but this server is not a Cluster")
        return 0, cursor
    if not slash:
        raise BadArgument(f"cursor {text!r} does not name a Cluster master; give the one the listing printed")
    names = [n.name for n in nodes]
    if name not in names:
        raise BadArgument(f"cursor {text!r} names {name}, which is not a master of this Cluster now; "
                          "start again without --cursor")
    return names.index(name), cursor


def _format_cursor(nodes: list[Any], index: int, cursor: int) -> str:
    return str(cursor) if nodes == [None] else f"{nodes[index].name}/{cursor}"


async def scan_step(redis: Any, node: Any, cursor: int, pattern: str, count: int) -> tuple[int, list[bytes]]:
    """One SCAN of queue meta hashes (``TYPE hash``) on one server, or on one master of a Cluster."""
    if node is None:
        nxt, keys = await redis.scan(cursor, match=pattern, count=count, _type="hash")
    else:
        nxt, keys = await redis.scan(cursor, match=pattern, count=count, _type="hash", target_nodes=node)
        if isinstance(nxt, dict):  # the Cluster client answers {node name: cursor}
            nxt = next(iter(nxt.values()))
    return int(nxt), keys


async def topic_kind(redis: Any, keys: Keyspace, topic: str) -> str | None:
    """plain | lite, as the topic was first used; None for a topic never used."""
    kind = await redis.hget(keys.topic(topic), "kind")
    return _s(kind) if kind is not None else None


async def scan_queues(
    redis: Any,
    keys: Keyspace,
    flt: QueueFilter | None = None,
    *,
    limit: int = 100,
    cursor: str | None = None,
    count: int = SCAN_COUNT,
    progress: Progress | None = None,
) -> Page:
    """One page of queue ids (at most ``limit``, see below) and the cursor of the next page.

    SCAN cannot resume in the middle of a batch, so when a batch would overrun
    the page it is asked again from the same cursor with a smaller COUNT, down
    to one hash bucket, which then starts the next page; only a single bucket
    holding more matches than a whole page makes a page longer than ``limit``.
    Among the lmqs at rest a page ends exactly at ``limit`` (``rested_page``, below).
    """
    if limit < 1:
        raise BadArgument("limit must be at least 1")
    flt = flt or QueueFilter()
    kind = None
    if flt.topic is not None and flt.kind is None:
        kind = await topic_kind(redis, keys, flt.topic)
    pattern = flt.pattern(keys, kind)
    rest_match = flt.rest_match(keys, kind)
    nodes = await primaries(redis)
    start, cur = _parse_cursor(cursor, nodes)
    found: list[str] = []
    seen: set[str] = set()
    scanned = 0
    if isinstance(cur, str):  # among the lmqs at rest
        return await _rested(redis, keys, flt, rest_match, (start, cur), found, seen, scanned, nodes, pattern, limit,
                             progress)
    for index in range(start, len(nodes)):
        node = nodes[index]
        cur = cur if index == start else 0
        n = count
        while True:
            room = limit - len(found)
            while True:
                nxt, batch = await scan_step(redis, node, cur, pattern, n)
                fresh = []
                for raw in batch:
                    qid = Keyspace.qid_from_meta_key(_s(raw))
                    if qid not in seen and flt.accepts(qid):
                        fresh.append(qid)
                if len(set(fresh)) <= room:
                    break
                if n == 1:
                    if found:  # this bucket starts the next page
                        return Page(found, _format_cursor(nodes, index, cur), scanned, len(nodes), pattern)
                    break  # one bucket holds more than a page: take it whole
                n = max(1, n // 4)
            n = min(count, n * 4)
            scanned += len(batch)
            for qid in fresh:
                if qid not in seen:
                    seen.add(qid)
                    found.append(qid)
            cur = nxt
            if progress is not None:
                progress(len(found), None)
            if cur == 0:
                break
            if len(found) >= limit:
                return Page(found, _format_cursor(nodes, index, cur), scanned, len(nodes), pattern)
        if len(found) >= limit and index + 1 < len(nodes):
            return Page(found, _format_cursor(nodes, index + 1, 0), scanned, len(nodes), pattern)
    return await _rested(redis, keys, flt, rest_match, (0, ""), found, seen, scanned, nodes, pattern, limit, progress)


async def _rested(redis: Any, keys: Keyspace, flt: QueueFilter, match: str | None, start: tuple[int, str],
                  found: list[str], seen: set[str], scanned: int, nodes: list[Any], pattern: str, limit: int,
                  progress: Progress | None) -> Page:
    """The rest of a page from the lmqs at rest, from ``start`` (slot, last lmq listed in it) on."""
    if match is None:
        return Page(found, None, scanned, len(nodes), pattern)
    if len(found) >= limit:
        return Page(found, f"rest:{start[0]}:{start[1]}", scanned, len(nodes), pattern)
    # an lmq may have come to rest since the SCAN listed its key on this page: listed once
    rested, nxt, read = await rested_page(redis, keys, match, start, limit - len(found),
                                                  lambda qid: qid not in seen and flt.accepts(qid))
    found += rested
    if progress is not None:
        progress(len(found), None)
    cursor = None if nxt is None else f"rest:{nxt[0]}:{nxt[1]}"
    return Page(found, cursor, scanned + read, len(nodes), pattern)


# -- which lmqs are at rest: the rest hashes, slot after slot -----------------------------------
# A listing walks them in slot order and each one's fields (queue ids) sorted, so a page can end
# between two fields and the next start after the last it listed (scan_queues, above). The rest
# hashes are found by a SCAN of each master (their names: `<prefix>:{<4-char slot tag>}:rest`), so a
# walk costs what the keyspace holds, never a read of all 16,384 slots.


def rest_pattern(keys: Keyspace) -> str:
    return f"{keys.prefix}:{{????}}:rest"


async def rested_slots(redis: Any, keys: Keyspace, start: int = 0) -> list[int]:
    """The slots from ``start`` on whose rest hash holds some lmq, ascending."""
    found: set[int] = set()
    pattern = rest_pattern(keys)
    for node in await primaries(redis):
        cursor = 0
        while True:
            cursor, batch = await scan_step(redis, node, cursor, pattern, SCAN_COUNT)
            found.update(key_slot(_s(k)) for k in batch)
            if cursor == 0:
                break
    return sorted(slot for slot in found if slot >= start)


async def rested_in_slot(redis: Any, keys: Keyspace, slot: int, match: str = "*") -> list[str]:
    """The ids of the lmqs at rest in ``slot`` that the glob ``match`` accepts, sorted (each once:
    HSCAN may return a field twice)."""
    (key,) = keys.rest_keys([slot])
    found: set[str] = set()
    cursor = 0
    while True:
        cursor, batch = await redis.hscan(key, cursor, match=match, count=1000)
        found.update(_s(f) for f in batch)
        if int(cursor) == 0:
            return sorted(found)


async def rested_qids(redis: Any, keys: Keyspace, match: str = "*") -> AsyncIterator[list[str]]:
    """The ids of every lmq at rest that ``match`` accepts, one slot's (sorted) at a time."""
    for slot in await rested_slots(redis, keys):
        qids = await rested_in_slot(redis, keys, slot, match)
        if qids:
            yield qids


def rested_qids_sync(client: Any, keys: Keyspace, match: str = "*") -> Iterator[str]:
    """:func:`rested_qids` for a blocking client (``fencemq status``), one id at a time."""
    slots = sorted({key_slot(_s(k)) for k in client.scan_iter(match=rest_pattern(keys), count=SCAN_COUNT,
                                                              _type="HASH")})
    for key in keys.rest_keys(slots):
        yield from sorted({_s(f) for f, _ in client.hscan_iter(key, match=match, count=1000)})


async def rested_page(redis: Any, keys: Keyspace, match: str, start: tuple[int, str], room: int,
                      accepts: Any = None) -> tuple[list[str], tuple[int, str] | None, int]:
    """Up to ``room`` ids of lmqs at rest (those ``accepts`` keeps, of those the glob ``match`` does)
    in walk order from ``start`` = (slot, the last id listed in it, or ""): the ids, where the next
    page starts (None: no slot is left) and how many ids were read. A page ends between two ids of
    one slot when the slot holds more than its room, so no id is listed twice in one walk."""
    slot, after = start
    found: list[str] = []
    read = 0
    for s in await rested_slots(redis, keys, slot):
        qids = await rested_in_slot(redis, keys, s, match)
        read += len(qids)
        qids = [q for q in qids if (s != slot or q > after) and (accepts is None or accepts(q))]
        if len(qids) > room - len(found):
            found += qids[: room - len(found)]
            return found, (s, found[-1] if found else after), read
        found += qids
        if len(found) >= room:
            return found, ((s + 1, "") if s + 1 < SLOTS else None), read
    return found, None, read
