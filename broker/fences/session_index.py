"""Which subscriptions a session holds: the index a session's end and HEARTBEAT SYNC read.

Non-lite handles are members of the set ``keys.session_handles(client)``
(``…:subs``). A client may hold a hundred thousand lite subscriptions, so
those are kept compactly instead: in 16 bucket hashes per client,
``keys.session_lmqs(client, b)`` with ``b = crc32(lmq) % 16``; the field is
``group|lmq|topic`` (group and lmq never contain '|', check_name sees to it;
the topic goes last, so it may), the value empty. The group of a lite SUB
without GROUP (``default``) is written empty, ``|lmq|topic``: 7 bytes less a
subscription (a group name is never empty). Entries written before that,
``default|lmq|topic``, are read as the same handle; holding one counts it as
held and letting go removes either form (lua/lite_hold.lua, lua/lite_release.lua).
Small buckets stay listpack-encoded (see docs/data-model.md).

The commands are built by pure functions (``*_command``), so a benchmark
writing sessions in bulk sends exactly what the broker sends; the async
helpers run them on a ``redis.asyncio`` client or cluster (bytes or str
replies).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from fencemq.errors import BadArgument
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.handles import Handle
from fencemq.model.meta import LITE_GROUP
from fencemq.model.values import text

BUCKETS = 16

Command = list[str]


def bucket(lmq: str) -> int:
    return zlib.crc32(lmq.encode()) % BUCKETS


def field(handle: Handle) -> str:
    """A lite handle's field in its bucket: ``group|lmq|topic``, the group empty when it is
    ``default`` (its member is the bucket's client)."""
    lmq, group = handle.queue.lmq, handle.group
    if lmq is None or "|" in lmq or "|" in group or not group:
        raise BadArgument(f"{handle.encode()[:64]!r} is not a lite subscription handle SUB could have returned")
    return f"{'' if group == LITE_GROUP else group}|{lmq}|{handle.queue.topic}"


def legacy_field(handle: Handle) -> str:
    """The field a ``default`` group's entry had before it was written empty (still read)."""
    return f"{handle.group}|{handle.queue.lmq}|{handle.queue.topic}"


def entry_args(handle: Handle) -> list[str]:
    """What lua/lite_hold.lua and lua/lite_release.lua take for a lite handle: its field, then the
    field an older entry of it may still be under (the same field when its group is not ``default``)."""
    return [field(handle), legacy_field(handle)]


def handle_of(client: str, text: str) -> Handle:
    """The handle a bucket field of the client stands for (either form of the default group)."""
    group, lmq, topic = text.split("|", 2)
    return Handle(QueueRef(topic, lmq), group or LITE_GROUP, client)


def bucket_key(keys: Keyspace, handle: Handle) -> str:
    return keys.session_lmqs(handle.member, bucket(handle.queue.lmq))  # type: ignore[arg-type]


def bucket_keys(keys: Keyspace, client: str) -> list[str]:
    return [keys.session_lmqs(client, b) for b in range(BUCKETS)]


def add_command(keys: Keyspace, handle: Handle) -> Command:
    """Replies 1 when the handle was not held yet."""
    if handle.queue.lite:
        return ["HSETNX", bucket_key(keys, handle), field(handle), ""]
    return ["SADD", keys.session_handles(handle.member), handle.encode()]


def remove_command(keys: Keyspace, handle: Handle) -> Command:
    """Replies how many entries it removed (a lite one: either form of its field)."""
    if handle.queue.lite:
        return ["HDEL", bucket_key(keys, handle), *dict.fromkeys((field(handle), legacy_field(handle)))]
    return ["SREM", keys.session_handles(handle.member), handle.encode()]


def read_commands(keys: Keyspace, client: str) -> list[Command]:
    """The non-lite set, then every bucket's fields: parse the replies with :func:`entries`."""
    return [["SMEMBERS", keys.session_handles(client)], *(["HKEYS", k] for k in bucket_keys(keys, client))]


def count_commands(keys: Keyspace, client: str) -> list[Command]:
    """Replies that sum to the number of subscriptions the client holds."""
    return [["SCARD", keys.session_handles(client)], *(["HLEN", k] for k in bucket_keys(keys, client))]


def entries(client: str, replies: Sequence[Iterable[Any]]) -> list[Handle | str]:
    """The replies to :func:`read_commands` as handles; an entry that is none stays its text."""
    members, *buckets = replies
    out: list[Handle | str] = []
    for raw in members:
        try:
            out.append(Handle.decode(text(raw)))
        except BadArgument:
            out.append(text(raw))
    for fields in buckets:
        for f in map(text, fields):
            out.append(handle_of(client, f) if f.count("|") >= 2 else f)
    return out


async def _pipelined(redis: Any, commands: list[Command]) -> list[Any]:
    async with redis.pipeline(transaction=False) as pipe:
        for cmd in commands:
            pipe.execute_command(*cmd)
        return await pipe.execute()


async def add(redis: Any, keys: Keyspace, handle: Handle) -> bool:
    """Record a handle the client now holds; True if it was not held yet."""
    return bool(int(await redis.execute_command(*add_command(keys, handle))))


async def remove(redis: Any, keys: Keyspace, handle: Handle) -> bool:
    """Forget a handle; True if it was held."""
    return bool(int(await redis.execute_command(*remove_command(keys, handle))))


async def all_entries(redis: Any, keys: Keyspace, client: str) -> list[Handle | str]:
    """Every handle the client holds, lite or not (an entry that is no handle as its text)."""
    return entries(client, await _pipelined(redis, read_commands(keys, client)))


async def handles(redis: Any, keys: Keyspace, client: str) -> list[Handle]:
    """Every handle the client holds; an entry that is no handle is BADARG, as Handle.decode makes it."""
    found = await all_entries(redis, keys, client)
    return [h if isinstance(h, Handle) else Handle.decode(h) for h in found]


async def non_lite_handles(redis: Any, keys: Keyspace, client: str) -> list[Handle]:
    return [Handle.decode(text(raw)) for raw in await redis.smembers(keys.session_handles(client))]


async def lite_handles(redis: Any, keys: Keyspace, client: str, topic: str, group: str) -> list[Handle]:
    """The client's lite handles of (topic, group), from all the buckets."""
    buckets = await _pipelined(redis, [["HKEYS", k] for k in bucket_keys(keys, client)])
    found = entries(client, [(), *buckets])
    return [h for h in found if isinstance(h, Handle) and h.queue.topic == topic and h.group == group]


async def count(redis: Any, keys: Keyspace, client: str) -> int:
    return sum(int(n) for n in await _pipelined(redis, count_commands(keys, client)))
