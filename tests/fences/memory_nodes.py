"""Every node of a test's Redis, for the memory tests: read its memory, set its limit and policy, put them back."""

from __future__ import annotations

from typing import Any

import redis


class Nodes:
    """The session's Redis (one server, or a Cluster's masters under ``--redis-cluster``), node by node.

    ``CONFIG SET`` goes to each; :meth:`restore` puts back ``maxmemory 0`` and ``noeviction``, so a
    test that fails half-way leaves the session's server as it found it (use it as a context manager).
    """

    def __init__(self, server: Any) -> None:
        self.clients = [redis.Redis.from_url(u) for u in getattr(server, "urls", [server.url])]

    def used(self) -> list[int]:
        """Each node's memory as Redis counts it against maxmemory."""
        out = []
        for c in self.clients:
            info = c.info("memory")
            out.append(int(info["used_memory"]) - int(info.get("mem_not_counted_for_evict", 0)))
        return out

    def limit_at(self, share: float) -> None:
        """Set each node's maxmemory so that what it uses now is ``share`` of it (> 1: over the limit)."""
        for c, used in zip(self.clients, self.used(), strict=True):
            c.config_set("maxmemory", max(1, int(used / share)))

    def limit_above(self, headroom: int) -> None:
        """Each node's maxmemory: what it uses now, plus ``headroom`` bytes."""
        for c, used in zip(self.clients, self.used(), strict=True):
            c.config_set("maxmemory", used + headroom)

    def policy(self, policy: str, only_first: bool = False) -> None:
        for c in self.clients[:1] if only_first else self.clients:
            c.config_set("maxmemory-policy", policy)

    def restore(self) -> None:
        for c in self.clients:
            c.config_set("maxmemory", 0)
            c.config_set("maxmemory-policy", "noeviction")

    def __enter__(self) -> "Nodes":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.restore()
        finally:
            for c in self.clients:
                c.close()
