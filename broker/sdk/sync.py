"""The blocking SDK facade: a ``Client`` on a private event loop in a background thread.

Same methods as the async client, each run to completion with
``asyncio.run_coroutine_threadsafe``; ``for d in sub`` iterates like
``async for``. ``from fencemq import SyncClient``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, Self, TypeVar

from fencemq.sdk.client import DEFAULT_URL, Client, ConnectionLost, Subscription
from fencemq.sdk.reconnect import Reconnect
from fencemq.sdk.renewal import LockRenewer
from fencemq.sdk.subscription import ITER_BLOCK_MS, ITER_COUNT
from fencemq.model.messages import Delivery

T = TypeVar("T")

CLOSE_CHECK_S = 0.5  # how often a blocked call looks whether the client was closed from another thread

class SyncClient:
    """Blocking facade: a Client on a private event loop in a background thread."""

    def __init__(self, client: Client, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
        self._client = client
        self._loop = loop
        self._thread = thread

    @classmethod
    def connect(
        cls,
        url: str | Sequence[str] = DEFAULT_URL,
        client_id: str | None = None,
        protocol: int = 3,
        password: str | None = None,
        username: str | None = None,
        *,
        on_notice: Callable[[dict[str, Any]], None] | None = None,
        connect_timeout: float | None = 10.0,
        takeover: bool = False,
        reconnect: Reconnect | bool = True,
    ) -> SyncClient:
        """Connect (HELLO), as :meth:`fencemq.sdk.client.Client.connect`; ``on_notice`` runs on the client's
        loop thread: it must not call this client."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="fencemq-sync-client", daemon=True)
        thread.start()
        try:
            client = asyncio.run_coroutine_threadsafe(
                Client.connect(url, client_id, protocol, password, username, on_notice=on_notice,
                               connect_timeout=connect_timeout, takeover=takeover, reconnect=reconnect), loop
            ).result()
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
            raise
        return cls(client, loop, thread)

    def _run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        if self._loop.is_closed():
            getattr(coro, "close", lambda: None)()
            raise ConnectionLost("client closed")
        if threading.current_thread() is self._thread:
            getattr(coro, "close", lambda: None)()
            raise RuntimeError("SyncClient called from its own loop thread (e.g. in on_notice): use the async API")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        if timeout is not None:
            return future.result(timeout)
        while True:
            try:
                return future.result(CLOSE_CHECK_S)
            except TimeoutError:
                # closed from another thread meanwhile: its loop stopped, and this call will never end
                if not self._thread.is_alive():
                    future.cancel()
                    raise ConnectionLost("client closed") from None

    @property
    def id(self) -> str | None:
        return self._client.id

    @property
    def closed(self) -> bool:
        return self._client.closed

    @property
    def connected(self) -> bool:
        return self._client.connected

    @property
    def worker(self) -> str | None:
        return self._client.worker

    @property
    def aio(self) -> Client:
        """The underlying async client (use it only from this facade's loop)."""
        return self._client

    def execute(self, *args: Any) -> Any:
        return self._run(self._client.execute(*args))

    def ping(self, message: str | bytes | None = None) -> str:
        return self._run(self._client.ping(message))

    @property
    def default_lock_ms(self) -> int | None:
        return self._client.default_lock_ms

    def publish(self, topic: str, payload: bytes | str, lmq: str | None = None, qos: int = 1, retain: bool = False,
                dedup_id: str | None = None, headers: dict[str, str] | None = None, delay_ms: int | None = None,
                at_ms: int | None = None, ttl_ms: int | None = None, priority: int | None = None) -> str:
        """PUB; the message id (a schedule id, ``s…``, for a message published for later)."""
        return self._run(self._client.publish(topic, payload, lmq=lmq, qos=qos, retain=retain, dedup_id=dedup_id,
                                              headers=headers, delay_ms=delay_ms, at_ms=at_ms, ttl_ms=ttl_ms,
                                              priority=priority))

    def mpublish(self, topic: str, payloads: list[bytes], lmq: str | None = None, qos: int = 1,
                 dedup_id: str | None = None, delay_ms: int | None = None, at_ms: int | None = None,
                 ttl_ms: int | None = None, priority: int | None = None) -> list[str]:
        """MPUB; the message ids, in order (``dedup_id`` covers the batch; schedule ids with a delay)."""
        return self._run(self._client.mpublish(topic, payloads, lmq=lmq, qos=qos, dedup_id=dedup_id,
                                               delay_ms=delay_ms, at_ms=at_ms, ttl_ms=ttl_ms, priority=priority))

    def unpublish(self, topic: str, ids: list[str], lmq: str | None = None) -> int:
        """UNPUB: cancel scheduled messages; how many still waited."""
        return self._run(self._client.unpublish(topic, ids, lmq=lmq))

    def subscribe(
        self,
        topic: str,
        lmq: str | None = None,
        group: str | None = None,
        mode: str | None = None,
        policy: str | None = None,
        start: str | tuple[str, int] | None = None,
        qos: int | None = None,
        lock_ms: int | None = None,
        push: bool = False,
        capacity: int | None = None,
        max: int | None = None,
        epoch: int | None = None,
        on_preempt: Literal["keep", "earliest", "latest"] | None = None,
        strategy: Literal["round-robin", "sticky", "hash"] | None = None,
        offline: Literal["queue", "skip"] | None = None,
        prefetch: bool = False,
    ) -> SyncSubscription:
        """SUB, as :meth:`fencemq.sdk.client.Client.subscribe`."""
        return SyncSubscription(self, self._run(self._client.subscribe(
            topic, lmq=lmq, group=group, mode=mode, policy=policy, start=start, qos=qos, lock_ms=lock_ms, push=push,
            capacity=capacity, max=max, epoch=epoch, on_preempt=on_preempt, strategy=strategy, offline=offline,
            prefetch=prefetch)))

    def heartbeat(self, sync: tuple[str, str, list[str]] | None = None) -> list[dict[str, Any]]:
        return self._run(self._client.heartbeat(sync))

    def get_notice(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next pushed notice, or None on timeout / when the client is closed."""
        async def get() -> dict[str, Any] | None:
            q = self._client._notices
            if q is None:
                return None
            try:
                return await asyncio.wait_for(q.get(), timeout)
            except TimeoutError:
                return None

        return self._run(get())

    def close(self) -> None:
        if not self._loop.is_closed():
            try:
                self._run(self._client.close())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
                self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncSubscription:
    def __init__(self, client: SyncClient, sub: Subscription) -> None:
        self._client = client
        self.aio = sub

    handle = property(lambda self: self.aio.handle)
    mode = property(lambda self: self.aio.mode)
    epoch = property(lambda self: self.aio.epoch)
    owner = property(lambda self: self.aio.owner)
    dropped = property(lambda self: self.aio.dropped)

    def pull(self, count: int = 1, block_ms: int | None = None) -> list[Delivery]:
        return self._client._run(self.aio.pull(count, block_ms))

    def take(self, block_ms: int | None = None) -> Delivery | None:
        return self._client._run(self.aio.take(block_ms))

    def ack(self, *tags: str | Delivery) -> int:
        return self._client._run(self.aio.ack(*tags))

    def nack(self, *tags: str | Delivery, delay_ms: int | None = None, discard: bool = False,
             release: bool = False) -> int:
        return self._client._run(self.aio.nack(*tags, delay_ms=delay_ms, discard=discard, release=release))

    def renew(self, *tags: str | Delivery, lock_ms: int | None = None) -> int:
        return self._client._run(self.aio.renew(*tags, lock_ms=lock_ms))

    def seek(self, where: str | None = None, *, id: int | str | None = None,
             time_ms: int | None = None) -> int:
        return self._client._run(self.aio.seek(where, id=id, time_ms=time_ms))

    def unsubscribe(self, max: int | None = None) -> None:
        self._client._run(self.aio.unsubscribe(max))

    @contextmanager
    def renewing(self, *deliveries: Delivery, every_ms: int | None = None,
                 max_ms: int | None = None) -> Iterator[LockRenewer]:
        """``with sub.renewing(d): ...``: the locks of ``deliveries`` are renewed (on the client's loop
        thread) while the body runs."""
        renewer = self.aio.renewing(*deliveries, every_ms=every_ms, max_ms=max_ms)

        async def start() -> None:
            await renewer.__aenter__()

        self._client._run(start())
        try:
            yield renewer
        finally:
            if not self._client._loop.is_closed():
                self._client._run(renewer.stop())

    def close(self) -> None:
        """Hand back what the iterator fetched and never handed out (the subscription stays)."""
        self._client._run(self.aio.close())

    def __enter__(self) -> SyncSubscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def iter(self, count: int = ITER_COUNT, block_ms: int = ITER_BLOCK_MS, *,
             renew_locks: bool = False) -> Iterator[Delivery]:
        """Deliveries, as :meth:`fencemq.sdk.subscription.Subscription.iter` (leaving early hands back the
        rest of the batch; ``renew_locks`` keeps the locks while the loop body runs)."""
        agen = self.aio.iter(count, block_ms, renew_locks=renew_locks)

        async def step() -> Delivery:
            return await agen.__anext__()

        try:
            while True:
                try:
                    yield self._client._run(step())
                except StopAsyncIteration:
                    return
                except ConnectionLost:
                    if self._client.closed:  # closed (from another thread): the loop ends, as async for does
                        return
                    raise
        finally:
            if self._client._thread.is_alive():
                with contextlib.suppress(ConnectionLost):
                    self._client._run(agen.aclose())

    def __iter__(self) -> Iterator[Delivery]:
        return self.iter()
