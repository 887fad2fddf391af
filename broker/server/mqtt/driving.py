"""What drives an MQTT connection: its reads, its deadlines, and its end, with no task while it idles.

A mixin of fencemq.server.mqtt.listener.MqttConnection. Each read goes straight into the sans-I/O
session (fencemq.protocol.mqtt.session); the events it yields are handled in order by one task,
started when there are some and ended when they are handled (reading pauses meanwhile: a client
is read one batch ahead at most). The session's deadlines (the time to CONNECT, 1.5 × Keep Alive)
and the gate's request timeout are event-loop timers. A PINGREQ costs a PINGRESP written from the
read itself. The end — every task of the connection cancelled, then the socket closed, the session
let go and the will scheduled — runs once, in a task of its own.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio

from fencemq.protocol.mqtt.events import MqttEvent
from fencemq.server.mqtt.wire import ConnectionTasks

log = logging.getLogger(__name__)

LINGER_S = 1.0  # how long a connection the server ended waits for the client to close it


class Deadlines:
    """The CONNECT and keep-alive deadlines of a worker's MQTT connections on one event-loop timer.

    A heap of (when, connection); a connection whose deadline moved leaves its old entry behind, to
    be skipped when it comes up. A timer of its own would cost each connection some 500 bytes; an
    entry here costs a tuple. Entries of connections that ended are dropped once they are half of
    the heap, so an ended connection is not held for long.
    """

    __slots__ = ("_heap", "_timer", "_at", "_order", "_stale")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, MqttDriving]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._at = float("inf")
        self._order = itertools.count()
        self._stale = 0

    def at(self, when: float, conn: MqttDriving) -> None:
        heapq.heappush(self._heap, (when, next(self._order), conn))
        if when < self._at:
            self._arm(when)

    def ended(self) -> None:
        """A connection ended: its entries are stale; past half the heap, they are dropped."""
        self._stale += 1
        if self._stale > 64 and self._stale * 2 > len(self._heap):
            self._heap = [e for e in self._heap if e[2]._tick_at == e[0] and not e[2]._ending]
            heapq.heapify(self._heap)
            self._stale = 0

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._at = when
        self._timer = asyncio.get_running_loop().call_later(max(0.0, when - time.monotonic()), self._fire)

    def _fire(self) -> None:
        self._timer, self._at = None, float("inf")
        heap, now = self._heap, time.monotonic()
        while heap and heap[0][0] <= now:
            when, _, conn = heapq.heappop(heap)
            if conn._tick_at == when:
                conn._ticked()
        if heap:
            self._arm(heap[0][0])


class MqttDriving:
    __slots__ = ()  # MqttConnection holds the attributes: a compact object per connection
    mqtt: Any
    stream: Any
    tasks: ConnectionTasks | None
    gate: Any
    config: Any
    token: str
    ended_by_server: bool
    left: bool

    # (and, from the classes it is mixed with: _handle_and_flush, _write, _session_over, will_after_delay;
    # not declared here, where a stub would come first in the method order and hide them)

    def _not_driven_yet(self) -> None:
        """The driving's attributes, from the connection's __init__ (all of an object's attributes set
        there, in one order, keep its instance dict compact: ~30 of them cost a few hundred bytes)."""
        self._spawn: Callable[..., None] | None = None
        self._over: Callable[[Any], None] | None = None
        self._queue: deque[list[MqttEvent]] | None = None  # events of reads not handled yet (made when needed)
        self._working = False
        self._ending = False
        self._caught_up: asyncio.Event | None = None
        self._deadlines: Deadlines | None = None
        self._tick_at = float("inf")  # the deadline this connection has in the worker's Deadlines
        self._request_timer: asyncio.TimerHandle | None = None

    def _start_driving(self, spawn: Callable[..., None], over: Callable[[Any], None], deadlines: Deadlines) -> None:
        self.tasks = ConnectionTasks(spawn, self.cut)
        self._deadlines = deadlines
        self._spawn = spawn
        self._over = over  # the door's bookkeeping once the connection is closed and its session let go
        self._arm_tick()

    # -- what the client sends -----------------------------------------------------------------

    def received(self, data: bytes) -> None:
        """A read (the wire's); b"" once the client has gone."""
        if self._ending or self.left:
            # ended by the server, or about to be (a drain): what the client still sends is dropped,
            # unacknowledged, for it to send again
            return
        if not data:
            self._disarm_request()
            self._handle_soon(self.mqtt.connection_lost())
            return
        mqtt = self.mqtt
        events = mqtt.receive_bytes(data, time.monotonic())
        if mqtt.mid_packet:
            if self._request_timer is None and self.gate.request_timeout_s != float("inf"):
                self._request_timer = asyncio.get_running_loop().call_later(
                    self.gate.request_timeout_s, self._request_expired)
        else:
            self._disarm_request()
        if events:
            self._handle_soon(events)
        else:
            self._write_now()  # a PINGRESP, say: nothing to wait for

    def _handle_soon(self, events: list[MqttEvent]) -> None:
        if self._queue is None:
            self._queue = deque()
        self._queue.append(events)
        if self._working:
            self.stream.pause_reading()  # a batch ahead at most: TCP holds the client back meanwhile
        elif self.tasks is not None:
            self._working = True
            self.tasks.start_soon(self._work)

    async def _work(self) -> None:
        queue = self._queue
        try:
            while queue:
                await self._handle_and_flush(queue.popleft())  # type: ignore[attr-defined]
                if self.mqtt.closed and not queue:  # (what closed it is handled last)
                    self.cut()
                    return
                self._arm_tick()
        finally:
            self._working = False
            self._queue = None  # an idle connection keeps no queue
            self.stream.resume_reading()
            caught_up, self._caught_up = self._caught_up, None
            if caught_up is not None:
                caught_up.set()

    async def caught_up(self) -> None:
        """Until what the client sent is handled (the stream wire reads on then)."""
        if self._working or self._queue:
            self._caught_up = self._caught_up or asyncio.Event()
            await self._caught_up.wait()

    def _write_now(self) -> None:
        if not self._working and self.tasks is not None:
            data = self.mqtt.outbound()
            if data:
                self.tasks.start_soon(self._send_now, data)

    async def _send_now(self, data: bytes) -> None:
        await self._write(data)  # type: ignore[attr-defined]

    # -- deadlines -----------------------------------------------------------------------------

    def _arm_tick(self) -> None:
        """A timer for the session's next deadline (the CONNECT's, then 1.5 × Keep Alive after the
        last packet), moved earlier when it comes sooner; firing early only looks again."""
        deadline = self.mqtt.next_deadline()
        if deadline is None or deadline >= self._tick_at or self._deadlines is None:
            return
        self._tick_at = deadline
        self._deadlines.at(deadline, self)

    def _ticked(self) -> None:
        self._tick_at = float("inf")
        if self._ending:
            return
        events = self.mqtt.tick(time.monotonic())
        if events:
            self._handle_soon(events)
        elif self.mqtt.closed and not self._working:
            self.cut()
        self._arm_tick()

    def _disarm_request(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _request_expired(self) -> None:
        self._request_timer = None
        if self.mqtt.mid_packet and not self._ending:
            log.info("closing MQTT connection %s: a packet unfinished for %d ms", self.token,
                     self.config.request_timeout_ms)
            self._handle_soon(self.mqtt.connection_lost())

    # -- the end -------------------------------------------------------------------------------

    def cut(self) -> None:
        """End the connection now: its tasks are cancelled, then it closes."""
        if self._ending:
            return
        self._ending = True
        self._tick_at = float("inf")
        if self._deadlines is not None:
            self._deadlines.ended()
        if self._request_timer is not None:
            self._request_timer.cancel()
        assert self._spawn is not None
        self._spawn(self._end)
        if self.tasks is not None:
            self.tasks.cancel()

    async def _end(self) -> None:
        tasks = self.tasks
        with anyio.CancelScope(shield=True):
            if tasks is not None:
                await tasks.finished()
            self.tasks = None  # drain() and a takeover notice now find nothing to start
            try:
                if self.ended_by_server:
                    await self._linger()
                await self.stream.aclose()
                await self._session_over()  # type: ignore[attr-defined]
            except Exception:  # one connection's failure must never take the worker down
                log.exception("MQTT connection %s failed at its end", self.token)
            finally:
                if self._over is not None:
                    self._over(self)
        try:
            await self.will_after_delay()  # type: ignore[attr-defined]
        except Exception:  # one connection's failure (Redis, out of open files) must never take the worker down
            log.exception("the will of MQTT connection %s failed", self.token)

    async def _linger(self) -> None:
        """After the server ended the connection: half-close it and wait (dropping what the client
        still sends) until it closes, for at most LINGER_S. Closing a socket with bytes unread
        resets it, and a client that is still writing (PUBRELs, say) would lose the DISCONNECT that
        says why before reading it."""
        try:
            await self.stream.send_eof()
        except (NotImplementedError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return  # TLS and WebSocket cannot half-close: closed at once, as before
        self.stream.resume_reading()
        with anyio.move_on_after(LINGER_S):
            await self.stream.closed_by_peer()
