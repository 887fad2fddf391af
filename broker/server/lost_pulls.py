"""A PULL whose reply Redis's failure lost: the next PULL of the handle on the connection answers it.

A PULL's fence call cut off by a lost connection or a timeout (``TRYAGAIN``) may have checked
messages out to the member (a PULL is not one of the calls the durability setting confirms). Nobody
received them: left alone, their leases ran out, the member was suspected, and a plain client
that only sends its PULL again got empty replies until it RENEWed tags it never saw. So the
connection remembers the handle's PULL as in doubt, and its next PULL of that handle first reads
back (lua/pull.lua, look ``recover``) the member's checkouts made after the last delivery this
connection answered for the handle: what the lost PULL checked out. They are that PULL's answer,
at most COUNT of them (the rest come with the next PULL), their leases as they were made; when
there are none, the PULL checks out as usual. docs/protocol.md, "A PULL answered TRYAGAIN".

What a connection remembers is small and bounded: per handle it pulled, the last tag it
delivered (for the most recent :data:`REMEMBERED_HANDLES`), and the handles in doubt. A handle
it has no tag for reads back every checkout of the member (its first PULL here was the lost one;
what another connection of the session checked out and kept comes again: at least once).
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fencemq.fences.leases import Leases, Look, PullResult
from fencemq.fences.redis_servers import NotSent
from fencemq.model.handles import Handle
from fencemq.model.messages import Delivery

# What a PULL's fence call may raise after it ran in Redis (READONLY, NOREPLICAS, OOM… never ran; NotSent
# never left the worker)
MAY_HAVE_RUN: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError)
REMEMBERED_HANDLES = 64


class PullLedger:
    """One connection's PULLs: the last tag delivered per handle, and the handles whose PULL is in doubt."""

    __slots__ = ("delivered_to", "in_doubt")

    def __init__(self) -> None:
        self.delivered_to: dict[str, int] = {}
        self.in_doubt: dict[str, int] = {}

    def delivered(self, handle: str, deliveries: Sequence[Delivery]) -> None:
        if not deliveries:
            return
        tag = deliveries[-1].tag  # a batch's tags rise (lua/lib/leases.lua lease_out); a QoS 0 one is 'q<tag>'
        self.delivered_to.pop(handle, None)
        self.delivered_to[handle] = int(tag[1:] if tag.startswith("q") else tag)
        if len(self.delivered_to) > REMEMBERED_HANDLES:
            del self.delivered_to[next(iter(self.delivered_to))]

    def doubt(self, handle: str, exc: BaseException) -> None:
        """The handle's PULL failed with ``exc``: in doubt if it may have run."""
        if isinstance(exc, MAY_HAVE_RUN) and not isinstance(exc, NotSent):
            self.in_doubt.setdefault(handle, self.delivered_to.get(handle, 0))

    async def recover(self, leases: Leases, handle: str, h: Handle, count: int) -> PullResult | None:
        """What the handle's PULL in doubt checked out (at most ``count``), or None: nothing in doubt,
        or it checked nothing out (or its leases ran out meanwhile)."""
        since = self.in_doubt.get(handle)
        if since is None:
            return None
        result = await leases.pull(h, count, Look("recover", "", str(since)))  # checkouts only: no QoS 0
        found = result.deliveries
        if len(found) > count:
            self.in_doubt[handle] = int(found[count - 1].tag)  # the rest: with the next PULL
            result.deliveries = found[:count]
            return result
        del self.in_doubt[handle]
        return result if found else None
