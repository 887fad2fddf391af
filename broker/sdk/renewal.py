"""Lock renewal in the SDK: keep the leases of deliveries in hand while a handler runs.

``async with sub.renewing(d):`` and ``sub.iter(renew_locks=True)`` (fencemq.sdk.subscription)
use a :class:`LockRenewer`: one RENEW for all the tags it holds, every third of the lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Protocol

from fencemq.errors import FenceMQError
from fencemq.model.messages import Delivery
from fencemq.sdk.replies import ConnectionLost


class Renewable(Protocol):
    """What a renewer needs of its subscription (fencemq.sdk.subscription.Subscription)."""

    handle: str
    lock_ms: int | None

    @property
    def effective_lock_ms(self) -> int: ...

    async def renew(self, *tags: str | bytes | Delivery, lock_ms: int | None = None) -> int: ...


class LockRenewer:
    """Renews a subscription's checkouts in hand, one RENEW for all of them every third of the lock.

    Used as ``async with sub.renewing(d):`` or by ``sub.iter(renew_locks=True)``.
    A tag that was settled meanwhile renews nothing (RENEW of a settled tag is
    a no-op), so the renewer never has to be told about ACKs.
    """

    def __init__(self, sub: Renewable, deliveries: Iterable[Delivery], *, every_ms: int | None,
                 max_ms: int | None) -> None:
        self.sub = sub
        self.tags: list[str | bytes] = [d.tag for d in deliveries]
        self.every_s = (every_ms or max(1, sub.effective_lock_ms // 3)) / 1000
        self.max_s = None if max_ms is None else max_ms / 1000
        self.renewed = 0  # RENEW calls made
        self._task: asyncio.Task[None] | None = None

    def hold(self, deliveries: list[Delivery]) -> None:
        """Renew these (and only these) from now on."""
        self.tags = [d.tag for d in deliveries]
        self._start()

    def _start(self) -> None:
        if self.tags and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"renew-{self.sub.handle}")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        until = None if self.max_s is None else loop.time() + self.max_s
        while until is None or loop.time() < until:
            await asyncio.sleep(self.every_s if until is None else min(self.every_s, max(0, until - loop.time())))
            if self.tags and (until is None or loop.time() <= until):
                try:
                    await self.sub.renew(*self.tags, lock_ms=self.sub.lock_ms)
                    self.renewed += 1
                except FenceMQError:
                    pass  # a refused RENEW (the member was evicted): the leases run out, as without renewal
                except ConnectionLost:
                    return

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def __aenter__(self) -> LockRenewer:
        self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
