"""A bounded admission: connections taken up a few hundred at a time, the rest waiting accepted.

In a reconnect storm 10,000 clients connect to one worker at the same moment. Before, each
was attached as soon as it was accepted, and all of them competed for the worker at once:
the accept loop got one turn of a crowded event loop per connection, so the kernel's
listen backlog (``somaxconn``, 4,096 here) overflowed and the dropped SYNs came back on
TCP's retry schedule (1, 3, 7, 15, 31, 63 s...): 1,677 connects failed and the storm took
135 s to settle, though the worker's CPU for it was ~35 s.

Now the accept loop only accepts (a crowd waiting in the backlog is taken in one go), and
:class:`Admission` lets ``max_connecting`` connections at a time into their connect phase
(the CONNECT read, the session bound and taken up, the CONNACK); the others wait, accepted,
their CONNECT unread in the kernel's buffer, and are let in first come first served as each
admitted one is done. The worker takes the storm at a steady rate with its batches (session
binds, filter registrations) full, instead of 10,000 half-done connects each holding the others up.

A connection waiting here is already counted against ``max_connections`` (the refusal is
at accept), and its connect timeout starts only once it is admitted: it has been waiting
for the worker, not the worker for it. A client that is admitted and never sends its CONNECT
holds a place until that timeout (``auth_timeout_ms``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import anyio

Start = Callable[[Callable[[], None]], None]


class _Waiting:
    """A connection waiting for a place: its start and abandon, and whether it still waits."""

    __slots__ = ("start", "abandon", "live")

    def __init__(self, start: Start, abandon: Callable[[], None]) -> None:
        self.start, self.abandon, self.live = start, abandon, True


class Admission:
    """``admit(start, abandon)`` calls ``start(done)`` now when fewer than ``limit`` are admitted,
    else once a place is free (first come, first served); ``done()`` gives the place back (once: a
    second call does nothing). :meth:`abandon_waiting` calls ``abandon()`` of those still waiting
    (the worker stops accepting). ``limit`` 0: no bound, every ``start`` is called at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.admitted = 0
        self.waiting: deque[_Waiting] = deque()
        self.most_waiting = 0  # the longest the queue has been (a storm's depth; for logs and tests)

    def admit(self, start: Start, abandon: Callable[[], None]) -> _Waiting | None:
        """Returns the connection's place in the queue when it waits (:meth:`withdraw` takes it out), else None."""
        while self.waiting and not self.waiting[0].live:  # withdrawn ones hold no turn
            self.waiting.popleft()
        if self.limit and (self.admitted >= self.limit or self.waiting):
            waiting = _Waiting(start, abandon)
            self.waiting.append(waiting)
            self.most_waiting = max(self.most_waiting, len(self.waiting))
            return waiting
        self._start(start)
        return None

    def withdraw(self, waiting: _Waiting) -> None:
        """A waiting connection that will never take its place (its task is cancelled): passed over, in
        O(1), when its turn comes; neither started nor abandoned."""
        waiting.live = False

    async def place(self) -> Callable[[], None] | None:
        """For a door whose connection waits in a task of its own (MQTT over WebSocket): its ``done``, once
        admitted, or None when it was abandoned (the worker stops accepting). Cancelled while it waits, it
        leaves the queue; cancelled as it is admitted, its place is given back."""
        turn = anyio.Event()
        given: list[Callable[[], None]] = []

        def start(done: Callable[[], None]) -> None:
            given.append(done)
            turn.set()

        waiting = self.admit(start, turn.set)
        try:
            await turn.wait()
        except BaseException:
            if given:
                given[0]()
            elif waiting is not None:
                self.withdraw(waiting)
            raise
        return given[0] if given else None

    def _start(self, start: Start) -> None:
        self.admitted += 1
        given_back = False

        def done() -> None:
            nonlocal given_back
            if given_back:
                return
            given_back = True
            self.admitted -= 1
            while self.waiting and (not self.limit or self.admitted < self.limit):
                waiting = self.waiting.popleft()
                if waiting.live:
                    self._start(waiting.start)

        try:
            start(done)
        except BaseException:
            done()
            raise

    def abandon_waiting(self) -> int:
        """Those still waiting are not admitted: each ``abandon()`` is called. How many there were."""
        waiting, self.waiting = self.waiting, deque()
        live = [w for w in waiting if w.live]
        for w in live:
            w.abandon()
        return len(live)
