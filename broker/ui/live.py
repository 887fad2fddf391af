"""The overview's sampler: one per process, whatever the number of open pages.

Rates are differences between two samples, so someone has to keep the
previous one: a task started with the app samples every ``interval`` seconds
(server-side: a browser never asks for a refresh), keeps the last
``history_s`` seconds for the charts, and wakes every open overview stream.
Other pages' streams re-read their own page at the same interval. Nobody
looking at an overview for a minute: the sampler pauses (the charts then have
a gap) until the next one opens.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import anyio

from fencemq.model.keys import Keyspace
from fencemq.fences.memory import read_alarms
from fencemq.ops.overview import OverviewState, overview_sample
from fencemq.ops.redis_health import Health, HealthReader

log = logging.getLogger("fencemq.ui")
IDLE_AFTER_S = 60.0  # no overview open for this long: the sampler waits for the next one


class Sampler:
    def __init__(self, keys: Keyspace, interval: float = 2.0, history_s: float = 600.0,
                 lease_ms: int | None = None, url: str | None = None) -> None:
        self.keys, self.interval, self.lease_ms, self.url = keys, interval, lease_ms, url
        self.reader: HealthReader | None = None  # every Redis node's health, read with each sample
        self.state = OverviewState()
        self.history: deque[dict[str, Any]] = deque(maxlen=max(2, int(history_s / interval)))
        self.latest: dict[str, Any] | None = None
        self.sampled_at = 0.0
        self.error: str | None = None
        self.version = 0
        self._changed = anyio.Event()
        self._wanted = anyio.Event()
        self.last_wanted = -IDLE_AFTER_S

    async def sample(self, redis: Any) -> dict[str, Any]:
        snap = await overview_sample(redis, self.keys, self.state, lease_ms=self.lease_ms)
        snap["health"] = await self.health(redis)
        snap["alarms"] = await read_alarms(redis, self.keys)
        self.latest = snap
        self.sampled_at = time.monotonic()
        self.error = None
        if snap["interval_s"]:
            self.history.append({"t": snap["now_ms"], **snap["rates"], "backlog": snap["backlog"]})
        self.version += 1
        self._changed.set()
        self._changed = anyio.Event()
        return snap

    @property
    def stale(self) -> bool:
        return self.latest is None or time.monotonic() - self.sampled_at > 3 * self.interval

    def want(self) -> None:
        """Someone looks at the overview: keep sampling (a worker serving the UI to nobody reads nothing)."""
        self.last_wanted = time.monotonic()
        self._wanted.set()

    async def run(self, redis: Any) -> None:
        while True:
            if time.monotonic() - self.last_wanted > IDLE_AFTER_S:
                self._wanted = anyio.Event()
                await self._wanted.wait()
            try:
                await self.sample(redis)
            except Exception as exc:  # noqa: BLE001 - a Redis hiccup must not end the sampling
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("overview sample failed: %s", self.error)
            await anyio.sleep(self.interval)

    async def health(self, redis: Any) -> Health:
        """Every Redis node's health now (the sampler's reader: one small client per node, kept)."""
        if self.reader is None:
            self.reader = HealthReader(redis, self.keys, self.url)
        return await self.reader.read()

    async def aclose(self) -> None:
        if self.reader is not None:
            await self.reader.aclose()
            self.reader = None

    async def wait_newer(self, version: int) -> int:
        """Return once a sample newer than ``version`` exists; its version."""
        while self.version <= version:
            await self._changed.wait()
        return self.version
