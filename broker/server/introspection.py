"""What INFO and CLIENT INFO/LIST say about a worker and its connections.

Redis's text formats (``field:value`` lines under ``# Section`` headers; one
``k=v …`` line per connection), so that health probes, ``redis-cli --stat``
and client libraries' ready checks (ioredis reads ``loading:0``) understand a
worker. The figures are this worker's: it keeps no state that matters, and
the broker's own is inspected with ``fencemq status``.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from collections.abc import Callable

from fencemq import __version__
from fencemq.server.roster import Roster
from fencemq.server.session import Session

# What clients that gate features on the server's version should assume:
# FenceMQ speaks RESP3, HELLO and CLIENT SETINFO as Redis 7.2 does.
REDIS_COMPATIBLE = "7.2.0"


def _server(roster: Roster, worker_id: str, port: int | None) -> list[tuple[str, object]]:
    uptime = int(time.time() - roster.started)
    return [
        ("redis_version", REDIS_COMPATIBLE), ("fencemq_version", __version__), ("redis_mode", "standalone"),
        ("server_name", "fencemq"), ("os", f"{platform.system()} {platform.release()} {platform.machine()}"),
        ("arch_bits", 64 if sys.maxsize > 2**32 else 32), ("process_id", os.getpid()), ("run_id", worker_id),
        ("tcp_port", port or 0), ("uptime_in_seconds", uptime), ("uptime_in_days", uptime // 86400),
    ]


def _clients(roster: Roster) -> list[tuple[str, object]]:
    return [("connected_clients", len(roster.sessions)),
            ("blocked_clients", sum(1 for s in roster.sessions.values() if s.waiting)),
            ("named_sessions", len({s.client_id for s in roster.sessions.values() if s.bound and not s.anonymous}))]


def _memory() -> list[tuple[str, object]]:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return [("used_memory", rss), ("used_memory_human", f"{rss / 2**20:.2f}M"), ("maxmemory", 0)]


def _persistence() -> list[tuple[str, object]]:
    # A worker holds nothing to persist (Redis does); it is never loading.
    return [("loading", 0), ("async_loading", 0), ("rdb_bgsave_in_progress", 0), ("aof_enabled", 0)]


def _stats(roster: Roster) -> list[tuple[str, object]]:
    return [("total_connections_received", roster.connections_received),
            ("total_commands_processed", roster.commands_processed), ("instantaneous_ops_per_sec", 0),
            ("rejected_connections", 0), ("keyspace_hits", 0), ("keyspace_misses", 0)]


def _replication() -> list[tuple[str, object]]:
    return [("role", "master"), ("connected_slaves", 0)]


def info_text(roster: Roster, worker_id: str, port: int | None, sections: list[str]) -> str:
    """INFO's reply for the sections asked for (none, ``default``, ``all`` or ``everything``: all of them)."""
    builders: dict[str, Callable[[], list[tuple[str, object]]]] = {
        "server": lambda: _server(roster, worker_id, port), "clients": lambda: _clients(roster),
        "memory": _memory, "persistence": _persistence, "stats": lambda: _stats(roster),
        "replication": _replication, "keyspace": lambda: [],
    }
    wanted = [s.lower() for s in sections] or ["default"]
    if {"default", "all", "everything"} & set(wanted):
        wanted = list(builders)
    parts: list[str] = []
    for name in dict.fromkeys(wanted):
        build = builders.get(name)
        if build is None:
            continue  # as Redis: an unknown section is left out, not an error
        lines = [f"# {name.capitalize()}"] + [f"{k}:{v}" for k, v in build()]
        parts.append("\r\n".join(lines) + "\r\n")
    return "\r\n".join(parts)


def client_line(session: Session) -> str:
    """One CLIENT LIST / CLIENT INFO line, Redis's fields where they have a meaning here."""
    now = time.monotonic()
    fields = {
        "id": session.number, "addr": session.peer, "laddr": session.local, "fd": -1,
        "name": session.client_id if session.client_id and not session.anonymous else "",
        "age": int(now - session.opened), "idle": int(now - session.last_active),
        "flags": "x" if session.transaction is not None else "N", "db": 0, "sub": 0, "psub": 0, "ssub": 0,
        "multi": len(session.transaction.queued) if session.transaction is not None else -1,
        "cmd": session.last_verb or "NULL", "user": "default", "redir": -1, "resp": session.proto,
        "lib-name": session.library.get("lib-name", ""), "lib-ver": session.library.get("lib-ver", ""),
        "session": session.client_id or "",
    }
    return " ".join(f"{k}={v}" for k, v in fields.items()) + "\n"
