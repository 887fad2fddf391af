"""Long polls: ``PULL … BLOCK`` and ``TAKE … BLOCK`` wait on their queue's wake channel.

The subscription to the channel is confirmed before the first look, so a
publish between a look and the wait is never missed; the BLOCK time runs out
in the wait, never in a look (a fence call cut short could check messages out
to a reply nobody sends); a worker draining for a deploy ends the wait and
the verb answers what it has; a client that hangs up gets nothing more.

A PULL's long poll is registered in Redis as a waiter a publish hands its
messages to (docs/data-model.md, "Waiting long polls"; lua/lib/waiters.lua):
they come checked out with the wake-up, and no look follows.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from fencemq.errors import FenceMQError
from fencemq.fences.leases import Leases, Look, PullResult
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.model.handles import Handle
from fencemq.server.services import Services
from fencemq.server.session import Session
from fencemq.server.wakeups import Waiter

log = logging.getLogger(__name__)

WAITER_MARGIN_MS = 1000  # a long poll's record outlives its BLOCK by this (it is removed when the wait ends)
HANDED_GRACE_S = 0.5  # how long a hand-off's wake-up may trail the look that found the record gone


class ClientGone(Exception):
    """The client hung up while its command was running."""


async def wait(services: Services, session: Session, h: Handle, block_ms: int, attempt: Callable[[], Awaitable[Any]],
               done: Callable[[Any], bool]) -> Any:
    """Wait on the queue's wake channel, looking again (``attempt``) after each wake-up until ``done``;
    BLOCK 0 waits up to max_block_ms."""
    timeout = min(block_ms or services.config.max_block_ms, services.config.max_block_ms) / 1000
    result = None
    async with session.until_hangup():
        # A worker draining for a deploy ends the wait (not a look): the verb answers what it has
        with anyio.move_on_after(timeout) as waiting, session.interruptible(waiting):
            async with services.wakeups.watching(services.keys.queue(h.queue).wake) as waiter:
                while True:
                    # The BLOCK time runs out in the wait, not in a look: a fence call cut
                    # short could check messages out to a reply nobody sends.
                    with anyio.CancelScope(shield=True):
                        result = await attempt()
                    if done(result):
                        break
                    await waiter.wait()
    if session.gone:
        # The client hung up while it waited: nothing more is checked out to it, and what the last
        # look checked out goes back. (A worker draining still answers: what a look found is in it.)
        await _hand_back(services, h, result)
        raise ClientGone
    return result if result is not None else await attempt()


async def pull(services: Services, session: Session, h: Handle, count: int, block_ms: int,
               first: Callable[[Look], Awaitable[PullResult]] | None = None) -> PullResult:
    """PULL … BLOCK: :func:`wait`, registered as a waiter a publish may hand its messages to
    (lua/lib/waiters.lua: they come with the wake-up, checked out, and no look follows). A look
    that finds its registration gone was handed messages: they come with the wake-up too, or are
    read back if that was lost. Hanging up gives back, unread, whatever was handed meanwhile.

    ``first``: how the first look is made, when not by a PULL alone (an ACK pipelined before it:
    the pair in one round trip, the PULL registering the waiter as it looks)."""
    leases = services.core.leases
    wait_ms = min(block_ms or services.config.max_block_ms, services.config.max_block_ms)
    result: PullResult | None = None
    registered: Look | None = None  # the waiter's record, while a look left one
    async with services.wakeups.watching(services.keys.queue(h.queue).wake) as waiter:
        async with session.until_hangup():
            with anyio.move_on_after(wait_ms / 1000) as waiting, session.interruptible(waiting):
                while True:
                    # The BLOCK time runs out in the wait, not in a look: a fence call cut
                    # short could check messages out to a reply nobody sends.
                    with anyio.CancelScope(shield=True):
                        result, registered = await _look(leases, h, count, waiter, registered, wait_ms, first)
                    first = None
                    if result.deliveries:
                        break
                    await waiter.wait()
        if registered is not None:  # timed out, drained or hung up with its record in place
            with anyio.CancelScope(shield=True):
                if session.gone:  # what a publish handed meanwhile goes back, unread
                    await leases.pull(h, count, Look("leave", waiter.wid, registered.since))
                else:
                    result = await leases.pull(h, count, Look("last", waiter.wid, registered.since))
                    if result.status == "handed":
                        result = await _handed(leases, h, count, waiter, registered)
    if session.gone:
        # The client hung up while it waited: nothing more is checked out to it, and what the last
        # look checked out goes back. (A worker draining still answers: what a look found is in it.)
        await _hand_back(services, h, result)
        raise ClientGone
    return result if result is not None else await leases.pull(h, count)


async def _hand_back(services: Services, h: Handle, result: Any) -> None:
    """What a look checked out for a client that hung up meanwhile goes straight back to the group
    (NACK … RELEASE: no failure counted) rather than wait out its lease under nobody."""
    found = getattr(result, "deliveries", None) or ([result] if hasattr(result, "tag") else [])
    tags = [d.tag for d in found if not d.tag.startswith("q")]  # a QoS 0 delivery has no lease
    if tags:
        with anyio.CancelScope(shield=True):
            try:
                await services.core.leases.nack(h, tags, release=True)
            except (FenceMQError, *REDIS_FAILURES):
                pass  # they come back when their leases run out


async def _look(leases: Leases, h: Handle, count: int, waiter: Waiter, registered: Look | None,
                wait_ms: int, first: Callable[[Look], Awaitable[PullResult]] | None) -> tuple[PullResult, Look | None]:
    """One look of a PULL … BLOCK (or what a publish handed it): the result, and its record after."""
    if first is not None or waiter.handed is None:
        if registered is None:
            look = Look("first", waiter.wid, wait_ms=wait_ms + WAITER_MARGIN_MS)
            result = await (first(look) if first is not None else leases.pull(h, count, look))
            return result, Look("again", waiter.wid, result.since) if result.since else None
        result = await leases.pull(h, count, registered)
        if result.status != "handed":
            return result, None if result.deliveries else registered
    return await _handed(leases, h, count, waiter, registered), None


async def _handed(leases: Leases, h: Handle, count: int, waiter: Waiter, registered: Look | None) -> PullResult:
    """What a publish handed to this long poll: from its wake-up (which may trail the look that
    found the registration gone by a moment: it comes on another connection), else read back."""
    if waiter.handed is None:
        with anyio.move_on_after(HANDED_GRACE_S):
            while waiter.handed is None:
                await waiter.wait()
    reply, waiter.handed = waiter.handed, None
    if reply is not None:
        return await leases.handed(h, reply)
    assert registered is not None
    log.warning("a hand-off to a long poll on %s did not arrive; reading it back", h.queue.qid)
    return await leases.pull(h, count, Look("recover", waiter.wid, registered.since))
