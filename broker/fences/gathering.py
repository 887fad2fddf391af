"""Calls from many connections gathered into one round trip to Redis (group commit).

A connect storm is thousands of clients each binding its session at the same moment; one
round trip each would keep the worker busy with redis-py's per-call cost. A
:class:`Gathering` queues each call; one task runs what has gathered as one batch (a
pipeline) and hands every caller its own result. While a batch is on its way, newcomers
gather for the next one, so batches grow with the load and a lone call waits for
nothing but an event-loop turn.

The batch runs in a task of the worker's (``spawn``), never in a caller's: a caller that
is cancelled (its client hung up) stops waiting, and the others still get their results.
Without ``spawn`` (the fences used outside a worker) each call runs alone, through the
same batch function: the outcome is the same either way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import anyio

from fencemq.errors import FenceMQError

In = TypeVar("In")
Out = TypeVar("Out")

MAX_BATCH = 512


class _Waiting(Generic[In]):
    """One call: its item, and the future its caller awaits (an asyncio one: redis-py ties the
    fences to asyncio anyway, and it is the cheapest thing to wait on)."""

    __slots__ = ("item", "future")

    def __init__(self, item: In, future: asyncio.Future[Any]) -> None:
        self.item = item
        self.future = future

    def settle(self, result: object) -> None:
        if not self.future.done():  # not a caller that stopped waiting
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)


class Gathering(Generic[In, Out]):
    """``await gathering(item)``: ``run(items)`` returns one result per item, in order (an
    exception in a slot is raised to that item's caller alone; one raised by ``run`` to all)."""

    def __init__(self, run: Callable[[list[In]], Awaitable[Sequence[Out | BaseException]]],
                 spawn: Callable[[], Callable[..., None] | None], max_batch: int = MAX_BATCH) -> None:
        self.run = run
        self.spawn = spawn  # the worker's spawn, read at each call (it is set once the worker runs)
        self.max_batch = max_batch
        self._pending: list[_Waiting[In]] = []
        self._flushing = False
        self.batches = 0  # batches run (for tests and benchmarks: how well calls gathered)
        self.items = 0

    async def __call__(self, item: In) -> Out:
        spawn = self.spawn()
        waiting = _Waiting(item, asyncio.get_running_loop().create_future())
        if spawn is None:
            await self._run_batch([waiting])
        else:
            self._pending.append(waiting)
            if not self._flushing:
                self._flushing = True
                spawn(self._flush)
        return await waiting.future

    async def _flush(self) -> None:
        try:
            while self._pending:
                await anyio.lowlevel.checkpoint()  # let the calls of this event-loop turn join
                batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
                await self._run_batch(batch)
        finally:
            self._flushing = False
            # cancelled (the worker stops): nobody is left waiting for a batch that will not run
            pending, self._pending = self._pending, []
            for w in pending:
                w.settle(FenceMQError("the worker is stopping; connect again"))

    async def _run_batch(self, batch: list[_Waiting[In]]) -> None:
        self.batches += 1
        self.items += len(batch)
        try:
            results = await self.run([w.item for w in batch])
        except BaseException as exc:  # every caller of the batch gets it (a cancellation: that it did not finish)
            for w in batch:
                w.settle(exc if isinstance(exc, Exception) else FenceMQError("the worker is stopping; connect again"))
            if not isinstance(exc, Exception):
                raise
            return
        for w, result in zip(batch, results, strict=True):
            w.settle(result)
