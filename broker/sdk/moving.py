"""Moving between workers: a client's links coming and going (a mixin of the client's connection).

When the current link is lost, or its worker says it drains, the client connects again to any of
its addresses under the same client id, so its session resumes; what the lost link left
unanswered goes out again on the next one, in the order it was first sent and before anything
newer (an older link being left, still collecting its replies, holds the newer one's frames back
until it is done: wire order across links). If the session was found gone meanwhile, every call
acting in it fails with SessionExpired. docs/sdk.md, "Reconnecting".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from fencemq.errors import BadArgument, FenceMQError, NoAuth, NoPermission, SessionExpired, SessionTakenOver, \
    WrongPassword
from fencemq.sdk.link import Call, Link
from fencemq.sdk.reconnect import Addresses, Reconnect, Target
from fencemq.sdk.replies import ConnectionLost, _notice

# A HELLO refused with these is not a worker to wait for: the credentials or the id are wrong.
FINAL_REFUSALS = (NoAuth, WrongPassword, NoPermission, BadArgument)


class Moving:
    """The links of :class:`fencemq.sdk.connection.PipelinedConnection` and their replacement."""

    addresses: Addresses
    reconnect: Reconnect | None
    hello: dict[str, Any]
    reconnects: int
    _id: str | None
    _link: Link | None
    _leaving: list[Link]
    _resend: list[tuple[int, list[Call]]]
    _ready: asyncio.Event | None
    _reconnecting: asyncio.Task[None] | None
    _loop: asyncio.AbstractEventLoop | None
    _final: ConnectionLost | None
    _closed: bool
    _generation: int
    _had_session: bool
    _notices: asyncio.Queue[dict[str, Any] | None] | None

    # the connection's own (fencemq.sdk.connection)
    @property
    def worker(self) -> str | None: ...
    async def _open_link(self, target: Target, *, takeover: bool = False) -> Link: ...
    async def _call(self, args: Iterable[Any], convert: Callable[[Any], Any] | None = None, *,
                    resend: bool = True, generation: int | None = None) -> Any: ...
    def _expired(self) -> SessionExpired: ...
    def _tell(self, notice: dict[str, Any]) -> None: ...
    def _deliver(self, notice: dict[str, Any]) -> None: ...
    def _first_time(self, notice: dict[str, Any]) -> bool: ...

    # -- links coming and going ----------------------------------------------------------

    def _adopt(self, link: Link, *, first: bool = False, lost_at: float | None = None) -> None:
        """Make ``link`` the one calls go to: what was lost goes out first, in its order."""
        hello = link.hello
        self.hello = hello
        given = hello.get("id")
        if hello.get("server") == "fencemq" and given or self._id is None and given not in (None, ""):
            self._id = str(given)
        expired = not first and self._had_session and hello.get("session") == "new"
        if expired:
            self._generation += 1
        self._had_session = self._had_session or hello.get("session") is not None
        self._link = link
        link.held = any(old.pending for old in self._leaving)
        resend = [c for _, calls in sorted(self._resend, key=lambda nc: nc[0]) for c in calls]
        self._resend = []
        for call in resend:
            if call.future.done():
                continue
            if expired and call.generation is not None:
                call.future.set_exception(self._expired())
            else:
                link.submit(call)
        assert self._ready is not None
        self._ready.set()
        if first:
            return
        self.reconnects += 1
        now = asyncio.get_running_loop().time()
        self._tell({"type": "reconnected", "worker": self.worker, "address": link.target.name,
                    "session": "new" if expired else hello.get("session", "resumed"),
                    "resent": len(resend),
                    "after_ms": None if lost_at is None else round((now - lost_at) * 1000)})
        if expired:
            self._tell({"type": "session_expired", "client": self._id})
        if hello.get("server") == "fencemq":
            # what was queued for the session while it had no connection (its pushes went nowhere)
            asyncio.ensure_future(self._collect_notices()).add_done_callback(
                lambda t: t.cancelled() or t.exception())

    def _link_lost(self, link: Link, calls: list[Call], exc: ConnectionLost) -> None:
        """A link ended (its calls unanswered): send them again elsewhere, or fail them."""
        if link in self._leaving:
            self._leaving.remove(link)
        current = link is self._link
        if current:
            self._link = None
            if self._ready is not None and self._final is None:
                self._ready.clear()
        if self._final is None and not self._closed and (self.reconnect is None or isinstance(exc, SessionTakenOver)):
            self._final = exc
        if self._final is not None or self._closed:
            final = self._final or exc
            for call in calls:
                if not call.future.done():
                    call.future.set_exception(final)
            if current or self._link is None:
                self._fail_waiting(final)
            return
        keep: list[Call] = []
        for call in calls:
            if call.future.done():
                continue  # its caller went away
            if not call.resend:
                call.future.set_exception(ConnectionLost(
                    f"the connection to {link.target.name} was lost before the reply to this command came: "
                    "it may or may not have run"))
            elif call.sends >= self.reconnect.max_sends:  # type: ignore[union-attr]
                call.future.set_exception(ConnectionLost(
                    f"this command went out on {call.sends} connections and each was lost before its reply "
                    f"came (the last to {link.target.name}); not sending it again"))
            else:
                keep.append(call)
        if keep:
            self._resend.append((link.number, keep))
        if current:
            self._start_reconnecting(avoid=link.target.name, reason=str(exc))
        else:
            self._link_idle(link)

    def _link_idle(self, link: Link) -> None:
        """A link being left has every reply in (or is gone): close it, and let the newer one write."""
        if link in self._leaving and not link.pending and link.lost is None:
            self._leaving.remove(link)
            asyncio.ensure_future(link.close())
        current = self._link
        if current is not None and current.held and not any(old.pending for old in self._leaving):
            resend = [c for _, calls in sorted(self._resend, key=lambda nc: nc[0]) for c in calls
                      if not c.future.done()]
            self._resend = []
            current.submit_first(resend)
            current.release()

    def _move(self, link: Link, notice: dict[str, Any]) -> None:
        """The worker drains: stop writing to it, collect its replies, and connect elsewhere now."""
        if self.reconnect is None or link is not self._link or link.lost is not None:
            return  # without reconnecting, the worker's close ends the client as before
        link.draining = True
        self._link = None
        assert self._ready is not None
        self._ready.clear()
        if link.pending:
            self._leaving.append(link)
        else:
            asyncio.ensure_future(link.close())
        self._start_reconnecting(avoid=link.target.name, reason=f"worker {notice.get('worker')} is draining")

    def _start_reconnecting(self, avoid: str | None, reason: str) -> None:
        if self._reconnecting is not None and not self._reconnecting.done():
            return
        self._tell({"type": "disconnected", "worker": self.worker, "reason": reason})
        self._reconnecting = asyncio.ensure_future(self._reconnect(avoid))

    async def _reconnect(self, avoid: str | None) -> None:
        policy = self.reconnect
        assert policy is not None and self._loop is not None
        lost_at = self._loop.time()
        rounds, last = 0, "no address answered"
        while not self._closed and self._final is None:
            for target in await self.addresses.targets(avoid):
                try:
                    link = await self._open_link(target)
                except ConnectionLost as exc:
                    last = str(exc)
                    continue
                except FINAL_REFUSALS as exc:  # credentials or the id refused: waiting will not help
                    self._give_up(ConnectionLost(f"reconnecting to {target.name} was refused: {exc}"))
                    return
                except FenceMQError as exc:  # the session being ended right now, Redis failing over…
                    last = f"{target.name}: {exc}"
                    continue
                if self._closed or self._final is not None:
                    await link.close()
                    return
                self._adopt(link, lost_at=lost_at)
                return
            rounds += 1
            if policy.gives_up(rounds, self._loop.time() - lost_at):
                self._give_up(ConnectionLost(
                    f"gave up reconnecting after {rounds} rounds over {self._loop.time() - lost_at:.1f} s "
                    f"({', '.join(self.addresses.urls)}): {last}"))
                return
            await asyncio.sleep(policy.delay(rounds))

    def _give_up(self, exc: ConnectionLost) -> None:
        if self._final is None:
            self._final = exc
        self._tell({"type": "connection_lost", "reason": str(exc)})
        self._fail_waiting(self._final)

    def _fail_waiting(self, exc: ConnectionLost) -> None:
        """Over: every call waiting for a link raises ``exc``; notices() ends."""
        for _, calls in self._resend:
            for call in calls:
                if not call.future.done():
                    call.future.set_exception(exc)
        self._resend = []
        if self._ready is not None:
            self._ready.set()  # the waiters wake and find it over
        if self._notices is not None:
            self._notices.put_nowait(None)  # ends notices()

    async def _collect_notices(self) -> None:
        """After a reconnect: the notices queued for the session meanwhile, handed out as if pushed."""
        raw = await self._call(["HEARTBEAT"], lambda r: [_notice(n) for n in r or ()])
        for notice in raw:
            if self._first_time(notice):
                self._deliver(notice)
