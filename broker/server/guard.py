"""Holding hostile clients back: failed logins per client address, and password checks bounded.

The throttle has no I/O and no clock of its own (``now`` is passed in), so
its policy is testable without waiting. One worker's view: a guesser spreading its
attempts over workers meets each worker's delay, and each connection is
still closed after ``auth_max_failures`` failures. The gate (fencemq.server.gate)
applies it at every door.

A password check hashes with scrypt (~16 MiB, tens of ms): :class:`PasswordChecks`
runs the checks of one address one at a time (so parallel guesses from a fresh
address meet the delays the first failures set) and at most a few at a time per
worker, and has the C library give each hash's memory back when it is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

ADDRESSES = 10_000  # addresses remembered; the least recently failed are forgotten first
FORGET_AFTER_S = 600.0  # an address that has not failed for this long starts afresh


class AuthThrottle:
    """Serializes the AUTHs of an address that failed recently, each ``delay`` apart, doubling per failure."""

    def __init__(self, base_s: float, max_s: float) -> None:
        self.base_s, self.max_s = base_s, max_s
        self._by_address: OrderedDict[str, tuple[int, float, float]] = OrderedDict()  # failures, last, next slot

    def wait(self, address: str, now: float) -> float:
        """Seconds an AUTH from ``address`` waits before it is checked (0 for one without recent failures)."""
        entry = self._by_address.get(address)
        if entry is None:
            return 0.0
        failures, last, slot = entry
        if now - last > FORGET_AFTER_S:
            del self._by_address[address]
            return 0.0
        # Each attempt takes the next slot: attempts on parallel connections queue up, not run together.
        start = max(now, slot)
        self._by_address[address] = (failures, last, start + self.delay(failures))
        return start - now

    def delay(self, failures: int) -> float:
        return min(self.max_s, self.base_s * 2 ** max(0, failures - 1)) if failures else 0.0

    def failed(self, address: str, now: float) -> None:
        failures, _, slot = self._by_address.pop(address, (0, now, now))
        self._by_address[address] = (failures + 1, now, max(slot, now + self.delay(failures + 1)))
        while len(self._by_address) > ADDRESSES:
            self._by_address.popitem(last=False)

    def succeeded(self, address: str) -> None:
        self._by_address.pop(address, None)

    def failures(self, address: str) -> int:
        entry = self._by_address.get(address)
        return entry[0] if entry else 0


class PasswordChecks:
    """At most ``at_once`` password hashes at a time per worker, and one check at a time per address."""

    def __init__(self, at_once: int) -> None:
        self._hashing = anyio.Semaphore(max(1, at_once))
        self._turns: dict[str, tuple[anyio.Lock, list[int]]] = {}  # address -> its lock, [waiting]
        return_large_allocations()

    @asynccontextmanager
    async def turn(self, address: str) -> AsyncIterator[None]:
        """The checks of one address, one after the other (entries go when nobody waits)."""
        entry = self._turns.get(address)
        if entry is None:
            entry = self._turns[address] = (anyio.Lock(), [0])
        lock, waiting = entry
        waiting[0] += 1
        try:
            async with lock:
                yield
        finally:
            waiting[0] -= 1
            if not waiting[0]:
                self._turns.pop(address, None)

    def hashing(self) -> anyio.Semaphore:
        return self._hashing

    @property
    def waiting_addresses(self) -> int:
        return len(self._turns)


M_MMAP_THRESHOLD = -3
_returned = False


def return_large_allocations(threshold: int = 4 << 20) -> None:
    """Have glibc map every allocation of ``threshold`` bytes or more on its own and unmap it when freed.

    An scrypt hash allocates 16 MiB; glibc's dynamic threshold serves the next ones from a thread's
    arena, which keeps them after they are freed (a worker that checked 40 passwords at once held
    ~400 MB for good). Fixed at 4 MiB, each hash's memory goes back when it is done. Once per
    process; elsewhere (not Linux, not glibc) nothing to do.
    """
    global _returned
    if _returned or not sys.platform.startswith("linux"):
        return
    _returned = True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and friends: they unmap large blocks anyway
        return
    mallopt(M_MMAP_THRESHOLD, threshold)
