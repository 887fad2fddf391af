"""Lite subscriptions in the SDK: a client's set of lmqs of one (topic, group).

    async with LiteSubscriptions(client, "chat", group="g", interval=5) as lite:
        await lite.add("session-42")           # SUB chat LMQ session-42 GROUP g
        async for event in lite.evictions():   # or on_unsubscribe=callback
            ...                                # {"type": "unsubscribe", "lmq": ..., "by": ...}

    batch = await lite.pull(10)                # round-robin across the held lmqs
    await lite.ack(*batch)

Exclusive lmqs are preempted: the last subscriber wins, and the old owner's
PULLs come back empty from then on (the server's eviction marker). What the
SDK adds on top:

* **The set.** ``add``/``remove`` keep the lmqs this client holds; a
  background task sends ``HEARTBEAT SYNC topic group lmq…`` with the full set
  every ``interval`` seconds. SYNC is authoritative on the server: lmqs held
  but not listed are unsubscribed (markers included), and for every listed
  lmq that carries a marker the ``unsubscribe`` notice is sent again, so a
  lost notice heals at the next heartbeat.

* **Notices are hints, markers are the truth.** An ``unsubscribe`` notice may
  be late: pushed (RESP3) or queued before a re-``add`` of the same lmq
  committed, it would then name an lmq the client owns again — and the handle
  is the same, so the notice cannot tell. So a notice only *suspends* the lmq
  locally (no more PULLs of it) and triggers a SYNC at once; the lmq is
  dropped only when that SYNC's reply carries a re-sent notice for it (the
  marker exists now), else it resumes. Commands that change the set and the
  SYNC itself run one at a time (a lock), so a SYNC never lists a set that a
  SUB or UNSUB on the wire contradicts.

* **Eviction.** A confirmed eviction drops the lmq from the set and from
  ``pull``, surfaces the notice once (``on_unsubscribe`` callback and the
  ``evictions()`` iterator), and the next SYNC — sent right away — no longer
  lists it, which clears the marker and frees the quota on the server. A
  delivery of that lmq still in flight is discarded: its checkout went back
  to the new owner. ``add`` it again to preempt back. A PULL answered
  NOTFOUND (the server no longer knows the subscription, e.g. the session
  ended) is surfaced the same way with ``reason`` ``gone``.

* **Reconnecting.** When the client reconnects (docs/sdk.md, "Reconnecting")
  the set is synced at once: an lmq taken while the client was away is
  confirmed by the SYNC's re-sent notice and surfaced as above — never
  subscribed again behind the application's back. If the session itself
  ended meanwhile, every lmq is surfaced with ``reason`` ``session_expired``
  and the set is empty: ``add`` them again.

* **Other notices.** HEARTBEAT drains every notice queued for the session.
  Unsubscribe notices for another (topic, group) go to the
  ``LiteSubscriptions`` of the same client that holds it; anything else
  (``message_timeout`` …) goes to ``on_other_notice``.

Cancel-safety: the background task and every method may be cancelled at any
await; the client stays usable (its multiplexer discards the reply of a
cancelled call), the set is only changed once the server answered, and
``aclose()`` stops the task without touching the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Self

from fencemq.sdk.client import Client, ConnectionLost, Subscription
from fencemq.sdk.lite_notices import _ATTR, Notice, _lite_key, _router
from fencemq.errors import FenceMQError, NotFound, SessionExpired
from fencemq.model.messages import Delivery

__all__ = ["LiteSubscriptions"]

log = logging.getLogger(__name__)


class LiteSubscriptions:
    """The lmqs one client holds in one (topic, group), kept in sync with the server. See the module docstring."""

    def __init__(
        self,
        client: Client,
        topic: str,
        group: str = "default",
        *,
        interval: float = 5.0,
        on_unsubscribe: Callable[[Notice], Any] | None = None,
        on_other_notice: Callable[[Notice], Any] | None = None,
        **sub_options: Any,
    ) -> None:
        if interval <= 0:
            raise ValueError("interval must be positive (seconds between HEARTBEAT SYNCs)")
        if "lmq" in sub_options or "group" in sub_options:
            raise ValueError("lmq and group are not SUB options here: add(lmq), LiteSubscriptions(..., group=)")
        self.client = client
        self.topic = topic
        self.group = group
        self.interval = interval
        self.on_unsubscribe = on_unsubscribe
        self.on_other_notice = on_other_notice
        self.sub_options = sub_options  # passed to every SUB: lock_ms, on_preempt, policy, start, qos...
        self.syncs = 0  # HEARTBEAT SYNCs answered
        self._subs: dict[str, Subscription] = {}  # lmq -> subscription, in the order added
        self._suspect: set[str] = set()  # a notice named it: no PULLs until a SYNC says whether it is marked
        self._lock = asyncio.Lock()  # SUB, UNSUB and SYNC one at a time
        self._wake = asyncio.Event()
        self._events: asyncio.Queue[Notice | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._rr = 0

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> Self:
        """Attach to the client's notices and start the heartbeat task (idempotent)."""
        if self._closed:
            raise RuntimeError("this LiteSubscriptions was closed; make a new one")
        if self._task is None:
            router = _router(self.client, create=True)
            assert router is not None
            key = (self.topic, self.group)
            if router.members.get(key, self) is not self:
                raise ValueError(f"this client already has LiteSubscriptions for {key}")
            router.members[key] = self
            self._task = asyncio.get_running_loop().create_task(
                self._heartbeats(), name=f"fencemq-lite-{self.topic}-{self.group}")
        return self

    async def aclose(self, *, unsubscribe: bool = False) -> None:
        """Stop the heartbeat task; with ``unsubscribe=True`` also UNSUB every held lmq first."""
        if self._closed:
            return
        if unsubscribe and not self.client.closed:
            with contextlib.suppress(ConnectionLost):
                for lmq in list(self._subs):
                    await self.remove(lmq)
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        router = _router(self.client)
        if router is not None and router.members.get((self.topic, self.group)) is self:
            del router.members[(self.topic, self.group)]
            if not router.members:
                router.detach()
                delattr(self.client, _ATTR)
        self._events.put_nowait(None)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def lmqs(self) -> list[str]:
        """The lmqs held, in the order added."""
        return list(self._subs)

    @property
    def closed(self) -> bool:
        return self._closed

    def subscription(self, lmq: str) -> Subscription | None:
        return self._subs.get(lmq)

    # -- the set ---------------------------------------------------------------------------

    async def add(self, lmq: str) -> Subscription:
        """SUB topic LMQ lmq GROUP group: take the lmq (preempting its owner, or BUSY/LIMIT errors)."""
        self._check_open()
        async with self._lock:
            sub = await self.client.subscribe(self.topic, lmq=lmq, group=self.group, **self.sub_options)
            self._subs[lmq] = sub
            self._suspect.discard(lmq)
        return sub

    async def remove(self, lmq: str) -> None:
        """UNSUB the lmq (its checkouts go back) and forget it; a no-op for an lmq not held."""
        async with self._lock:
            sub = self._subs.get(lmq)
            if sub is None:
                return
            await sub.unsubscribe()
            if self._subs.get(lmq) is sub:
                del self._subs[lmq]
                self._suspect.discard(lmq)

    async def sync(self) -> list[Notice]:
        """Send HEARTBEAT SYNC with the full set now; returns the evictions it confirmed."""
        self._check_open()
        confirmed: list[Notice] = []
        async with self._lock:
            listed = list(self._subs)
            checking = set(self._suspect)
            drained = await self.client._drain_notices((self.topic, self.group, listed))
            self.syncs += 1
            router = _router(self.client)
            hints: list[Notice] = []
            for notice, fresh in drained:
                key = _lite_key(notice)
                if key == (self.topic, self.group) and notice.get("resent") and str(notice["lmq"]) in listed:
                    # the proof, even if its push came first
                    lmq = str(notice["lmq"])
                    if lmq in self._subs and lmq not in {str(n["lmq"]) for n in confirmed}:
                        confirmed.append(notice)
                elif not fresh:
                    continue  # pushed before, and handled then
                elif key == (self.topic, self.group):
                    hints.append(notice)
                elif key is not None and router is not None and (other := router.members.get(key)) is not None:
                    other._hint(notice)
                elif self.on_other_notice is not None:
                    _call(self.on_other_notice, notice)
                else:
                    log.debug("notice for nobody here: %r", notice)
            for notice in confirmed:
                lmq = str(notice["lmq"])
                del self._subs[lmq]
                self._suspect.discard(lmq)
            # A suspect without a re-sent notice was not marked when this SYNC ran: resume it.
            self._suspect -= checking - {str(n["lmq"]) for n in confirmed}
        for notice in hints:  # may be stale, or newer than the SYNC's look at the markers: ask again
            self._hint(notice)
        for notice in confirmed:
            self._surface(notice)
        if confirmed:
            self._wake.set()  # the next SYNC, without them, clears their markers on the server
        return confirmed

    # -- consuming ---------------------------------------------------------------------------

    async def pull(self, count: int = 1) -> list[Delivery]:
        """Up to ``count`` deliveries, round-robin across the held lmqs (each starts a call in turn)."""
        self._check_open()
        active = [lmq for lmq in self._subs if lmq not in self._suspect]
        if not active:
            return []
        start = self._rr % len(active)
        self._rr += 1
        out: list[Delivery] = []
        for lmq in active[start:] + active[:start]:
            if len(out) >= count:
                break
            sub = self._subs.get(lmq)
            if sub is None or lmq in self._suspect:
                continue
            try:
                got = await sub.pull(count - len(out))
            except SessionExpired:
                self._gone(lmq, sub, "session_expired")
                continue
            except NotFound:
                self._gone(lmq, sub)
                continue
            # Evicted or suspended while the reply was on its way: its checkouts are the new owner's.
            if self._subs.get(lmq) is sub and lmq not in self._suspect:
                out += got
        return out

    async def ack(self, *deliveries: Delivery) -> int:
        """ACK deliveries of any of the lmqs (one ACK per lmq); returns checkouts settled."""
        by_lmq: dict[str, list[str]] = {}
        for d in deliveries:
            if d.lmq is None:
                raise ValueError(f"{d!r} is not a lite delivery")
            by_lmq.setdefault(d.lmq, []).append(d.tag)
        settled = 0
        for lmq, tags in by_lmq.items():
            sub = self._subs.get(lmq)
            if sub is None:
                # Removed, evicted or gone: its checkouts went back or are the new owner's, so an
                # ACK would settle nothing (and only the handle SUB returned is one the worker takes).
                continue
            settled += int(await self.client.execute("ACK", sub.handle, *tags))
        return settled

    async def iter(self, count: int = 64, idle_s: float = 0.05) -> AsyncIterator[Delivery]:
        """Deliveries until closed; sleeps ``idle_s`` after an empty round (PULL never blocks here)."""
        try:
            while not self._closed:
                batch = await self.pull(count)
                for d in batch:
                    yield d
                if not batch:
                    await asyncio.sleep(idle_s)
        except ConnectionLost:
            if not self.client._closed:
                raise

    async def evictions(self) -> AsyncIterator[Notice]:
        """Each confirmed eviction (the unsubscribe notice) once, until closed. One consumer at a time."""
        while True:
            event = await self._events.get()
            if event is None:
                self._events.put_nowait(None)  # stays closed for later iterators
                return
            yield event

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LiteSubscriptions was closed")

    def _wake_now(self) -> None:
        """SYNC now, not at the next interval."""
        self._wake.set()

    def _hint(self, notice: Notice) -> None:
        """A notice named one of our lmqs: stop pulling it and let a SYNC tell whether it is marked."""
        lmq = str(notice.get("lmq"))
        if lmq in self._subs and not self._closed:
            self._suspect.add(lmq)
            self._wake.set()

    def _gone(self, lmq: str, sub: Subscription, reason: str = "gone") -> None:
        if self._subs.get(lmq) is not sub:
            return
        del self._subs[lmq]
        self._suspect.discard(lmq)
        self._surface({"type": "unsubscribe", "reason": reason, "topic": self.topic, "lmq": lmq,
                       "handle": sub.handle})

    def _session_gone(self) -> None:
        """The client came back after its session's lease ran out: it holds none of its lmqs any more."""
        for lmq, sub in list(self._subs.items()):
            self._gone(lmq, sub, "session_expired")

    def _surface(self, notice: Notice) -> None:
        self._events.put_nowait(notice)
        if self.on_unsubscribe is not None:
            _call(self.on_unsubscribe, notice)

    async def _heartbeats(self) -> None:
        while not self._closed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
            self._wake.clear()
            try:
                await self.sync()
            except ConnectionLost:
                log.info("lite heartbeats of %s/%s stop: connection lost", self.topic, self.group)
                self._events.put_nowait(None)
                return
            except FenceMQError as exc:
                log.warning("HEARTBEAT SYNC %s %s failed: %s", self.topic, self.group, exc)


def _call(callback: Callable[[Notice], Any], notice: Notice) -> None:
    try:
        result = callback(notice)
        if inspect.isawaitable(result):
            asyncio.ensure_future(result)
    except Exception:
        log.exception("notice callback failed")
