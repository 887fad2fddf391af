"""The fences layer, assembled: every part bound to one Redis.

    core = Core(redis, config)
    await core.publishing.publish("orders", [b"hello"])
    sub = await core.subscriptions.subscribe("alice", "orders", group="billing")
    batch = await core.leases.pull(Handle.decode(sub.handle), 10)

One part per guarantee (``lite``, ``seek``, ``mailboxes``, ``shared``,
``leases``) plus ``publishing`` (and ``scheduling``: messages published for
later), ``subscriptions`` and ``sessions``; each is
the Python side of its fences (docs/architecture.md has the table). The
parts are built bottom-up, each given the parts it calls.
"""

from __future__ import annotations

from typing import Any

from fencemq.config import Config
from fencemq.fences.context import FenceContext
from fencemq.fences.leases import Leases
from fencemq.fences.lite import Lite
from fencemq.fences.mailbox import Mailboxes
from fencemq.fences.publish import Publishing
from fencemq.fences.schedule import Scheduling
from fencemq.fences.seek import Seek
from fencemq.fences.sessions import RedisClock, Sessions
from fencemq.fences.shared import Shared
from fencemq.fences.subscribe import Subscriptions


class Core:
    def __init__(self, redis: Any, config: Config) -> None:
        self.ctx = ctx = FenceContext(redis, config)
        self.redis, self.config, self.keys, self.fences = redis, config, ctx.keys, ctx.fences
        self.durability = ctx.fences.durability
        self.lite = Lite(ctx)
        self.mailboxes = Mailboxes(ctx)
        self.leases = Leases(ctx, self.mailboxes)
        self.seek = Seek(ctx)
        self.subscriptions = Subscriptions(ctx, self.mailboxes, self.lite)
        self.clock = RedisClock(redis)
        self.publishing = Publishing(ctx, self.mailboxes, self.clock)
        self.scheduling = Scheduling(ctx, self.mailboxes)
        self.shared = Shared(ctx, self.publishing, self.subscriptions, self.scheduling)
        self.sessions = Sessions(ctx, self.subscriptions, self.lite, self.clock, config.session_lease_ms)
