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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Protocol

from fencemq.sdk.replies import _EPOCH_OF, _TAG_OF, ConnectionLost, EndOfStream, _deliveries, _delivery, _str, _tags
from fencemq.errors import FenceMQError
from fencemq.model.messages import Delivery
from fencemq.sdk.renewal import LockRenewer

ITER_COUNT = 64
ITER_BLOCK_MS = 5000
HEARTBEAT_EVERY_S = 5.0  # RESP2 iterators: how often an idle one looks for notices
DEFAULT_LOCK_MS = 30_000  # a worker's default lease, when its HELLO did not say
RELEASE_TIMEOUT_S = 2.0  # how long closing waits to hand back what it fetched and never handed out


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """A prefetch nobody takes (the subscription left) must not log "exception never retrieved"."""
    if not fut.cancelled():
        fut.exception()


class Caller(Protocol):
    """What a subscription needs of its client (fencemq.sdk.client.Client), which imports this module."""

    _closed: bool
    protocol: int

    async def _call(self, args: Iterable[Any], convert: Callable[[Any], Any] | None = None, *,
                    resend: bool = True, generation: int | None = None) -> Any: ...

    async def heartbeat(self) -> list[dict[str, Any]]: ...

    @property
    def default_lock_ms(self) -> int: ...


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
        self, client: Caller, handle: str, epoch: _Epoch, generation: int = 0, *, mode: str, owner: str | None,
        qos: int,
        topic: str, lmq: str | None, group: str | None, push: bool, lock_ms: int | None = None,
        prefetch: bool = False,
    ) -> None:
        self.client = client
        self.handle = handle
        self._epoch = epoch
        # the client's session generation it was made in: once that session is found gone (the client
        # came back after its lease ran out), every call raises SessionExpired
        self._generation = generation
        self.mode = mode
        self.owner = owner
        self.qos = qos
        self.topic = topic
        self.lmq = lmq
        self.group = group
        self.push = push
        self.lock_ms = lock_ms  # the LOCK this subscription asked for (None: the worker's default)
        self.dropped = 0  # deliveries dropped by the epoch fence
        self.closed = False  # unsubscribed, or the stream ended
        self.ended = False  # a push subscription's TAKE returned EOS
        # Fetched by the iterator but not yet handed out: NACKed when the iteration stops early.
        self._held: list[Delivery] = []
        # Prefetch: once the caller has settled the whole of a full batch, the next PULL of that
        # size goes out right behind the ACK (one write; the worker runs both fences in one round
        # trip) and the next pull() takes its reply.
        self.prefetch = prefetch
        self._unsettled: set[str] = set()  # tags of the last full batch not settled yet
        self._full_count = 0  # its size (0: the last pull was not full: nothing to prefetch)
        self._prefetched: tuple[asyncio.Future[Any], int, float] | None = None  # (PULL, count, sent at)

    def __repr__(self) -> str:
        return f"<Subscription {self.topic!r} lmq={self.lmq!r} mode={self.mode} epoch={self.epoch}>"

    @property
    def epoch(self) -> int:
        """The current epoch the SDK knows for this handle."""
        return self._epoch.value

    def _send(self, args: Iterable[Any], convert: Callable[[Any], Any] | None = None) -> Awaitable[Any]:
        return self.client._call(args, convert, generation=self._generation)

    # -- the fence ---------------------------------------------------------------

    def _read_batch(self, raw: Any) -> list[Delivery]:
        """Runs in the reader, in wire order: decode, and learn a newer epoch at once."""
        batch = _deliveries(raw)
        if batch:
            self._epoch.observe(max(map(_EPOCH_OF, batch)))
        return batch

    def _fence(self, batch: list[Delivery]) -> list[Delivery]:
        """At hand-off: a batch older than the current epoch is dropped whole."""
        if batch and min(map(_EPOCH_OF, batch)) < self._epoch.value:
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
        if self._prefetched is not None:
            batch = await self._take_prefetched(count)
            if batch:
                return batch
        args: list[Any] = ["PULL", self.handle]
        if count != 1:
            args += ["COUNT", count]
        if block_ms is not None:
            args += ["BLOCK", block_ms]
        return self._pulled(self._fence(await self._send(args, self._read_batch)), count)

    def _pulled(self, batch: list[Delivery], count: int) -> list[Delivery]:
        """With prefetch, a full batch is followed by the next once the caller settles all of it."""
        full = self.prefetch and count > 1 and len(batch) == count
        self._full_count = count if full else 0
        self._unsettled = set(map(_TAG_OF, batch)) if full else set()
        return batch

    def _settling(self, tags: list[str | bytes]) -> None:
        """Called right after an ACK or NACK of ``tags`` is sent: when they finish the last full
        batch, the next PULL goes out behind it (the caller's next pull() takes the reply)."""
        if not self._full_count or self._prefetched is not None or self.closed:
            return
        unsettled = self._unsettled
        unsettled.difference_update(tags)  # the usual tags, str (a bytes tag never matches one)
        if unsettled and bytes in map(type, tags):
            unsettled.difference_update(t.decode() for t in tags if isinstance(t, bytes))
        if unsettled:
            return
        count, self._full_count = self._full_count, 0
        fut = asyncio.ensure_future(self._send(["PULL", self.handle, "COUNT", count], self._read_batch))
        fut.add_done_callback(_retrieved)
        self._prefetched = (fut, count, asyncio.get_running_loop().time())

    async def _take_prefetched(self, count: int) -> list[Delivery]:
        """The prefetched batch, if it fits ``count`` and its leases are fresh (fetched within a third
        of the lock); else it goes back (NACK … RELEASE: no failure counted) and [] asks for a new one."""
        fut, fetched, sent_at = self._prefetched  # type: ignore[misc]
        self._prefetched = None
        batch = self._fence(await fut)
        fresh = asyncio.get_running_loop().time() - sent_at < self.effective_lock_ms / 3000
        if batch and (fetched > count or not fresh):
            self._held = [*batch, *self._held]
            await self.release_held()
            return []
        return self._pulled(batch, fetched)

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
            got = await self._send(args, self._read_take)
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
        settled = _tags(tags)
        return await self._settle(["ACK", self.handle, *settled], settled)

    async def _settle(self, args: list[Any], tags: list[str | bytes]) -> int:
        """Send an ACK or NACK; with prefetch, the next PULL may follow it in the same write."""
        if not self._full_count:
            return int(await self._send(args))
        sent = asyncio.ensure_future(self._send(args))  # first in line for the connection
        self._settling(tags)
        return int(await sent)

    async def nack(self, *tags: str | Delivery, delay_ms: int | None = None, discard: bool = False,
                   release: bool = False) -> int:
        """NACK handle tag...: back to the group (after ``delay_ms``), counting a failure toward the
        dead-letter limit; ``discard``: dropped; ``release``: handed back unprocessed, no failure counted."""
        if not tags:
            return 0
        args: list[Any] = ["NACK", self.handle, *_tags(tags)]
        if delay_ms is not None:
            args += ["DELAY", delay_ms]
        if discard:
            args.append("DISCARD")
        if release:
            args.append("RELEASE")
            return int(await self._send(args))
        return await self._settle(args, args[2 : 2 + len(tags)])

    async def renew(self, *tags: str | Delivery, lock_ms: int | None = None) -> int:
        if not tags:
            return 0
        args: list[Any] = ["RENEW", self.handle, *_tags(tags)]
        if lock_ms is not None:
            args += ["LOCK", lock_ms]
        return int(await self._send(args))

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
        return await self._send(args, self._read_seek)

    async def unsubscribe(self, max: int | None = None) -> None:
        """UNSUB handle [MAX n]: leave now (checkouts go back), or end after n total deliveries."""
        args: list[Any] = ["UNSUB", self.handle]
        if max is not None:
            args += ["MAX", max]
        await self._send(args)
        if max is None:  # what was prefetched went back with the UNSUB
            self._prefetched, self._full_count = None, 0
        if max is None and not self.push:
            # A push member ends at the EOS the server seated: its iterator
            # runs on to TAKE it, which closes the handle server-side too.
            self.closed = True

    # -- releasing and renewing --------------------------------------------------------

    async def release_held(self) -> int:
        """Hand back what the iterator fetched but never handed out (``NACK … RELEASE``: straight back
        to the group, no failure counted); how many went back."""
        if self._prefetched is not None:
            fut = self._prefetched[0]
            self._prefetched = None
            try:
                self._held = [*self._held, *self._fence(await asyncio.wait_for(fut, RELEASE_TIMEOUT_S))]
            except (ConnectionLost, TimeoutError, FenceMQError):
                pass  # the leases run out instead: the messages come back all the same
        held, self._held = self._held, []
        if not held or self.client.closed:
            return 0
        try:
            return await asyncio.wait_for(self.nack(*held, release=True), RELEASE_TIMEOUT_S)
        except (ConnectionLost, TimeoutError, FenceMQError):
            return 0  # the leases run out instead: the messages come back all the same

    async def close(self) -> None:
        """Hand back what was fetched and not handed out; the subscription stays (``unsubscribe`` leaves)."""
        await self.release_held()

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def renewing(self, *deliveries: Delivery, every_ms: int | None = None,
                 max_ms: int | None = None) -> LockRenewer:
        """``async with sub.renewing(d): ...``: keep the locks of ``deliveries`` while the body runs.

        RENEW every third of the lock (``every_ms``), for at most ``max_ms`` in all
        (None: as long as the body runs) — Azure Service Bus's lock renewer, for a
        handler that may outlast its lease.
        """
        return LockRenewer(self, deliveries, every_ms=every_ms, max_ms=max_ms)

    @property
    def effective_lock_ms(self) -> int:
        return self.lock_ms or getattr(self.client, "default_lock_ms", None) or DEFAULT_LOCK_MS

    # -- iteration ----------------------------------------------------------------

    async def iter(self, count: int = ITER_COUNT, block_ms: int = ITER_BLOCK_MS, *,
                   renew_locks: bool = False) -> AsyncIterator[Delivery]:
        """Deliveries until unsubscribed, end of stream (push) or client close.

        Pull subscriptions loop ``PULL COUNT count BLOCK block_ms``; push
        subscriptions loop ``TAKE BLOCK block_ms`` and end cleanly at EOS. No
        request is outstanding while the loop body runs.

        Leaving the loop early (``break``, an exception, closing the iterator)
        NACKs the rest of the batch it fetched, so those messages go to another
        consumer at once instead of waiting out their leases under this one.
        ``renew_locks=True`` renews, while the loop body runs, the lock of the
        delivery in hand and of the rest of its batch.
        """
        last_heartbeat = asyncio.get_running_loop().time()
        renewer = LockRenewer(self, (), every_ms=None, max_ms=None) if renew_locks else None
        try:
            while not self.closed:
                if self.push:
                    try:
                        d = await self.take(block_ms)
                    except EndOfStream:
                        return
                    if d is not None:
                        if renewer is not None:
                            renewer.hold([d])
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
                        self._held = batch[i + 1 :]
                        if renewer is not None:
                            renewer.hold([d, *self._held])
                        yield d
                    self._held = []
                if renewer is not None:
                    renewer.hold([])
        except ConnectionLost:
            if self.client._closed:  # closed on purpose: end quietly
                return
            raise
        finally:
            if renewer is not None:
                await renewer.stop()
            await self.release_held()

    def __aiter__(self) -> AsyncIterator[Delivery]:
        return self.iter()
