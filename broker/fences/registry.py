"""The fence registry: the one spec of each Lua fence, and the runner that calls them.

The fences' files, headers and includes are read by :mod:`fencemq.fences.lua_sources`.
The Python side builds a call from a :class:`FenceSpec` holding the same
names (tests/fences/test_headers.py holds every header to its spec and every
``raise('CODE', …)`` to the error table). Each fence is wrapped in a redis-py
``Script``: it runs by EVALSHA and, after a restart or SCRIPT FLUSH answers
NOSCRIPT, is loaded again transparently — clients never see it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from time import perf_counter
from typing import Any

from redis.asyncio import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fencemq.errors import translate
from fencemq.fences.durability import (
    CONFIRMED_FENCES,
    Durability,
    add_confirmations,
    confirmation_refused,
)
from fencemq.fences.lua_sources import headers, sources
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.fences.redis_link import RedisLink
from fencemq.model.keys import slot_totals_registry
from fencemq.model.slots import key_slot

READ_GRACE_S = 0.2  # run_reading on a Cluster: how long the read may lag the fence before it counts as failed


# -- specs ---------------------------------------------------------------------------------

SPECS: dict[str, "FenceSpec"] = {}


@dataclass(frozen=True, slots=True)
class FenceSpec:
    """How Python calls one fence: its KEYS and ARGV by the names of its Lua header.

    Keys are looked up by name among the ``keys`` given to :meth:`Fences.run`
    (a ``QueueKeys`` answers its own attributes: ``meta``, ``log``,
    ``checkouts``…); arguments by keyword. A variadic tail is passed whole.
    """

    name: str
    keys: tuple[str, ...]
    argv: tuple[str, ...]
    keys_rest: str | None = None
    argv_rest: str | None = None
    argv_names: frozenset[str] = field(init=False, repr=False, compare=False)  # ``argv`` as a set

    def __post_init__(self) -> None:
        object.__setattr__(self, "argv_names", frozenset(self.argv))
        SPECS[self.name] = self

    def key_list(self, keys: Any, extra: Mapping[str, str], rest: Sequence[str], sharded: bool = False) -> list[str]:
        """The call's KEYS; ``sharded`` (a Cluster): the broker's totals of the queue's slot
        (``slot_totals``…) for those the header names ``totals`` and ``backlogs``."""
        names = _sharded(self.keys) if sharded else self.keys
        out = [extra[n] if n in extra else getattr(keys, n) for n in names]
        if rest and self.keys_rest is None:
            raise TypeError(f"fence {self.name} takes no variadic keys")
        return [*out, *rest]

    def arg_list(self, named: Mapping[str, Any], rest: Sequence[Any]) -> list[Any]:
        # Every call names exactly the header's ARGV: one comparison of the names as sets (a
        # dict has no name twice, nor has a header) says so; only a wrong call lists what differs.
        if named.keys() != self.argv_names:
            missing = [n for n in self.argv if n not in named]
            unknown = [n for n in named if n not in self.argv]
            raise TypeError(f"fence {self.name}: missing ARGV {missing}, unknown {unknown}")
        if rest and self.argv_rest is None:
            raise TypeError(f"fence {self.name} takes no variadic arguments")
        out = [named[n] for n in self.argv]
        out += rest
        return out


# Keys a Cluster keeps per slot (lua/lib/totals.lua): the header's name -> the QueueKeys attribute
SLOT_KEYS = {"totals": "slot_totals", "backlogs": "slot_backlogs"}


@cache
def _sharded(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(SLOT_KEYS.get(n, n) for n in names)


@cache
def _totals_at(name: str) -> int | None:
    """Where a fence's KEYS hold ``totals`` (its header names it), None when they do not."""
    keys = headers()[name].keys
    return keys.index("totals") if "totals" in keys else None


def fence(name: str, keys: str, argv: str, *, keys_rest: str | None = None, argv_rest: str | None = None) -> FenceSpec:
    """Declare a fence's spec: ``keys`` and ``argv`` are space-separated names, in header order."""
    return FenceSpec(name, tuple(keys.split()), tuple(argv.split()), keys_rest, argv_rest)


class Fences:
    """Every fence, bound to one async redis client (single server or Cluster).

    ``await fences.run(PULL, queue_keys, group=…, member=…)`` runs a fence and
    turns its coded errors into FenceMQError subclasses.
    """

    def __init__(self, redis: Any, durability: Durability | None = None) -> None:
        self.redis = redis
        # A Cluster keeps the broker's totals per slot (lua/lib/totals.lua), a single server in one place
        self.sharded = isinstance(redis, RedisCluster)
        # What a PUB's ids and an ACK's reply wait for (fences/durability.py); local: nothing.
        self.durability = durability if durability is not None else Durability()
        # Set by a worker: its fence calls go over one pipelined connection (fencemq.fences.redis_link)
        # instead of redis-py's pool; None: through ``redis``.
        self.link: RedisLink | None = None
        # Told each call's fence name and seconds (the worker's latency histogram); None: not timed.
        self.observe: Callable[[str, float], None] | None = None
        self.scripts: dict[str, AsyncScript] = {
            name: redis.register_script(src) for name, src in sources().items()
        }
        # The slot totals keys (a Cluster's) this client has listed in their registry: each is listed
        # once, before the first call that carries it is sent (register_totals).
        self.totals_registered: set[str] = set()

    async def register_totals(self, calls: Sequence[tuple[str, list[str]]]) -> None:
        """On a Cluster, list the slot of every totals key among the calls' (fence name, KEYS) in the
        keyspace's registry of totals slots (``Keyspace.totals_slots``, a set a reader sums over) before
        any of them is sent: a slot whose totals a fence writes is always listed. A SADD per slot new to
        this client (idempotent: another client may have listed it); a SADD that fails raises, and the
        calls are not sent. Its effect is remembered only once Redis has answered it."""
        if not self.sharded:
            return
        new: dict[str, set[str]] = {}
        for name, key_list in calls:
            at = _totals_at(name)
            if at is not None and (key := key_list[at]) not in self.totals_registered:
                new.setdefault(slot_totals_registry(key), set()).add(key)
        for registry, listed in new.items():
            await self.redis.sadd(registry, *sorted({key_slot(k) for k in listed}))
            self.totals_registered |= listed

    async def reassert_totals(self) -> None:
        """List again every slot this client has listed (a registry lost in a failover is made whole
        again by the workers that wrote into its slots: each calls this now and then)."""
        by_registry: dict[str, set[int]] = {}
        for key in list(self.totals_registered):
            by_registry.setdefault(slot_totals_registry(key), set()).add(key_slot(key))
        for registry, slots in by_registry.items():
            await self.redis.sadd(registry, *sorted(slots))

    def _confirms(self, names: Any) -> bool:
        return not self.durability.local and not CONFIRMED_FENCES.isdisjoint(names)

    async def _load(self, name: str) -> None:
        """Load a fence again (NOSCRIPT: Redis restarted, failed over or flushed its scripts)."""
        if self.link is not None:
            await self.link.execute("SCRIPT", "LOAD", self.scripts[name].script)
        else:
            await self.redis.script_load(self.scripts[name].script)

    async def _execute_many(self, commands: list[tuple[Any, ...]], confirm: list[list[str]] | None = None,
                            ) -> tuple[list[Any], list[Any], list[Any]]:
        """Commands in one round trip, replies in order, an error reply as its exception; then, for the
        fences whose keys are ``confirm``, the durability's confirmation on their connections
        (fences/durability.py). (the commands' replies, the confirmations' replies, their masters)"""
        if self.link is not None and not confirm:
            return await self.link.execute_many(commands), [], []
        # A confirmation (WAIT, WAITAOF) blocks its connection until it comes: never on the link every
        # fence call shares, but behind the fences on a pooled connection of their own.
        pipe = self.redis.pipeline(transaction=False)
        for command in commands:
            # (not pipe.evalsha: redis-py's Cluster pipeline blocks that name, not the command)
            pipe.execute_command(*command)
        nodes = add_confirmations(self.redis, pipe, self.durability, confirm) if confirm else []
        replies = await pipe.execute(raise_on_error=False)
        return replies[:len(commands)], replies[len(commands):], nodes

    async def run(self, spec: FenceSpec, keys: Any, *, extra_keys: Mapping[str, str] | None = None,
                  keys_rest: Sequence[str] = (), args_rest: Sequence[Any] = (), **args: Any) -> Any:
        return await self.call(spec.name, spec.key_list(keys, extra_keys or {}, keys_rest, self.sharded),
                               spec.arg_list(args, args_rest))

    async def run_many(self, spec: FenceSpec, calls: Sequence[tuple[Any, Mapping[str, str], Sequence[str],
                                                                    Mapping[str, Any]]]) -> list[Any]:
        """Many calls of one fence in one pipeline (keys, extra keys, variadic keys, arguments each).

        Replies in order; a call's coded error comes back as its FenceMQError,
        not raised. NOSCRIPT (a restart, a failover) loads the fence and runs
        the calls that met it again.
        """
        return await self.run_each([(spec, keys, extra, rest, args, ()) for keys, extra, rest, args in calls])

    async def run_each(self, calls: Sequence[tuple[FenceSpec, Any, Mapping[str, str], Sequence[str],
                                                   Mapping[str, Any], Sequence[Any]]]) -> list[Any]:
        """:meth:`run_many` for calls of any fences (spec, keys, extra keys, variadic keys, arguments,
        variadic arguments).

        On NOSCRIPT only the calls that met it run again (once their fences are
        loaded): a call that ran is never run twice."""
        return await self._run_calls([(spec.name, spec.key_list(keys, extra, rest, self.sharded),
                                       spec.arg_list(args, args_rest))
                                      for spec, keys, extra, rest, args, args_rest in calls])

    async def _run_calls(self, calls: Sequence[tuple[str, list[str], list[Any]]]) -> list[Any]:
        """(fence name, keys, arguments) each, in one pipeline; then the durability's confirmation of
        the acknowledging ones on the same connection (an UNCONFIRMED result when it does not come)."""
        results: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        await self.register_totals([(name, key_list) for name, key_list, _ in calls])
        for attempt in range(3):
            commands = []
            for i in todo:
                name, key_list, arg_list = calls[i]
                commands.append(("EVALSHA", self.scripts[name].sha, len(key_list), *key_list, *arg_list))
            confirmed = [i for i in todo if calls[i][0] in CONFIRMED_FENCES] if self._confirms(
                calls[i][0] for i in todo) else []
            started = perf_counter()
            replies, confirmations, nodes = await self._execute_many(
                commands, [calls[i][1] for i in confirmed] if confirmed else None)
            if self.observe is not None:
                for name in {calls[i][0] for i in todo}:
                    self.observe(name, perf_counter() - started)
            refusal = confirmation_refused(self.redis, self.durability, confirmations, nodes,
                                           [calls[i][1] for i in confirmed]) if confirmed else None
            again = []
            for i, reply in zip(todo, replies, strict=True):
                if attempt < 2 and (isinstance(reply, NoScriptError)
                                    or (isinstance(reply, ResponseError) and "NOSCRIPT" in str(reply))):
                    again.append(i)
                elif isinstance(reply, ResponseError):
                    results[i] = translate(reply) or reply
                else:
                    results[i] = refusal if refusal is not None and i in confirmed and not isinstance(
                        reply, Exception) else reply
            if not again:
                break
            for name in {calls[i][0] for i in again}:
                await self._load(name)
            todo = again
        return results

    async def run_reading(self, spec: FenceSpec, keys: Any, read_key: str, *, args_rest: Sequence[Any] = (),
                          **args: Any) -> tuple[Any, Any]:
        """A fence call and a GET of another slot's key in one round trip: (the fence's reply, the value,
        or the error that GET met). The fence's coded error is raised; NOSCRIPT loads the fence and
        runs it alone again.

        One server: one pipeline. A Cluster: the two side by side, never in one pipeline — the GET's
        master failing over must cost the caller neither the fence's reply (redis-py retries a
        Cluster pipeline's unanswered commands for seconds) nor its own slot's availability."""
        key_list = spec.key_list(keys, {}, (), self.sharded)
        if isinstance(self.redis, RedisCluster):
            reading = asyncio.ensure_future(self._read_or_error(read_key))
            try:
                reply = await self.call(spec.name, key_list, spec.arg_list(args, args_rest))
            except BaseException:
                reading.cancel()
                raise
            # the read normally came back with the fence; one its master does not answer in time
            # (failing over) is the error its caller falls back from
            done, _ = await asyncio.wait([reading], timeout=READ_GRACE_S)
            if not done:
                reading.cancel()
                return reply, RedisTimeoutError(f"no reply to GET {read_key} within {READ_GRACE_S} s of the fence's")
            return reply, reading.result()
        script = self.scripts[spec.name]
        started = perf_counter()
        (reply, value), confirmations, nodes = await self._execute_many(
            [("EVALSHA", script.sha, len(key_list), *key_list, *spec.arg_list(args, args_rest)), ("GET", read_key)],
            [key_list] if self._confirms([spec.name]) else None)
        if self.observe is not None:
            self.observe(spec.name, perf_counter() - started)
        if isinstance(reply, NoScriptError) or (isinstance(reply, ResponseError) and "NOSCRIPT" in str(reply)):
            return await self.call(spec.name, key_list, spec.arg_list(args, args_rest)), value
        reply = self.check(reply)
        if nodes and (refusal := confirmation_refused(self.redis, self.durability, confirmations, nodes,
                                                      [key_list])) is not None:
            raise refusal
        return reply, value

    async def _read_or_error(self, key: str) -> Any:
        try:
            return await self.redis.get(key)
        except REDIS_FAILURES as exc:
            return exc

    async def call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        if self._confirms([name]):
            return self.check((await self._run_calls([(name, keys, args)]))[0])
        if self.sharded:
            await self.register_totals([(name, keys)])
        started = perf_counter()
        try:
            if self.link is None:
                return await self.scripts[name](keys=keys, args=args)
            command = ("EVALSHA", self.scripts[name].sha, len(keys), *keys, *args)
            try:
                return await self.link.execute(*command)
            except NoScriptError:
                await self._load(name)
                return await self.link.execute(*command)
        except ResponseError as exc:
            mapped = translate(exc)
            if mapped is not None:
                raise mapped from None
            raise
        finally:
            if self.observe is not None:
                self.observe(name, perf_counter() - started)

    @staticmethod
    def check(result: Any) -> Any:
        """For pipeline results (raise_on_error=False): raise a fence's coded error."""
        if isinstance(result, ResponseError):
            mapped = translate(result)
            raise mapped if mapped is not None else result
        if isinstance(result, Exception):  # a FenceMQError, or a lost connection a pipeline handed back
            raise result
        return result
