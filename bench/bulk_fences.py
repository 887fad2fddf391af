"""Fence calls in bulk: pipelined over a raw RESP connection, recorded from the broker's own calls.

``Templates`` records the fence calls ``fencemq.fences.core.Core`` makes
(subscribe, publish, pull, ack) and replays them for other lmqs and clients;
``Bulk`` sends millions of them with a bounded number of writes in flight.
bench.lmq_memory and bench.preempt_rate fill Redis this way.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import redis
import redis.asyncio

from bench.resp import RespConn
from fencemq.config import Config
from fencemq.fences import session_index
from fencemq.fences.core import Core
from fencemq.fences.lua_sources import sources
from fencemq.fences.registry import SPECS
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.handles import Handle

CHUNK = 2000  # commands per write
IN_FLIGHT = 8  # writes outstanding


class Bulk:
    """Pipelined commands over one raw RESP connection, a bounded number of writes in flight."""

    def __init__(self, conn: RespConn) -> None:
        self.conn = conn
        self.pending: deque[list[asyncio.Future]] = deque()

    async def run(self, commands: Iterable[Sequence[Any]], collect: bool = False) -> list[Any]:
        out: list[Any] = []
        batch: list[Sequence[Any]] = []
        for cmd in commands:
            batch.append(cmd)
            if len(batch) >= CHUNK:
                await self._send(batch, out, collect)
                batch = []
        if batch:
            await self._send(batch, out, collect)
        while self.pending:
            await self._settle(out, collect)
        return out

    async def _send(self, batch: list[Sequence[Any]], out: list[Any], collect: bool) -> None:
        self.pending.append(self.conn.send(batch))
        if len(self.pending) >= IN_FLIGHT:
            await self._settle(out, collect)

    async def _settle(self, out: list[Any], collect: bool) -> None:
        for reply in await asyncio.gather(*self.pending.popleft()):
            if isinstance(reply, Exception):
                raise reply
            if collect:
                out.append(reply)


TEMPLATE_LMQ, TEMPLATE_CLIENT = "LMQTPL", "CLITPL"  # placeholders: no byte of them is ever escaped


class Templates:
    """The fence calls fencemq.fences.core.Core makes, recorded from real calls and replayed with other names.

    ``await Templates.record(url, config, r, topic)`` runs Core.subscribe, publish, pull and ack once on a
    template lmq, capturing each fence's name, keys and arguments; ``call(name, lmq, client, ...)`` gives
    the EVALSHA of the same call for another lmq and client. So the benches follow the fences' key
    layout whatever it becomes, and send exactly what the broker sends.
    """

    def __init__(self, shas: dict[str, str], calls: dict[str, tuple[list[str], list[Any]]], topic: str,
                 keyspace: Keyspace) -> None:
        self.shas, self.calls, self.topic, self.keyspace = shas, calls, topic, keyspace
        self.template_rest = keyspace.queue(QueueRef(topic, TEMPLATE_LMQ)).rest

    @classmethod
    async def record(cls, url: str, config: Config, r: redis.Redis, topic: str) -> Templates:
        shas = load_scripts(r)
        conn = redis.asyncio.Redis.from_url(url)
        calls: dict[str, tuple[list[str], list[Any]]] = {}
        try:
            queues = Core(conn, config)
            real = queues.fences.call

            async def recording(name: str, keys: list[str], args: list[Any]) -> Any:
                calls.setdefault(name, (list(keys), list(args)))
                return await real(name, keys, args)

            queues.fences.call = recording  # type: ignore[method-assign]
            sub = await queues.subscriptions.subscribe(TEMPLATE_CLIENT, topic, lmq=TEMPLATE_LMQ)
            await queues.publishing.publish(topic, [b"x" * 16], lmq=TEMPLATE_LMQ, producer="producer")
            handle = Handle.decode(sub.handle)
            pulled = await queues.leases.pull(handle, 1)
            await queues.leases.ack(handle, [pulled.deliveries[0].tag])
            keys = Keyspace(config.prefix)
            template = keys.queue(QueueRef(topic, TEMPLATE_LMQ))
            await conn.hdel(template.rest, template.rest_field)  # at rest after its ack
            await conn.delete(*template.all_keys(),
                              keys.session_handles(TEMPLATE_CLIENT), keys.session_lite_counts(TEMPLATE_CLIENT),
                              *session_index.bucket_keys(keys, TEMPLATE_CLIENT))
            await conn.zrem(keys.schedule, QueueRef(topic, TEMPLATE_LMQ).qid)
        finally:
            await conn.aclose()
        return cls(shas, calls, topic, Keyspace(config.prefix))

    def call(self, name: str, lmq: str, client: str, tag: str | None = None) -> list[Any]:
        keys, args = self.calls[name]
        # the rest hash is the lmq's slot's, not named after it (fencemq.model.keys, QueueKeys.rest)
        rest = self.keyspace.queue(QueueRef(self.topic, lmq)).rest
        keys = [rest if k == self.template_rest else k.replace(TEMPLATE_LMQ, lmq) for k in keys]
        out: list[Any] = []
        for a in args:
            if a == TEMPLATE_CLIENT:
                a = client
            out.append(a)
        if name == "ack":
            assert tag is not None
            out[-1] = tag  # the one tag acked
        spec = SPECS[name]
        if "intent_at" in spec.argv:
            # the recorded lease intent would be stale by replay time: the bench measures the fences
            # alone, not the schedule (an intent "from the future" passes the fence's age check)
            out[spec.argv.index("intent_at")] = 2**53 - 1
        return ["EVALSHA", self.shas[name], len(keys), *keys, *out]


def load_scripts(r: redis.Redis) -> dict[str, str]:
    shas = {}
    for name, src in sources().items():
        shas[name] = r.script_load(src)
        assert shas[name] == hashlib.sha1(src.encode()).hexdigest()
    return shas
