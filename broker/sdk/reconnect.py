"""Reconnecting: where a client may go (its worker addresses) and how long it keeps trying.

A client is given one worker URL, a list of them, or a URL whose host name has a
DNS record per worker. Each round of attempts resolves the names again, shuffles
the addresses (so clients spread over the workers, as nats.py does by default),
puts last the one the client was just told to leave, and tries each once; between
rounds it waits a jittered, growing delay (ioredis's retryStrategy, the Kafka
clients' reconnect.backoff) and gives up after ``give_up_after_s`` without a
connection — the only time the application sees ``ConnectionLost``.
How the rest works (what is sent again, sessions, notices): docs/sdk.md, "Reconnecting".
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.connection import UnixDomainSocketConnection, parse_url

# What the client sets itself on every connection, whatever a URL's query says.
_OWN_SETTINGS = ("protocol", "socket_timeout", "socket_connect_timeout", "lib_name", "lib_version", "db")


@dataclass(frozen=True)
class Reconnect:
    """How a client reconnects (``Client(..., reconnect=Reconnect(...))``; ``reconnect=False``: never).

    After a connection is lost (or the worker said it is draining) the client tries every address at
    once; then waits between rounds: ``first_delay_s``, doubling up to ``max_delay_s``, each wait
    jittered between half and all of it. It gives up after ``give_up_after_s`` without a connection
    (None: never) or ``max_rounds`` rounds (None: no limit): then every waiting and later call raises
    ``ConnectionLost``. A reply with a retriable code (``TRYAGAIN``: the broker's Redis is failing
    over; ``errors.RETRIABLE``) is waited out the same way and the command sent again. A command
    that went out on ``max_sends`` connections, each lost before its reply, raises ConnectionLost
    (ioredis's maxRetriesPerRequest: a command that brings its worker down every time is not sent
    for ever).
    """

    first_delay_s: float = 0.05
    max_delay_s: float = 2.0
    give_up_after_s: float | None = 60.0
    max_rounds: int | None = None
    max_sends: int = 10

    def __post_init__(self) -> None:
        if self.first_delay_s <= 0 or self.max_delay_s < self.first_delay_s:
            raise ValueError("Reconnect needs 0 < first_delay_s <= max_delay_s")
        if self.give_up_after_s is not None and self.give_up_after_s < 0:
            raise ValueError("give_up_after_s must be >= 0 (None: never give up)")
        if self.max_rounds is not None and self.max_rounds < 1:
            raise ValueError("max_rounds must be >= 1 (None: no limit)")
        if self.max_sends < 1:
            raise ValueError("max_sends must be >= 1")

    def delay(self, rounds: int) -> float:
        """The wait after ``rounds`` failed rounds (1, 2, …): growing, capped, jittered ("equal jitter":
        half of it fixed, so a herd of clients spreads out without any retrying at once)."""
        ceiling = min(self.max_delay_s, self.first_delay_s * 2 ** (rounds - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    def gives_up(self, rounds: int, waited_s: float) -> bool:
        """Whether to stop after ``rounds`` failed rounds, ``waited_s`` after the connection was lost."""
        if self.max_rounds is not None and rounds >= self.max_rounds:
            return True
        return self.give_up_after_s is not None and waited_s >= self.give_up_after_s


def reconnect_policy(reconnect: Reconnect | bool) -> Reconnect | None:
    if reconnect is True:
        return Reconnect()
    if reconnect is False or reconnect is None:
        return None
    if not isinstance(reconnect, Reconnect):
        raise TypeError("reconnect takes True, False or a fencemq.Reconnect")
    return reconnect


@dataclass(frozen=True, slots=True)
class Target:
    """One address to connect to: redis-py connection settings, and how to name it."""

    name: str  # "host:port" (an address a DNS name resolved to: "name (ip):port"), or the socket path
    settings: dict[str, Any]
    url: str  # the URL it came from


class Addresses:
    """The worker URLs a client was given, as connection targets (see the module docstring)."""

    def __init__(self, urls: str | Sequence[str]) -> None:
        listed = [urls] if isinstance(urls, str) else list(urls)
        if not listed:
            raise ValueError("give at least one worker URL")
        self.urls = listed
        self.parsed: list[dict[str, Any]] = []
        for url in listed:
            settings: dict[str, Any] = dict(parse_url(url))
            for key in _OWN_SETTINGS:
                settings.pop(key, None)
            self.parsed.append(settings)
        first = self.parsed[0]
        # The session's name and credentials come from the first URL (every worker shares them).
        self.client_name: str | None = first.get("client_name")
        self.username: str | None = first.get("username")
        self.password: str | None = first.get("password")
        for settings in self.parsed:
            for key in ("client_name", "username", "password"):
                settings.pop(key, None)

    async def targets(self, avoid: str | None = None, *, shuffle: bool = True) -> list[Target]:
        """Every address to try in one round: names resolved now, shuffled, ``avoid`` last."""
        found: list[Target] = []
        for url, settings in zip(self.urls, self.parsed):
            found += await self._resolve(url, settings)
        if shuffle:
            random.shuffle(found)
        found.sort(key=lambda t: t.name == avoid)  # stable: the avoided one goes last
        return found

    @staticmethod
    async def _resolve(url: str, settings: dict[str, Any]) -> list[Target]:
        if settings.get("connection_class") is UnixDomainSocketConnection or "path" in settings:
            return [Target(str(settings.get("path")), settings, url)]
        host, port = str(settings.get("host", "127.0.0.1")), int(settings.get("port", 6379))
        plain = Target(f"{host}:{port}", settings, url)
        if _is_ip(host) or "ssl" in str(settings.get("connection_class", "")).lower():
            # TLS checks the certificate against the name: connect by name (the OS tries its records)
            return [plain]
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            return [plain]  # the attempt itself says why it fails
        ips = list(dict.fromkeys(info[4][0] for info in infos))
        if len(ips) <= 1:
            return [plain]
        return [Target(f"{host} ({ip}):{port}", {**settings, "host": ip}, url) for ip in ips]


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
