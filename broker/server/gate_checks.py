"""The gate's checks that read Redis: subscriptions per session, a resumed session's subscriptions
against its user's grants of now, and group-wide actions on a group another user also uses.

A mixin of :class:`fencemq.server.gate.Gate` (which has ``config``; a worker's gate also has
``redis``, ``keys`` and ``core``: the UI's has none, and asks none of these).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from fencemq.config import Config
from fencemq.errors import LimitExceeded, NoPermission
from fencemq.fences import at_rest, session_index
from fencemq.model import meta
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.model.handles import Handle
from fencemq.model.records import decode_names
from fencemq.model.values import text
from fencemq.ops.users import User

CHECKED_FIELD = "grants-checked"  # session hash field: the grants its subscriptions were last checked under


def grants_stamp(user: User) -> str:
    return hashlib.sha256(json.dumps(sorted(user.grants)).encode()).hexdigest()[:16]


CROWDED_KEPT = 16  # sessions near max_subscriptions a worker keeps in mind for the limits alarm


class SessionChecks:
    config: Config
    crowded: dict[str, int]  # sessions seen near max_subscriptions -> subscriptions held
    redis: Any
    keys: Keyspace
    core: Any

    async def check_subscriptions(self, client: str, adding: int = 1) -> None:
        """LIMIT once the session would hold more than max_subscriptions (lite ones are lite_quota's).

        Checked before the fence, not inside it: connections of one session subscribing at the
        same instant may pass it by a few.
        """
        held = int(await self.core.ctx.linked.scard(self.keys.session_handles(client)))
        if held + adding >= self.config.alarm_limit_share * self.config.max_subscriptions:
            self.note_crowded(client, held + adding)
        if held + adding > self.config.max_subscriptions:
            raise LimitExceeded(f"this session holds {held} subscriptions (max_subscriptions "
                                f"{self.config.max_subscriptions}); UNSUB some first")

    def note_crowded(self, client: str, held: int) -> None:
        """A session near max_subscriptions: the health watcher's limits alarm names it (a few at most)."""
        if client in self.crowded or len(self.crowded) < CROWDED_KEPT:
            self.crowded[client] = held

    async def crowded_sessions(self) -> dict[str, int]:
        """The sessions seen near max_subscriptions that still are (each counted again: one may have left
        some since): client -> subscriptions held."""
        crowded = self.crowded
        for client in list(crowded):
            held = int(await self.redis.scard(self.keys.session_handles(client)))
            if held < self.config.alarm_limit_share * self.config.max_subscriptions:
                del crowded[client]
            else:
                crowded[client] = held
        return dict(crowded)

    async def drop_revoked(self, user: User | None, client: str) -> list[Handle]:
        """A session taken up again: its subscriptions its user may no longer subscribe to are left
        (their checkouts go back), and returned for the door to tell the client.

        Cheap when nothing changed: the session remembers the grants it was last checked under.
        """
        if user is None or user.superuser:
            return []
        stamp = grants_stamp(user)
        key = self.keys.session(client)
        if text(await self.redis.hget(key, CHECKED_FIELD) or b"") == stamp:
            return []
        revoked = [h for h in await session_index.handles(self.redis, self.keys, client)
                   if not user.may("subscribe", h.queue.topic)]
        for handle in revoked:
            await self.core.subscriptions.unsubscribe(handle)
        await self.redis.hset(key, CHECKED_FIELD, stamp)
        return revoked

    async def check_group_wide(self, user: User | None, queue: QueueRef, group: str, member: str,
                               action: str = "seek") -> None:
        """Moving a group's cursor or epoch moves it for all its members: when another user's client
        is also a member, NOPERM unless ``user`` holds ``action`` (seek) on the queue's topic."""
        if user is None or user.may(action, queue.topic) or group.startswith("~"):
            return
        mark, members = await at_rest.meta_fields(self.redis, self.keys.queue(queue),
                                                  [meta.COMPACT_MARK, meta.group_field(group, meta.MEMBERS)])
        names = decode_names(members)
        if mark is not None:  # an lmq at rest: its group's only member is its owner
            held_by, bar, owner = text(mark).partition("|")
            if not bar:
                held_by, owner = meta.LITE_GROUP, held_by
            names = [owner] if held_by == group else []
        others = [m for m in names if m != member]
        if not others:
            return
        owners = await self.redis.hmget(self.keys.client_owners, *others)
        if all(o is not None and text(o) == user.name for o in owners):
            return
        raise NoPermission(f"group '{group[:64]}' of '{queue.topic[:128]}' has members of another user, and "
                           f"{user.missing(action, queue.topic)}")
