"""One subscription handle in the SDK: its verbs, its iterator, and the epoch fence.

**Epoch fence.** Every subscription handle has a current epoch in the SDK: the
one SUB returned, raised by each SEEK reply as soon as the reader sees it (even
if the caller has not resumed yet, or was cancelled) and raised by any PULL
reply that carries a higher epoch. When ``pull`` hands a reply to the caller it
compares the reply's epoch with the current one: a reply older than the current
epoch is dropped whole (``sub.dropped`` counts the deliveries), never half a
batch. That covers replies that were in flight while a seek committed: after
``await sub.seek(...)`` returns, no delivery read before the seek is returned.
``take`` applies the same fence to each delivery.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Protocol

from fencemq.sdk.replies import ConnectionLost, EndOfStream, _delivery, _str, _tag
from fencemq.errors import FenceMQError
from fencemq.model.messages import Delivery

ITER_COUNT = 64
ITER_BLOCK_MS = 5000
HEARTBEAT_EVERY_S = 5.0  # RESP2 iterators: how often an idle one looks for notices


class Caller(Protocol):
    """What a subscription needs of its client (fencemq.sdk.client.Client), which imports this module."""

    _closed: bool
    protocol: int

    async def _call(self, args: Iterable[Any], convert: Callable[[Any], Any] | None = None) -> Any: ...

    async def heartbeat(self) -> list[dict[str, Any]]: ...


class _Epoch:
    """The current epoch of one subscription handle, shared by its Subscription objects."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value

    def observe(self, epoch: int) -> None:
        self.value = max(self.value, epoch)


class Subscription:
    """A subscription handle plus the SDK's epoch fence for it."""

    def __init__(
        self, client: Caller, handle: str, epoch: _Epoch, *, mode: str, owner: str | None, qos: int,
        topic: str, lmq: str | None, group: str | None, push: bool,
    ) -> None:
        self.client = client
        self.handle = handle
        self._epoch = epoch
        self.mode = mode
        self.owner = owner
        self.qos = qos
        self.topic = topic
        self.lmq = lmq
        self.group = group
        self.push = push
        self.dropped = 0  # deliveries dropped by the epoch fence
        self.closed = False  # unsubscribed, or the stream ended
        self.ended = False  # a push subscription's TAKE returned EOS

    def __repr__(self) -> str:
        return f"<Subscription {self.topic!r} lmq={self.lmq!r} mode={self.mode} epoch={self.epoch}>"

    @property
    def epoch(self) -> int:
        """The current epoch the SDK knows for this handle."""
        return self._epoch.value

    # -- the fence ---------------------------------------------------------------

    def _read_batch(self, raw: Any) -> list[Delivery]:
        """Runs in the reader, in wire order: decode, and learn a newer epoch at once."""
        batch = [_delivery(r) for r in raw or ()]
        if batch:
            self._epoch.observe(max(d.epoch for d in batch))
        return batch

    def _fence(self, batch: list[Delivery]) -> list[Delivery]:
        """At hand-off: a batch older than the current epoch is dropped whole."""
        if batch and min(d.epoch for d in batch) < self._epoch.value:
            self.dropped += len(batch)
            return []
        return batch

    def _read_take(self, raw: Any) -> Delivery | None | type[EndOfStream]:
        if raw is None:
            return None
        if isinstance(raw, (bytes, str)):
            if _str(raw) == "EOS":
                return EndOfStream
            raise FenceMQError(f"unexpected TAKE reply {raw!r:.100}")
        d = _delivery(raw)
        self._epoch.observe(d.epoch)
        return d

    def _read_seek(self, raw: Any) -> int:
        epoch = int(raw)
        self._epoch.observe(epoch)
        return epoch

    # -- verbs ------------------------------------------------------------------

    async def pull(self, count: int = 1, block_ms: int | None = None) -> list[Delivery]:
        """PULL handle [COUNT n] [BLOCK ms]; [] when none, on timeout, or when fenced."""
        args: list[Any] = ["PULL", self.handle]
        if count != 1:
            args += ["COUNT", count]
        if block_ms is not None:
            args += ["BLOCK", block_ms]
        return self._fence(await self.client._call(args, self._read_batch))

    async def take(self, block_ms: int | None = None) -> Delivery | None:
        """TAKE handle [BLOCK ms]: a delivery, None on timeout; raises EndOfStream at (and after) the end."""
        if self.ended:  # EOS is final (the worker forgets the member once it has handed EOS out)
            raise EndOfStream(self.handle)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + block_ms / 1000 if block_ms else None  # BLOCK 0: no deadline
        remaining = block_ms
        while True:
            args: list[Any] = ["TAKE", self.handle]
            if remaining is not None:
                args += ["BLOCK", remaining]
            got = await self.client._call(args, self._read_take)
            if got is EndOfStream:
                self.closed = self.ended = True
                raise EndOfStream(self.handle)
            if got is None or self._fence([got]):
                return got
            # Fenced: a delivery from before a seek. Look again with the time left.
            if deadline is not None:
                remaining = int((deadline - loop.time()) * 1000)
                if remaining <= 0:
                    return None

    async def ack(self, *tags: str | Delivery) -> int:
        """ACK handle tag...: checkouts settled (a stale tag settles nothing)."""
        if not tags:
            return 0
        return int(await self.client._call(["ACK", self.handle, *map(_tag, tags)]))

    async def nack(self, *tags: str | Delivery, delay_ms: int | None = None, discard: bool = False) -> int:
        if not tags:
            return 0
        args: list[Any] = ["NACK", self.handle, *map(_tag, tags)]
        if delay_ms is not None:
            args += ["DELAY", delay_ms]
        if discard:
            args.append("DISCARD")
        return int(await self.client._call(args))

    async def renew(self, *tags: str | Delivery, lock_ms: int | None = None) -> int:
        if not tags:
            return 0
        args: list[Any] = ["RENEW", self.handle, *map(_tag, tags)]
        if lock_ms is not None:
            args += ["LOCK", lock_ms]
        return int(await self.client._call(args))

    async def seek(self, where: str | None = None, *, id: int | str | None = None,
                   time_ms: int | None = None) -> int:
        """SEEK to "earliest", "latest", id=n or time_ms=ms; returns (and adopts) the new epoch."""
        given = [x for x in (where, id, time_ms) if x is not None]
        if len(given) != 1:
            raise ValueError("seek takes exactly one of 'earliest'/'latest', id= or time_ms=")
        if where is not None:
            if where.lower() not in ("earliest", "latest"):
                raise ValueError("seek(where) takes 'earliest' or 'latest'")
            args: list[Any] = ["SEEK", self.handle, where.upper()]
        elif id is not None:
            args = ["SEEK", self.handle, "ID", id]
        else:
            args = ["SEEK", self.handle, "TIME", time_ms]
        return await self.client._call(args, self._read_seek)

    async def unsubscribe(self, max: int | None = None) -> None:
        """UNSUB handle [MAX n]: leave now (checkouts go back), or end after n total deliveries."""
        args: list[Any] = ["UNSUB", self.handle]
        if max is not None:
            args += ["MAX", max]
        await self.client._call(args)
        if max is None and not self.push:
            # A push member ends at the EOS the server seated: its iterator
            # runs on to TAKE it, which closes the handle server-side too.
            self.closed = True

    # -- iteration ----------------------------------------------------------------

    async def iter(self, count: int = ITER_COUNT, block_ms: int = ITER_BLOCK_MS) -> AsyncIterator[Delivery]:
        """Deliveries until unsubscribed, end of stream (push) or client close.

        Pull subscriptions loop ``PULL COUNT count BLOCK block_ms``; push
        subscriptions loop ``TAKE BLOCK block_ms`` and end cleanly at EOS. No
        request is outstanding while the loop body runs.
        """
        last_heartbeat = asyncio.get_running_loop().time()
        try:
            while not self.closed:
                if self.push:
                    try:
                        d = await self.take(block_ms)
                    except EndOfStream:
                        return
                    if d is not None:
                        yield d
                else:
                    batch = await self.pull(count, block_ms)
                    if not batch and self.client.protocol == 2:
                        # RESP2 has no pushed notices: fetch them now and then, so a lease
                        # timeout is seen and answered (the client renews to show life)
                        now = asyncio.get_running_loop().time()
                        if now - last_heartbeat >= HEARTBEAT_EVERY_S:
                            last_heartbeat = now
                            await self.client.heartbeat()
                    for i, d in enumerate(batch):
                        if d.epoch < self._epoch.value:
                            # A seek returned while this batch was being consumed:
                            # the rest was read before it, so none of it is handed on.
                            self.dropped += len(batch) - i
                            break
                        yield d
        except ConnectionLost:
            if self.client._closed:  # closed on purpose: end quietly
                return
            raise

    def __aiter__(self) -> AsyncIterator[Delivery]:
        return self.iter()
