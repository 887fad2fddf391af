"""What an acknowledgement promises: the ``durability`` setting (docs/operations.md, "Replicas, failover and Sentinel").

- ``local`` (the default): a PUB's ids and an ACK's reply come once the fence
  ran on the primary. A failover to a replica that had not received it yet
  undoes it.
- ``replicas=N``: they come once ``WAIT N`` confirms that N replicas hold the
  fence's writes (the WAIT rides the same connection, in the same round trip).
  A host loss is survived only when N is every replica the primary has: the
  replica promoted may be one of those that did not confirm (Redis Cluster's
  election ranks replicas by what they know of each other's offsets, and a
  replica held back does not know it lags).
- ``replicas=all``: once every replica connected to that primary holds them
  (``WAIT k`` then ``ROLE`` on the same connection: confirmed when the WAIT
  counted at least the replicas ROLE lists, and at least one). ``k`` is the
  count the primary's last ROLE gave; a wrong guess costs one wait or one
  UNCONFIRMED, never a false confirmation. A replica held back but still
  connected is waited for, so whichever is promoted has the write; a primary
  left without a replica confirms nothing.
- ``aof``: once ``WAITAOF 1 0`` confirms the primary fsynced them to its
  AOF (Redis ≥ 7.2, Valkey ≥ 8.0, ``appendonly yes``; refused at start-up
  otherwise); ``aof+replicas=N``: and N replicas fsynced them too.

A confirmation that does not come within ``durability_timeout_ms`` answers
``UNCONFIRMED``: the write ran and may survive or not; the client sends the
same request again (a ``PUB … ID`` is deduplicated, and the fence then writes
again what the first one wrote, so the second confirmation covers the first).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import RedisCluster
from redis.exceptions import ResponseError

from fencemq.errors import BadArgument, Unconfirmed

# The fences whose reply is an acknowledgement: a producer's ids, a consumer's settlement.
CONFIRMED_FENCES = frozenset({"publish", "ack"})
_FORM = re.compile(r"^(?:(local)|(aof)|replicas=(\d+|all)|aof\+replicas=(\d+|all))$")


@dataclass(frozen=True, slots=True)
class Durability:
    replicas: int = 0
    aof: bool = False
    timeout_ms: int = 1000
    every_replica: bool = False  # replicas=all: as many as the primary has connected (at least one)
    # replicas=all: the replicas each primary (its node name; None on one server) had at its last ROLE
    connected: dict[str | None, int] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def parse(cls, text: str, timeout_ms: int = 1000) -> Durability:
        """``local`` | ``replicas=N|all`` | ``aof`` | ``aof+replicas=N|all``; BadArgument otherwise."""
        m = _FORM.match(text.strip().lower())
        if m is None:
            raise BadArgument(f"durability is local, replicas=N, replicas=all, aof, aof+replicas=N or "
                              f"aof+replicas=all, not {text!r}")
        if timeout_ms <= 0:
            raise BadArgument(f"durability_timeout_ms must be positive, not {timeout_ms}")
        given = m.group(3) or m.group(4)
        every = given == "all"
        replicas = 1 if every else int(given or 0)
        if given and replicas < 1:
            raise BadArgument("replicas=N needs N >= 1 (durability=local waits for none)")
        return cls(replicas=replicas, aof=bool(m.group(2) or m.group(4)), timeout_ms=timeout_ms, every_replica=every)

    @property
    def local(self) -> bool:
        return not self.replicas and not self.aof

    def __str__(self) -> str:
        if self.local:
            return "local"
        n = "all" if self.every_replica else self.replicas
        return "+".join(filter(None, ("aof" if self.aof else "", f"replicas={n}" if self.replicas else "")))

    def commands(self, node: str | None = None, guess: int = 1) -> list[tuple[Any, ...]]:
        """The confirmation to send right after the fence, on its connection (``node``: its primary;
        ``guess``: its replicas as far as the client knows, until a ROLE said)."""
        want = max(1, self.connected.get(node, guess)) if self.every_replica else self.replicas
        wait = ("WAITAOF", 1, want, self.timeout_ms) if self.aof else ("WAIT", want, self.timeout_ms)
        # replicas=all: which replicas the primary has, asked after the WAIT on the same connection
        return [wait, ("ROLE",)] if self.every_replica else [wait]

    def confirmed(self, replies: list[Any], node: str | None = None) -> Unconfirmed | None:
        """None when the replies to :meth:`commands` confirm; else the error the client gets."""
        reply = replies[0]
        need = self.replicas
        error = next((r for r in replies if isinstance(r, Exception)), None)
        if error is None and (len(replies) < len(self.commands()) or any(r is None for r in replies)):
            error = ResponseError("no reply to the confirmation")
        if error is None and self.every_replica:
            role = replies[1]
            if str(_text(role[0])) != "master":
                error = ResponseError(f"the node is a {_text(role[0])} now")
            else:
                need = len(role[2])
                self.connected[node] = need
        if error is not None:
            why = " ".join(str(error).split())[:120]
        elif self.every_replica and need < 1:
            why = "the primary has no replica connected"
        elif self.aof:
            local, replicas = (int(x) for x in reply)
            if local >= 1 and replicas >= need:
                return None
            why = f"{local} local and {replicas} of {need} replica fsyncs"
        else:
            if int(reply) >= need:
                return None
            why = f"{int(reply)} of {need} replicas"
        return Unconfirmed(f"it ran, but durability={self} was not confirmed within {self.timeout_ms} ms ({why}); "
                           f"a failover may undo it: send it again (the same PUB ID stores nothing twice)")


async def check_server(redis: Any, durability: Durability) -> None:
    """Refuse at start-up a durability the server cannot give (WAITAOF missing, AOF off)."""
    if not durability.aof:
        return
    cluster = isinstance(redis, RedisCluster)
    kwargs: dict[str, Any] = {"target_nodes": RedisCluster.PRIMARIES} if cluster else {}
    try:
        await redis.execute_command("WAITAOF", 0, 0, 0, **kwargs)  # waits for nothing: is it known?
    except ResponseError as exc:
        if "unknown command" not in str(exc).lower():
            raise
        server = await redis.info("server", **kwargs)
        if cluster:
            server = next(iter(server.values()))
        version = server.get("valkey_version") or server.get("redis_version")
        raise BadArgument(f"durability={durability} needs WAITAOF (Redis >= 7.2, Valkey >= 8.0); the broker's "
                          f"server is {server.get('server_name', 'redis')} {version}: use local or replicas=N") from None
    persistence = await redis.info("persistence", **kwargs)
    states = list(persistence.values()) if cluster else [persistence]
    if not all(int(p.get("aof_enabled", 0)) for p in states):
        raise BadArgument(f"durability={durability} needs appendonly yes on every primary; the broker's Redis "
                          f"runs without AOF")


def add_confirmations(redis: Any, pipe: Any, durability: Durability, key_lists: list[list[str]]) -> list[Any]:
    """Queue the confirmation behind fences whose keys are ``key_lists``, on their connections: one
    at the end on one server (a pipeline is one connection); one per master on a Cluster, whose
    pipeline sends each master's commands, in order, on one connection of that master. The
    masters (None on one server), to hand to :func:`confirmation_refused`."""
    if not key_lists:
        return []
    if not isinstance(redis, RedisCluster):
        for command in durability.commands():
            pipe.execute_command(*command)
        return [None]
    nodes, guesses = {}, {}
    for keys in key_lists:
        node = redis.get_node_from_key(keys[0])
        nodes.setdefault(node.name, node)
        guesses.setdefault(node.name, len(redis.nodes_manager.slots_cache.get(redis.keyslot(keys[0]), ())) - 1)
    for node in nodes.values():
        for command in durability.commands(node.name, guesses[node.name]):
            pipe.execute_command(*command, target_nodes=node)
    return list(nodes.values())


def confirmation_refused(redis: Any, durability: Durability, replies: list[Any], nodes: list[Any],
                         key_lists: list[list[str]]) -> Unconfirmed | None:
    """The UNCONFIRMED the confirmed fences answer, or None when every confirmation came.

    On a Cluster, a fence redirected (MOVED, ASK) ran on another master than the
    one its confirmation waited on: unconfirmed, whatever that one said."""
    per = len(durability.commands())
    for i, node in enumerate(nodes):
        refusal = durability.confirmed(replies[i * per:(i + 1) * per], None if node is None else node.name)
        if refusal is not None:
            return refusal
    if isinstance(redis, RedisCluster):
        names = {node.name for node in nodes}
        for keys in key_lists:
            if redis.get_node_from_key(keys[0]).name not in names:
                return durability.confirmed([ResponseError("the slot moved to another master meanwhile")])
    return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
