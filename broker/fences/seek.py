"""Seek fenced by epochs (guarantee 2): move a subscription's cursor, raise its epoch.

A seek moves the group's cursor to a message id, a publish time, the
earliest or the latest message and raises the group's epoch in the same
atomic call (lua/seek.lua), so epochs only grow. Every delivery carries the
epoch it was read under; checkouts of an older epoch settle nothing.
Lua side: lua/lib/seek.lua. Protocol: docs/protocol.md, "Seek and epochs".
"""

from __future__ import annotations

from fencemq.errors import BadArgument
from fencemq.fences.context import FenceContext
from fencemq.fences.registry import fence
from fencemq.model.handles import Handle

SEEK = fence("seek", "meta log checkouts deadlines owned held ready delayed wake journal totals backlogs priority rest", "group member operator kind target")
TARGETS = ("earliest", "latest", "id", "time")


class Seek:
    def __init__(self, ctx: FenceContext) -> None:
        self.ctx = ctx

    async def move(self, handle: Handle, kind: str, arg: int | None = None, *,
                   operator: bool = False) -> tuple[int, int, bool]:
        """Move the group's cursor; returns (new epoch, cursor, clamped to retention).

        The handle's member must be the group's active member (not evicted,
        ended or a standby), unless an ``operator`` seeks.
        """
        if kind not in TARGETS:
            raise BadArgument("SEEK takes ID id, TIME ms, EARLIEST or LATEST")
        k = self.ctx.keys.queue(handle.queue)
        res = await self.ctx.fences.run(SEEK, k, group=handle.group, member=handle.member, operator=int(operator), kind=kind,
                                        target="" if arg is None else arg)
        return int(res[0]), int(res[1]), bool(int(res[2]))
