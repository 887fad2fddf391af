"""Users and their permissions, kept in Redis so every worker agrees.

One hash, ``<prefix>:users`` (a single key: one slot on a Cluster), holds a
JSON record per user name: the scrypt parameters, salt and hash of the
password (scrypt is memory-hard: a guess costs ~16 MiB and ~50 ms), and the
grants, each an action and an MQTT-style topic filter (``+``/``#``). A user may
do an action on a topic, or on every topic of a filter, when one of its grants
names the action (or ``all``) with a filter that covers it (:func:`covers`: the
one matcher every door uses, through the gate in fencemq.server.gate). As MQTT
matches, a grant whose filter starts with a wildcard never reaches a topic that
starts with ``$``: those need a grant that names them (``publish:$SYS/#``).
Operator actions that are not about one topic (``admin``: user management) are
granted with the filter ``#``.

The legacy single password of a worker (``--password``) is the ``default``
user: a superuser, who may do everything ($-topics included), as before users
existed.

Every change to a user is announced on ``<users key>:changed`` (the user's name),
so that workers end or update the connections of a user whose record changed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import anyio

from fencemq.errors import BadArgument
from fencemq.model.topics import check_filter

# What a grant may name. publish/subscribe are the application's; the rest are the operator's.
ACTIONS = ("publish", "subscribe", "inspect", "evict", "seek", "purge", "dlq", "admin")
ALL = "all"
DEFAULT_USER = "default"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
MIN_PASSWORD, MAX_PASSWORD = 8, 1024
# scrypt: n * r * 128 bytes of memory per guess (2**14 * 8 * 128 = 16 MiB)
SCRYPT = {"n": 2**14, "r": 8, "p": 1}


def changes_channel(users_key: str) -> str:
    """The pub/sub channel a change to a user is announced on (its name)."""
    return users_key + ":changed"


def check_user_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise BadArgument("a user name is 1-64 characters: letters, digits and . _ @ - (not first)")
    return name


def check_password(password: str) -> str:
    if not (MIN_PASSWORD <= len(password) <= MAX_PASSWORD):
        raise BadArgument(f"a password is {MIN_PASSWORD} to {MAX_PASSWORD} characters")
    return password


def check_action(action: str) -> str:
    if action not in (*ACTIONS, ALL):
        raise BadArgument(f"unknown action '{action[:32]}'; one of {', '.join((*ACTIONS, ALL))}")
    return action


def _derive_now(password: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(password.encode(), salt=salt, n=n, r=r, p=p, maxmem=256 * 1024 * 1024, dklen=32)


async def _derive(password: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    # ~50 ms of CPU: off the event loop, so other connections are served meanwhile
    return await anyio.to_thread.run_sync(_derive_now, password, salt, n, r, p)


def covers(grant: str, filt: str) -> bool:
    """True when every topic ``filt`` matches is matched by ``grant`` (``filt`` a filter or a topic name).

    For a topic name this is MQTT's matching; for a filter, every level the
    filter leaves open (``+``, ``#``) must be open in the grant too.
    """
    g_levels, f_levels = grant.split("/"), filt.split("/")
    if filt.startswith("$") and g_levels[0] in ("+", "#"):
        return False  # as matching does: leading wildcards do not reach $-topics
    for i, g in enumerate(g_levels):
        if g == "#":
            return True
        if i >= len(f_levels) or f_levels[i] == "#":
            return False
        if g != "+" and (f_levels[i] == "+" or g != f_levels[i]):
            return False
    return len(g_levels) == len(f_levels)


@dataclass(frozen=True)
class User:
    name: str
    grants: tuple[tuple[str, str], ...] = field(default=())
    superuser: bool = False  # the legacy password's default user: every action on every topic, $-topics too
    credential: str = field(default="", compare=False)  # the stored hash: a changed password changes it

    def may(self, action: str, target: str = "#") -> bool:
        """True when a grant covers ``action`` on ``target``: a topic name, or a filter (then every topic
        it can match; ``#`` for "any topic")."""
        if self.superuser:
            return True
        return any(granted in (action, ALL) and covers(filt, target) for granted, filt in self.grants)

    def missing(self, action: str, topic: str = "#") -> str:
        """The words of a NOPERM: what this user lacks."""
        where = "" if topic == "#" else f" on '{topic[:128]}'"
        return f"user '{self.name}' has no permission to {action}{where}"


def grants_cover(user: User, action: str, target: str) -> bool:
    """``user`` may do ``action`` on ``target`` (a topic name or a filter): :meth:`User.may`."""
    return user.may(action, target)


SUPERUSER_GRANTS = ((ALL, "#"),)


def default_user() -> User:
    """The worker's legacy password: every permission, as before users existed."""
    return User(DEFAULT_USER, SUPERUSER_GRANTS, superuser=True)


def user_of(name: str, record: dict[str, Any]) -> User:
    return User(name, tuple((str(a), str(f)) for a, f in record["grants"]), credential=str(record["hash"]))


class UserStore:
    """CRUD and authentication over the users hash; ``redis`` is a redis-py asyncio client."""

    def __init__(self, redis: Any, key: str) -> None:
        self.redis, self.key = redis, key
        self.channel = changes_channel(key)

    async def _record(self, name: str) -> dict[str, Any] | None:
        raw = await self.redis.hget(self.key, name)
        return None if raw is None else json.loads(raw)

    async def _write(self, name: str, record: dict[str, Any]) -> None:
        await self.redis.hset(self.key, name, json.dumps(record, separators=(",", ":")))
        await self._announce(name)

    async def _announce(self, name: str) -> None:
        """Tell the workers (best effort: a worker that misses it applies the change at the next login)."""
        await self.redis.publish(self.channel, name)

    async def get(self, name: str) -> User | None:
        """The user's current record (grants and the stamp of its password), or None."""
        record = await self._record(name) if NAME.match(name or "") else None
        return None if record is None else user_of(name, record)

    async def add(self, name: str, password: str, grants: list[tuple[str, str]] | None = None) -> User:
        check_user_name(name)
        check_password(password)
        checked = [(check_action(a), check_filter(f)) for a, f in grants or []]
        salt = os.urandom(16)
        record = {"salt": salt.hex(), "hash": (await _derive(password, salt, **SCRYPT)).hex(), **SCRYPT,
                  "grants": [list(g) for g in checked]}
        # HSETNX: two admins adding the same name at once cannot overwrite each other
        if not await self.redis.hsetnx(self.key, name, json.dumps(record, separators=(",", ":"))):
            raise BadArgument(f"user '{name}' exists; use passwd or grant")
        return User(name, tuple(checked))

    async def passwd(self, name: str, password: str) -> None:
        check_password(password)
        record = await self._record(check_user_name(name))
        if record is None:
            raise BadArgument(f"no user '{name}'")
        salt = os.urandom(16)
        record.update({"salt": salt.hex(), "hash": (await _derive(password, salt, **SCRYPT)).hex(), **SCRYPT})
        await self._write(name, record)

    async def exists(self, name: str) -> bool:
        return bool(await self.redis.hexists(self.key, check_user_name(name)))

    async def delete(self, name: str) -> bool:
        deleted = bool(await self.redis.hdel(self.key, check_user_name(name)))
        if deleted:
            await self._announce(name)
        return deleted

    async def grant(self, name: str, action: str, filt: str) -> User:
        record = await self._record(check_user_name(name))
        if record is None:
            raise BadArgument(f"no user '{name}'")
        pair = [check_action(action), check_filter(filt)]
        if pair not in record["grants"]:
            record["grants"].append(pair)
            await self._write(name, record)
        return user_of(name, record)

    async def revoke(self, name: str, action: str, filt: str) -> User:
        record = await self._record(check_user_name(name))
        if record is None:
            raise BadArgument(f"no user '{name}'")
        pair = [check_action(action), filt]
        kept = [g for g in record["grants"] if g != pair]
        if kept != record["grants"]:
            record["grants"] = kept
            await self._write(name, record)
        return user_of(name, record)

    async def list(self) -> list[User]:
        raw = await self.redis.hgetall(self.key)
        users = [user_of(k.decode() if isinstance(k, bytes) else k, json.loads(v)) for k, v in raw.items()]
        return sorted(users, key=lambda u: u.name)

    async def any(self) -> bool:
        return bool(await self.redis.hlen(self.key))

    async def authenticate(self, name: str, password: str) -> User | None:
        """The user, when the password is its own; None otherwise (unknown names cost a derivation too)."""
        record = await self._record(name) if NAME.match(name or "") else None
        if record is None:
            await _derive(password, b"\0" * 16, **SCRYPT)  # the same time whether or not the name exists
            return None
        got = await _derive(password, bytes.fromhex(record["salt"]), record["n"], record["r"], record["p"])
        if not hmac.compare_digest(got, bytes.fromhex(record["hash"])):
            return None
        return user_of(name, record)
