"""The sweeper: returns expired leases, releases scheduled messages when due, ends expired sessions.

Every worker runs one. It visits only queues whose earliest deadline has
passed (the global schedule), so idle queues cost nothing, and every script it
runs is idempotent, so a fleet of sweepers is safe. A lease comes back within
``sweep_interval_ms`` of its deadline.

Each member that lost a lease is suspected and told (a ``message_timeout``
notice); a notice can be lost (the sweep's reply, or the notice list, lost in a
failover; the worker gone between the two), so the sweep keeps the tags with the
suspicion and a suspected member's PULL or TAKE tells it again, at most once per
``REMIND_EVERY_S`` a handle (:meth:`Sweeper.remind`); an evicted member's poll is
told again of its ``unsubscribe`` the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio

from fencemq.errors import FenceMQError
from fencemq.fences.core import Core
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.fences.lite import unsubscribe_notice
from fencemq.fences.sessions import timeout_notice
from fencemq.model.handles import Handle
from fencemq.model.keys import queue_ref
from fencemq.server import metrics
from fencemq.server.mqtt.wills import Wills

log = logging.getLogger(__name__)

REMIND_EVERY_S = 1.0  # a fenced member polling is told again at most this often
REMINDED_KEPT = 10_000  # handles remembered as told (past it, the memory starts again)


class Sweeper:
    def __init__(self, core: Core, interval_ms: int, worker_id: str = "",
                 attached: Callable[[], set[str]] = set, wills: Wills | None = None) -> None:
        self.core = core
        self.wills = wills  # a dead worker's MQTT sessions' wills, published as the sweep ends them
        self.sessions = core.sessions
        self.interval = interval_ms / 1000
        self.worker_id = worker_id
        self.attached = attached  # the sessions this worker's connections hold
        self._unreachable = False  # the last round failed for Redis (said once until a round succeeds)
        self._reminded: dict[str, float] = {}  # handle -> when its member was last told again

    async def run(self) -> None:
        while True:
            try:
                await self.sweep_once()
                self._unreachable = False
            except anyio.get_cancelled_exc_class():
                raise
            except REDIS_FAILURES as exc:
                # Redis failing over or a shard down: expected, and the next round tries again. One line
                # when the outage begins, not a traceback twenty times a second while it lasts.
                if not self._unreachable:
                    log.warning("sweep round failed, trying again every %d ms: %s", self.interval * 1000, exc)
                self._unreachable = True
            except Exception:  # a bug: a failed round must not stop the next one
                log.exception("sweep round failed")
            await anyio.sleep(self.interval)

    async def sweep_once(self) -> int:
        """One round; returns how many leases came back."""
        returned = 0
        now = await self.sessions.clock.now_ms()
        for qid, shard in await self.core.leases.due_entries(now):
            try:
                returned += await self._sweep(qid, now, shard)
            except (FenceMQError, *REDIS_FAILURES) as exc:  # one queue's failure must not skip the others
                log.warning("sweep of %s failed: %s", qid, exc)
        for client in await self.sessions.claim_expired(self.worker_id, self.attached):
            try:
                # an MQTT will neither published nor scheduled: its worker died (kill -9); the session
                # ends now, so the will is due now (server/mqtt/wills.py)
                will = await self.wills.left_behind(client) if self.wills is not None else None
                if await self.sessions.end(client) is not None:
                    metrics.SESSIONS_EXPIRED.inc()
                    if will is not None and self.wills is not None:
                        await self.wills.publish(client, will, 0)
            except (FenceMQError, *REDIS_FAILURES) as exc:  # the next round finishes it
                log.warning("ending the session of %s failed: %s", client, exc)
        return returned

    async def _sweep(self, qid: str, now_ms: int, shard: int | None = None) -> int:
        result = await self.core.leases.sweep(qid, shard)
        ref = queue_ref(qid)
        if 0 <= result.scheduled_due <= now_ms:  # messages published for later, due now (fences/schedule.py)
            metrics.SCHEDULED_RELEASED.inc(await self.core.shared.release_due(ref, now_ms))
        if result.returned:
            await self.core.mailboxes.dispatch_all(ref)
        metrics.SUSPICIONS.inc(len(result.newly_suspected))
        for _, _, tags, _ in result.timeouts:
            metrics.LEASE_TIMEOUTS.inc(len(tags))
        await self.sessions.tell_timeouts(ref, result.timeouts)
        return result.returned

    async def remind(self, handle: Handle, fence: str, news: list[str]) -> None:
        """A fenced member polled (PULL or TAKE; FenceContext.on_fenced_poll): tell it again what its
        notice said, even when that notice was lost: a suspected one which leases ran out, so it can
        show life (RENEW); an evicted one who took its place (``unsubscribe``, marked ``resent``), so it
        stops polling. A failure is logged: the poll was answered, and the next one tells it again."""
        key, now = handle.encode(), anyio.current_time()
        if now - self._reminded.get(key, -REMIND_EVERY_S) < REMIND_EVERY_S:
            return
        if len(self._reminded) >= REMINDED_KEPT:
            self._reminded.clear()
        self._reminded[key] = now
        notice = timeout_notice(handle, news) if fence == "suspected" else unsubscribe_notice(handle, news[0], resent=True)
        try:
            await self.sessions.notify(handle.member, notice)
        except (FenceMQError, *REDIS_FAILURES) as exc:
            log.warning("telling %s again of its %s notice failed: %s", handle.member, notice["type"], exc)
