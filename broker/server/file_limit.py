"""Open files: the worker's descriptors, shared out between its clients and its own needs.

Every client connection is a descriptor, and so is every connection to Redis. At start a
worker raises its soft ``RLIMIT_NOFILE`` to the hard limit (as Redis does), then caps
``max_connections`` to what fits beside a reserve: the Redis connections (a pool per
server, pub/sub included), the listeners, the event loop's own descriptors, log files, the
metrics and UI servers and refusals being written. It logs the figures. Past
``max_connections`` a new connection is told so and closed; should descriptors run out all
the same (the UI, a leak, a limit lowered from outside), accept sheds the connection with a
spare descriptor (server/accepting.py) and only the one Redis call or connection that could
not open fails: the worker never stops for it.

No I/O but the two ``resource`` calls, so the arithmetic is testable without a worker.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass

from fencemq.errors import BadArgument

log = logging.getLogger(__name__)

# Descriptors a worker needs besides its clients and Redis: three listeners, the event loop's
# epoll and wake-up pipe, stdio and logs, the metrics and UI servers and their scrapers, the
# spare that accept sheds with, refusals being written, an embedded Redis' pipes.
RESERVED = 64
REDIS_POOL = 256  # connections per Redis server when descriptors are plenty (redis_client.connect)
MIN_REDIS_POOL = 8


@dataclass(frozen=True, slots=True)
class FileBudget:
    """How a worker's open files are shared out."""

    soft_before: int  # the soft limit the process started with
    limit: int  # the soft limit now (raised to the hard one when allowed)
    hard: int
    redis_pool: int  # connections to each Redis server at most (commands past it wait for one)
    redis_servers: int
    clients: int  # client connections that fit: what max_connections is capped to

    @property
    def reserved(self) -> int:
        return self.limit - self.clients - self.redis_pool * self.redis_servers

    def describe(self, configured: int) -> str:
        raised = (f"raised from {self.soft_before} to {self.limit}" if self.limit != self.soft_before
                  else f"{self.limit}")
        capped = (f"max_connections {min(configured, self.clients)}"
                  + (f" (capped from {configured}: raise the hard limit, ulimit -Hn / LimitNOFILE, to serve more)"
                     if configured > self.clients else ""))
        return (f"open files: soft limit {raised} (hard {_shown(self.hard)}): {self.redis_pool * self.redis_servers} "
                f"for Redis ({self.redis_pool} per server x {self.redis_servers}), {self.reserved} reserved, "
                f"{self.clients} for clients; {capped}")


def _shown(n: int) -> str:
    return "unlimited" if n == resource.RLIM_INFINITY else str(n)


def plan(limit: int, *, servers: int = 1, soft_before: int | None = None, hard: int | None = None) -> FileBudget:
    """Share ``limit`` descriptors out: Redis gets an eighth of what the reserve leaves (at most
    REDIS_POOL per server, at least MIN_REDIS_POOL), clients the rest."""
    room = limit - RESERVED
    pool = max(MIN_REDIS_POOL, min(REDIS_POOL, room // (8 * max(1, servers))))
    clients = room - pool * servers
    if clients < 1:
        raise BadArgument(f"an open-file limit of {limit} leaves no room for clients (a worker reserves {RESERVED} "
                          f"and {pool * servers} for Redis); raise it (ulimit -n) to at least {RESERVED + pool * servers + 100}")
    return FileBudget(soft_before=limit if soft_before is None else soft_before, limit=limit,
                      hard=limit if hard is None else hard, redis_pool=pool, redis_servers=servers, clients=clients)


def raise_soft_limit() -> tuple[int, int, int]:
    """Raise the soft limit on open files to the hard one; (soft before, soft now, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if target == resource.RLIM_INFINITY:
        target = _nr_open()
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # macOS refuses more than OPEN_MAX, whatever the hard limit says
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
            return soft, soft, hard
        return soft, target, hard
    return soft, soft if soft != resource.RLIM_INFINITY else target, hard


def _nr_open() -> int:
    """The most a process may open where the hard limit says unlimited (Linux: fs.nr_open)."""
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 10240  # OPEN_MAX on macOS


def budget(servers: int = 1) -> FileBudget:
    """This process's budget, after raising its soft limit."""
    before, now, hard = raise_soft_limit()
    return plan(now, servers=servers, soft_before=before, hard=hard)
