"""Holding hostile clients back: failed AUTHs per client address.

The throttle has no I/O and no clock of its own (``now`` is passed in), so
its policy is testable without waiting. One worker's view: a guesser spreading its
attempts over workers meets each worker's delay, and each connection is
still closed after ``auth_max_failures`` failures.
"""

from __future__ import annotations

from collections import OrderedDict

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
