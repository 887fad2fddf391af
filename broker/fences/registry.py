"""The fence registry: the Lua fences, their headers, and the one spec of each.

A fence is one file ``lua/<name>.lua``: one atomic operation. Its header (the
comment lines at its top) documents it in a fixed form, one line each::

    -- KEYS[1] meta           the queue's meta hash
    -- KEYS[9..] mailboxes    (a variadic tail: every key from 9 on)
    -- ARGV[1] group
    -- Returns: …
    -- Errors: …

and may pull helpers in with ``--@include lib/<name>.lua``. Every fence
declares how Redis may run it when memory is short, ``--@flags allow-oom``
(it runs at ``maxmemory`` too: it consumes, and what it adds is bounded;
docs/operations.md, "Redis memory"), ``--@flags no-writes`` (it only reads)
or ``--@flags none`` (Redis refuses it whole, before it writes anything,
while its memory is over ``maxmemory``); the loader turns that line into the
script's ``#!lua`` shebang. The loader
(:func:`sources`) expands the includes (each file once, in the order first
asked for; an include that is missing, repeated in one file or circular is
refused with its file and line) and then binds the header's names, so the
fence body reads ``K.meta`` and ``A.group`` rather than ``KEYS[1]`` and
``ARGV[1]``: a variadic tail becomes a list (``K.mailboxes``, ``A.tags``).

The Python side builds a call from a :class:`FenceSpec` holding the same
names (tests/fences/test_headers.py holds every header to its spec and every
``raise('CODE', …)`` to the error table). Each fence is wrapped in a redis-py
``Script``: it runs by EVALSHA and, after a restart or SCRIPT FLUSH answers
NOSCRIPT, is loaded again transparently — clients never see it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
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
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.fences.redis_link import RedisLink
from fencemq.model.keys import key_slot, slot_totals_registry

READ_GRACE_S = 0.2  # run_reading on a Cluster: how long the read may lag the fence before it counts as failed
_INCLUDE = re.compile(r"^--@include[ \t]+(\S+)[ \t]*$")
_SLOT = re.compile(r"\b(KEYS|ARGV)\[(\d+)(\.\.)?\][ \t]+([A-Za-z_][A-Za-z0-9_]*)")
_SECTION = re.compile(r"^--[ \t]*(Returns|Errors):")
_FLAGS = re.compile(r"^--@flags(?:[ \t]+(.*?))?[ \t]*$")
# Redis 7 script flags a fence may declare (``#!lua flags=…``): the memory rule, and read-only fences.
SCRIPT_FLAGS = frozenset({"allow-oom", "no-writes"})


class LoadError(RuntimeError):
    """A fence or include that cannot be assembled (a bug in lua/, found at load time)."""


@dataclass(frozen=True, slots=True)
class Header:
    """What a fence's header declares: KEYS and ARGV by name, and which sections it has."""

    keys: tuple[str, ...]
    keys_rest: str | None
    argv: tuple[str, ...]
    argv_rest: str | None
    sections: frozenset[str]
    flags: tuple[str, ...] | None = None  # its ``--@flags`` line; None: it has none (the loader refuses that)


def _slots(found: list[tuple[int, bool, str]], where: str, what: str) -> tuple[tuple[str, ...], str | None]:
    fixed: list[str] = []
    rest = None
    for n, (index, variadic, name) in enumerate(sorted(found), start=1):
        if index != n:
            raise LoadError(f"{where}: {what}[{index}] {name} is out of sequence (expected {what}[{n}])")
        if rest is not None:
            raise LoadError(f"{where}: {what}[{index}] {name} follows the variadic {what} tail {rest}")
        if variadic:
            rest = name
        else:
            fixed.append(name)
    return tuple(fixed), rest


def parse_header(source: str, where: str = "?") -> Header:
    """The header of a fence's own source (before includes are expanded)."""
    keys: list[tuple[int, bool, str]] = []
    argv: list[tuple[int, bool, str]] = []
    sections = set()
    flags: tuple[str, ...] | None = None
    for line in source.splitlines():
        if not line.startswith("--"):
            break
        if m := _FLAGS.match(line):
            if flags is not None:
                raise LoadError(f"{where}: a second --@flags line")
            flags = tuple(f for f in (m.group(1) or "").replace(",", " ").split())
            if flags == ("none",):
                flags = ()
            unknown = sorted(set(flags) - SCRIPT_FLAGS)
            if unknown:
                raise LoadError(f"{where}: --@flags {' '.join(unknown)} is not one of {sorted(SCRIPT_FLAGS)}")
            continue
        for kind, index, variadic, name in _SLOT.findall(line):
            (keys if kind == "KEYS" else argv).append((int(index), bool(variadic), name))
        if m := _SECTION.match(line):
            sections.add(m.group(1))
    k, k_rest = _slots(keys, where, "KEYS")
    a, a_rest = _slots(argv, where, "ARGV")
    return Header(k, k_rest, a, a_rest, frozenset(sections), flags)


def _raw_files() -> dict[str, str]:
    root = resources.files("fencemq.lua")
    files = {p.name: p.read_text(encoding="utf-8") for p in root.iterdir() if p.name.endswith(".lua")}
    lib = root / "lib"
    if lib.is_dir():
        files.update({f"lib/{p.name}": p.read_text(encoding="utf-8") for p in lib.iterdir() if p.name.endswith(".lua")})
    return files


def _bind(header: Header) -> str:
    """Lua binding the header's names: ``local K = {meta = KEYS[1], …}`` and ``local A``."""

    def table(kind: str, fixed: tuple[str, ...], rest: str | None) -> str:
        parts = [f"{name} = {kind}[{i}]" for i, name in enumerate(fixed, start=1)]
        if rest is not None:
            parts.append(f"{rest} = {{unpack({kind}, {len(fixed) + 1})}}")
        return "{" + ", ".join(parts) + "}"

    return (f"local K = {table('KEYS', header.keys, header.keys_rest)}\n"
            f"local A = {table('ARGV', header.argv, header.argv_rest)}\n")


def shebang(header: Header) -> str:
    """The ``#!lua`` line a fence's ``--@flags`` declares (Redis 7 reads a script's flags from it)."""
    return "#!lua" + (f" flags={','.join(header.flags)}" if header.flags else "")


def assemble(name: str, files: Mapping[str, str]) -> str:
    """A fence's full source: its shebang, its includes (each once), the K/A binding, then its body."""
    included: list[str] = []
    chunks: list[str] = []

    def expand(file: str, chain: tuple[str, ...]) -> str:
        asked: dict[str, int] = {}
        body: list[str] = []
        for lineno, line in enumerate(files[file].splitlines(), start=1):
            if _FLAGS.match(line):
                if file.startswith("lib/"):
                    raise LoadError(f"lua/{file}:{lineno}: --@flags belongs to a fence, not an include")
                continue
            m = _INCLUDE.match(line)
            if m is None:
                body.append(line)
                continue
            target = m.group(1)
            where = f"lua/{file}:{lineno}"
            if target in asked:
                raise LoadError(f"{where} includes {target} again (first at line {asked[target]})")
            asked[target] = lineno
            if target not in files or not target.startswith("lib/"):
                raise LoadError(f"{where} includes {target}, which is not a file in lua/lib/")
            if target in chain:
                raise LoadError(f"{where}: include cycle {' -> '.join((*chain, target))}")
            if target not in included:
                included.append(target)
                chunks.append(f"-- from {target}\n" + expand(target, (*chain, target)))
        return "\n".join(body)

    header = parse_header(files[f"{name}.lua"], f"lua/{name}.lua")
    if header.flags is None:
        raise LoadError(f"lua/{name}.lua has no --@flags line (allow-oom, no-writes, or none: docs/operations.md, "
                        "\"Redis memory\")")
    body = expand(f"{name}.lua", (f"{name}.lua",))
    return "\n".join([shebang(header), *_only_reached(chunks, body), _bind(header), body]) + "\n"


_FUNCTION = re.compile(r"^local function ([A-Za-z_]\w*)\s*\(")
_NAME = re.compile(r"\b[A-Za-z_]\w*\b")


def _only_reached(chunks: list[str], body: str) -> list[str]:
    """The includes without the helpers the fence never reaches.

    Lua runs a script's top level at every call, so each helper an include
    defines is a closure made (and collected) per call: ~1,000 instructions
    apiece, 90,000 for the whole library. A helper is a top-level ``local
    function`` (a one-liner, or a block up to the first line that is ``end``
    alone); it stays if the fence's body or a helper that stays names it.
    Everything else (constants, tables) stays. Locals cannot be looked up by
    a computed name, so a name the text never spells out is never called.
    """
    blocks: list[tuple[str | None, list[str]]] = []  # (helper name or None, its lines)
    for chunk in chunks:
        lines = chunk.split("\n")
        file = lines[0].removeprefix("-- from ")  # each chunk starts by naming its include
        i = 0
        while i < len(lines):
            m = _FUNCTION.match(lines[i])
            if m is None or lines[i].rstrip().endswith(" end"):
                blocks.append((m.group(1) if m else None, [lines[i]]))
                i += 1
                continue
            end = next((j for j in range(i + 1, len(lines)) if lines[j] == "end"), None)
            if end is None or any(_FUNCTION.match(x) for x in lines[i + 1:end]):
                raise LoadError(f"lua/{file}: local function {m.group(1)} has no line 'end' of its own to close it")
            blocks.append((m.group(1), lines[i:end + 1]))
            i = end + 1
        blocks.append((None, [_CHUNK_END]))

    def names(lines: list[str]) -> set[str]:
        return set(_NAME.findall("\n".join(x for x in lines if not x.lstrip().startswith("--"))))

    reached = names(body.split("\n"))
    for helper, lines in blocks:
        if helper is None:
            reached |= names(lines)
    kept: set[str] = set()
    grew = True
    while grew:
        grew = False
        for helper, lines in blocks:
            if helper is not None and helper in reached and helper not in kept:
                kept.add(helper)
                reached |= names(lines)
                grew = True
    out, current = [], []
    for helper, lines in blocks:
        if lines == [_CHUNK_END]:
            out.append("\n".join(current))
            current = []
        elif helper is None or helper in kept:
            current += lines
    return out


_CHUNK_END = "\0chunk end"


@cache
def sources() -> dict[str, str]:
    """Fence name -> its full Lua source, ready to load."""
    files = _raw_files()
    return {n[:-4]: assemble(n[:-4], files) for n in files if "/" not in n}


@cache
def headers() -> dict[str, Header]:
    return {n[:-4]: parse_header(src, f"lua/{n}") for n, src in _raw_files().items() if "/" not in n}


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
