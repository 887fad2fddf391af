"""The command table: turns a RESP argument list into a typed request.

No I/O here: the worker calls ``parse(args)`` and gets a ``Request`` (verb and
keyword arguments for the operation) or a BadArgument that says what to fix.
Keywords are case-insensitive, as in Redis; verbs and their arguments are the
public contract in docs/protocol.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from fencemq.errors import BadArgument, FenceMQError, UnknownCommand
from fencemq.model.messages import MAX_TTL_MS
from fencemq.model.topics import SHARE_PREFIX, check_share_syntax, has_wildcard
from fencemq.protocol.syntax import Arg, arity, parse_syntax


@dataclass(slots=True)
class Request:
    verb: str
    args: dict[str, Any] = field(default_factory=dict)

    def batch_key(self) -> tuple[Any, ...] | None:
        """Requests with the same key, pipelined back to back, run together: PUBs to one
        queue as one fence call, pull SUBs of one lite topic's lmqs in a few pipelines."""
        if self.verb in ("PUB", "MPUB"):
            # dedup ids go into the batch's fence call beside each message (an SDK gives every PUB one)
            plain = not (self.args.get("headers") or self.args.get("retain") or "delay_ms" in self.args
                         or "at_ms" in self.args or "ttl_ms" in self.args or "priority" in self.args)
            return ("PUB", self.args["topic"], self.args.get("lmq"), self.args.get("qos", 1)) if plain else None
        if self.verb == "SUB" and self.args.get("lmq") is not None and not self.args.get("push"):
            topic = self.args["topic"]
            if not (topic.startswith(SHARE_PREFIX) or has_wildcard(topic)):  # a filter takes no LMQ: BADARG alone
                return ("SUB-LMQ", topic)
        return None


def _text(b: bytes, what: str) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        raise BadArgument(f"{what} must be UTF-8") from None


# The largest integer every layer holds exactly (Lua numbers are doubles):
# the upper bound of every integer on the wire (docs/protocol.md, "Numbers").
MAX_INT = 2**53 - 1
_DECIMAL = re.compile(rb"-?[0-9]{1,20}")


def shown(b: bytes, limit: int = 32) -> str:
    """A client's argument quoted in an error: bounded, printable, no Python repr."""
    text = b[:limit].decode("utf-8", "replace")
    text = "".join(c if c.isprintable() else "?" for c in text)
    return f"'{text}'" + ("…" if len(b) > limit else "")


def _int(b: bytes, what: str, low: int = 0, high: int = MAX_INT) -> int:
    """A decimal integer in [low, high] (no sign but '-', no spaces, no '_'), else BADARG."""
    if not _DECIMAL.fullmatch(b):
        raise BadArgument(f"{what} must be an integer from {low} to {high}, got {shown(b)}")
    n = int(b)
    if not low <= n <= high:
        raise BadArgument(f"{what} must be an integer from {low} to {high}")
    return n


class _Options:
    """Walks trailing KEYWORD [value...] options."""

    def __init__(self, verb: str, args: list[bytes], start: int) -> None:
        self.verb, self.args, self.i = verb, args, start

    def __iter__(self) -> "_Options":
        return self

    def __next__(self) -> str:
        if self.i >= len(self.args):
            raise StopIteration
        word = self.args[self.i].decode("utf-8", "replace").upper()
        self.i += 1
        return word

    def value(self, word: str) -> bytes:
        if self.i >= len(self.args):
            raise BadArgument(f"{self.verb} {word} needs a value")
        self.i += 1
        return self.args[self.i - 1]

    def unknown(self, word: str, allowed: str) -> BadArgument:
        return BadArgument(f"{self.verb} does not take {shown(word.encode())}; options are {allowed}")


def usage(verb: str) -> str:
    return f"{verb} {COMMANDS[verb].syntax}".strip()


def _need(verb: str, args: list[bytes], n: int) -> None:
    if len(args) < n:
        raise FenceMQError(f"wrong number of arguments for '{verb}'; usage: {usage(verb)}")


def _texts(items: list[bytes], what: str) -> list[str]:
    """Many arguments as text (the tags of an ACK): decoded in one go, item by item only when one
    of them holds the separator or is not UTF-8 (for the error that names it)."""
    try:
        texts = b"\n".join(items).decode("utf-8").split("\n")
    except UnicodeDecodeError:
        texts = []
    return texts if len(texts) == len(items) else [_text(t, what) for t in items]


def _tags_and_options(verb: str, args: list[bytes], keywords: set[str]) -> tuple[list[str], list[bytes]]:
    """Split `handle tag... [OPTION value]...`: tags end at the first keyword."""
    i = 2
    while i < len(args) and args[i].decode("utf-8", "replace").upper() not in keywords:
        i += 1
    return _texts(args[2:i], "tag"), args[i:]


def parse_hello(args: list[bytes]) -> Request:
    out: dict[str, Any] = {}
    i = 1
    if len(args) > 1 and args[1].isdigit():
        out["proto"] = _int(args[1], "protocol version", 2, 3)
        i = 2
    opts = _Options("HELLO", args, i)
    for word in opts:
        if word == "AUTH":
            out["username"] = _text(opts.value(word), "user")
            out["password"] = _text(opts.value(word), "password")
        elif word == "SETNAME":
            out["client_id"] = _text(opts.value(word), "client id")
        elif word == "TAKEOVER":
            out["takeover"] = True
        else:
            raise opts.unknown(word, "AUTH user pass, SETNAME id, TAKEOVER")
    return Request("HELLO", out)


def parse_pub(args: list[bytes]) -> Request:
    _need("PUB", args, 3)
    out: dict[str, Any] = {"topic": _text(args[1], "topic"), "payloads": [args[2]]}
    headers: dict[str, str] = {}
    opts = _Options("PUB", args, 3)
    for word in opts:
        if word == "LMQ":
            out["lmq"] = _text(opts.value(word), "lmq")
        elif word == "QOS":
            out["qos"] = _int(opts.value(word), "QOS", 0, 1)
        elif word == "RETAIN":
            out["retain"] = True
        elif word == "ID":
            out["dedup_ids"] = [_text(opts.value(word), "dedup id")]
        elif word == "HDR":
            k = _text(opts.value(word), "header name")
            headers[k] = _text(opts.value(word), "header value")
        elif word in ("DELAY", "AT"):
            _when(out, word, opts.value(word))
        elif word == "TTL":
            out["ttl_ms"] = _int(opts.value(word), "TTL", 1, MAX_TTL_MS)
        elif word == "PRIORITY":
            out["priority"] = _int(opts.value(word), "PRIORITY", 0, 9)
        else:
            raise opts.unknown(word, "LMQ, QOS, RETAIN, ID, HDR, DELAY, AT, TTL, PRIORITY")
    if headers:
        out["headers"] = headers
    return Request("PUB", out)


def parse_mpub(args: list[bytes]) -> Request:
    _need("MPUB", args, 4)
    n = _int(args[2], "MPUB count", 1)
    if len(args) < 3 + n:
        raise BadArgument(f"MPUB declares {n} payloads but carries {len(args) - 3}")
    out: dict[str, Any] = {"topic": _text(args[1], "topic"), "payloads": list(args[3 : 3 + n])}
    opts = _Options("MPUB", args, 3 + n)
    for word in opts:
        if word == "LMQ":
            out["lmq"] = _text(opts.value(word), "lmq")
        elif word == "QOS":
            out["qos"] = _int(opts.value(word), "QOS", 0, 1)
        elif word == "ID":
            # one dedup id for the whole batch: a repeat within the window stores none of it
            out["dedup_ids"] = [_text(opts.value(word), "dedup id"), *[None] * (n - 1)]
        elif word in ("DELAY", "AT"):
            _when(out, word, opts.value(word))
        elif word == "TTL":
            out["ttl_ms"] = _int(opts.value(word), "TTL", 1, MAX_TTL_MS)
        elif word == "PRIORITY":
            out["priority"] = _int(opts.value(word), "PRIORITY", 0, 9)
        else:
            raise opts.unknown(word, "LMQ, QOS, ID, DELAY, AT, TTL, PRIORITY")
    return Request("MPUB", out)


def _when(out: dict[str, Any], word: str, value: bytes) -> None:
    """``DELAY ms`` or ``AT unix-ms``: a publish for later (one of them)."""
    if "delay_ms" in out or "at_ms" in out:
        raise BadArgument("give DELAY or AT once, not both")
    if word == "DELAY":
        out["delay_ms"] = _int(value, "DELAY")
    else:
        out["at_ms"] = _int(value, "AT")


def parse_unpub(args: list[bytes]) -> Request:
    _need("UNPUB", args, 3)
    out: dict[str, Any] = {"topic": _text(args[1], "topic")}
    ids: list[str] = []
    i = 2
    while i < len(args):
        if args[i].upper() == b"LMQ":
            if i + 1 >= len(args):
                raise BadArgument(f"LMQ needs a value; usage: UNPUB {COMMANDS['UNPUB'].syntax}")
            out["lmq"] = _text(args[i + 1], "lmq")
            i += 2
            continue
        ids.append(_text(args[i], "schedule id"))
        i += 1
    if not ids:
        raise BadArgument("give at least one schedule id to cancel")
    out["ids"] = ids
    return Request("UNPUB", out)


def parse_sub(args: list[bytes]) -> Request:
    _need("SUB", args, 2)
    out: dict[str, Any] = {"topic": _text(args[1], "topic")}
    check_share_syntax(out["topic"])
    opts = _Options("SUB", args, 2)
    for word in opts:
        if word in ("LMQ", "GROUP", "MODE", "POLICY"):
            value = _text(opts.value(word), word.lower())
            out[word.lower()] = value.lower() if word in ("MODE", "POLICY") else value
        elif word == "FROM":
            kind = opts.value(word).decode("utf-8", "replace").lower()
            if kind in ("earliest", "latest"):
                out["start"] = (kind, None)
            elif kind in ("id", "time"):
                out["start"] = (kind, _int(opts.value(word), f"FROM {kind.upper()}", 0))
            else:
                raise BadArgument("FROM takes EARLIEST, LATEST, ID id or TIME ms")
        elif word == "QOS":
            out["qos"] = _int(opts.value(word), "QOS", 0, 1)
        elif word == "LOCK":
            out["lock_ms"] = _int(opts.value(word), "LOCK", 1)
        elif word == "PUSH":
            out["push"] = True
        elif word == "CAPACITY":
            out["capacity"] = _int(opts.value(word), "CAPACITY", 1)
        elif word == "MAX":
            out["max_messages"] = _int(opts.value(word), "MAX", 0)
        elif word == "EPOCH":
            out["epoch"] = _int(opts.value(word), "EPOCH", 0)
        elif word == "ON-PREEMPT":
            out["on_preempt"] = _text(opts.value(word), "ON-PREEMPT").lower()
        elif word == "STRATEGY":
            out["strategy"] = _text(opts.value(word), "STRATEGY").lower()
        elif word == "SKIP-OFFLINE":
            out["offline"] = "skip"
        elif word == "QUEUE-OFFLINE":
            out["offline"] = "queue"
        else:
            raise opts.unknown(
                word, "LMQ, GROUP, MODE, POLICY, FROM, QOS, LOCK, PUSH, CAPACITY, MAX, EPOCH, ON-PREEMPT, STRATEGY, QUEUE-OFFLINE, SKIP-OFFLINE"
            )
    if "capacity" in out and not out.get("push"):
        raise BadArgument("CAPACITY goes with PUSH")
    return Request("SUB", out)


def _handle_verb(verb: str, options: dict[str, tuple[str, int, int | None]]) -> Callable[[list[bytes]], Request]:
    """``VERB handle [OPTION n]…`` where each option takes one integer: OPTION -> (field, minimum, default)."""

    def parse(args: list[bytes]) -> Request:
        _need(verb, args, 2)
        out: dict[str, Any] = {"handle": _text(args[1], "handle")}
        out.update({field: default for field, _, default in options.values()})
        opts = _Options(verb, args, 2)
        for word in opts:
            if word not in options:
                raise opts.unknown(word, ", ".join(options))
            field, low, _ = options[word]
            out[field] = _int(opts.value(word), word, low)
        return Request(verb, out)

    return parse


parse_pull = _handle_verb("PULL", {"COUNT": ("count", 1, 1), "BLOCK": ("block_ms", 0, None)})
parse_take = _handle_verb("TAKE", {"BLOCK": ("block_ms", 0, None)})
parse_unsub = _handle_verb("UNSUB", {"MAX": ("max_messages", 0, None)})


def parse_ack(args: list[bytes]) -> Request:
    _need("ACK", args, 3)
    return Request("ACK", {"handle": _text(args[1], "handle"), "tags": _texts(args[2:], "tag")})


def parse_nack(args: list[bytes]) -> Request:
    _need("NACK", args, 3)
    tags, rest = _tags_and_options("NACK", args, {"DELAY", "DISCARD", "RELEASE"})
    out: dict[str, Any] = {"handle": _text(args[1], "handle"), "tags": tags, "delay_ms": 0, "discard": False,
                           "release": False}
    opts = _Options("NACK", rest, 0)
    for word in opts:
        if word == "DELAY":
            out["delay_ms"] = _int(opts.value(word), "DELAY", 0)
        elif word == "DISCARD":
            out["discard"] = True
        elif word == "RELEASE":
            out["release"] = True
        else:
            raise opts.unknown(word, "DELAY, DISCARD, RELEASE")
    if out["discard"] and out["release"]:
        raise BadArgument("NACK takes DISCARD or RELEASE, not both")
    if not tags:
        raise BadArgument("NACK needs at least one delivery tag")
    return Request("NACK", out)


def parse_renew(args: list[bytes]) -> Request:
    _need("RENEW", args, 3)
    tags, rest = _tags_and_options("RENEW", args, {"LOCK"})
    out: dict[str, Any] = {"handle": _text(args[1], "handle"), "tags": tags, "lock_ms": None}
    opts = _Options("RENEW", rest, 0)
    for word in opts:
        if word == "LOCK":
            out["lock_ms"] = _int(opts.value(word), "LOCK", 1)
        else:
            raise opts.unknown(word, "LOCK")
    if not tags:
        raise BadArgument("RENEW needs at least one delivery tag")
    return Request("RENEW", out)


def parse_seek(args: list[bytes]) -> Request:
    _need("SEEK", args, 3)
    word = args[2].decode("utf-8", "replace").upper()
    out: dict[str, Any] = {"handle": _text(args[1], "handle")}
    if word in ("EARLIEST", "LATEST") and len(args) == 3:
        out.update(kind=word.lower(), arg=None)
    elif word in ("ID", "TIME") and len(args) == 4:
        out.update(kind=word.lower(), arg=_int(args[3], f"SEEK {word}", 0))
    else:
        raise BadArgument("SEEK takes ID id, TIME ms, EARLIEST or LATEST")
    return Request("SEEK", out)


def parse_heartbeat(args: list[bytes]) -> Request:
    if len(args) == 1:
        return Request("HEARTBEAT", {"sync": None})
    if args[1].upper() != b"SYNC" or len(args) < 4:
        raise BadArgument("HEARTBEAT takes no argument, or SYNC topic group lmq...")
    lmqs = [_text(a, "lmq") for a in args[4:]]
    return Request("HEARTBEAT", {"sync": (_text(args[2], "topic"), _text(args[3], "group"), lmqs)})


def parse_simple(verb: str, low: int, high: int) -> Callable[[list[bytes]], Request]:
    """Verbs whose handler takes the raw arguments: between low and high of them."""

    def parse(args: list[bytes]) -> Request:
        if not low <= len(args) - 1 <= high:
            raise FenceMQError(f"wrong number of arguments for '{verb.lower()}' command; usage: {usage(verb)}")
        return Request(verb, {"argv": [a for a in args[1:]]})

    return parse


@dataclass(frozen=True, slots=True)
class Command:
    """One verb: how to parse it, and how COMMAND INFO/DOCS and errors describe it."""

    parse: Callable[[list[bytes]], Request]
    syntax: str  # the arguments as docs/protocol.md writes them (grammar: fencemq.protocol.syntax)
    summary: str
    group: str = "fencemq"
    flags: tuple[str, ...] = ()
    arguments: list[Arg] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", parse_syntax(self.syntax))

    @property
    def arity(self) -> int:
        return arity(self.arguments)


def _c(parse: Callable[[list[bytes]], Request], syntax: str, summary: str, group: str = "fencemq",
       *flags: str) -> Command:
    return Command(parse, syntax, summary, group, flags)


COMMANDS: dict[str, Command] = {
    "HELLO": _c(parse_hello, "[protover] [AUTH username password] [SETNAME client-id] [TAKEOVER]",
                "Handshake: protocol version, authentication, the session's client id (TAKEOVER: from "
                "its other connections)", "connection", "noscript", "loading", "stale", "fast"),
    "PING": _c(parse_simple("PING", 0, 1), "[message]", "Ping the worker", "connection", "fast"),
    "ECHO": _c(parse_simple("ECHO", 1, 1), "message", "Echo the message", "connection", "fast"),
    "QUIT": _c(parse_simple("QUIT", 0, 0), "", "End the session and close the connection", "connection", "fast"),
    "RESET": _c(parse_simple("RESET", 0, 0), "",
                "Reset the connection: no transaction, RESP2, no session (a named one is left to its lease)",
                "connection", "fast"),
    "AUTH": _c(parse_simple("AUTH", 1, 2), "[username] password", "Authenticate the connection", "connection",
               "noscript", "loading", "stale", "fast"),
    "SELECT": _c(parse_simple("SELECT", 1, 1), "index", "Select database 0, the only one", "connection", "fast"),
    "CLIENT": _c(parse_simple("CLIENT", 1, 8),
                 "(SETNAME client-id | GETNAME | ID | INFO | LIST | SETINFO attr value | TAKEOVER "
                 "| NO-EVICT ON|OFF | NO-TOUCH ON|OFF | DELIVERIES MAP|FLAT)",
                 "Name the session, describe this connection, take the session over, shape its deliveries",
                 "connection"),
    "COMMAND": _c(parse_simple("COMMAND", 0, 64), "[(COUNT | LIST | INFO [command...] | DOCS [command...])]",
                  "Describe FenceMQ's verbs", "server", "loading", "stale"),
    "INFO": _c(parse_simple("INFO", 0, 16), "[section...]",
               "The worker's information and statistics (server, clients, stats, persistence, keyspace)",
               "server", "loading", "stale"),
    "MULTI": _c(parse_simple("MULTI", 0, 0), "", "Start a transaction: what follows is queued until EXEC",
                "transactions", "fast"),
    "EXEC": _c(parse_simple("EXEC", 0, 0), "", "Run the queued commands in order; their replies as an array",
               "transactions"),
    "DISCARD": _c(parse_simple("DISCARD", 0, 0), "", "Drop the queued commands", "transactions", "fast"),
    "PUB": _c(parse_pub, "topic payload [LMQ lmq] [QOS 0|1] [RETAIN] [ID dedup-id] [HDR name value]... "
                         "[(DELAY ms | AT unix-ms)] [TTL ms] [PRIORITY p]",
              "Publish a message (DELAY/AT: for later; TTL: settled unsent once expired; PRIORITY 0-9: on a "
              "priority queue); its id (a schedule id when for later)", "fencemq", "write"),
    "MPUB": _c(parse_mpub, "topic n payload... [LMQ lmq] [QOS 0|1] [ID dedup-id] [(DELAY ms | AT unix-ms)] "
                           "[TTL ms] [PRIORITY p]",
               "Publish n messages in one fence call; their ids", "fencemq", "write"),
    "UNPUB": _c(parse_unpub, "topic id... [LMQ lmq]",
                "Cancel scheduled messages by schedule id; how many were still waiting", "fencemq", "write"),
    "SUB": _c(parse_sub, "target [LMQ lmq] [GROUP group] [MODE exclusive|shared|single-active] "
                         "[POLICY preempt|reject] [FROM (EARLIEST | LATEST | ID id | TIME ms)] [QOS 0|1] [LOCK ms] "
                         "[PUSH [CAPACITY capacity]] [MAX n] [EPOCH epoch] [ON-PREEMPT keep|earliest|latest] "
                         "[STRATEGY round-robin|sticky|hash] [(QUEUE-OFFLINE | SKIP-OFFLINE)]",
              "Subscribe; a handle, the mode, the epoch", "fencemq", "write"),
    "PULL": _c(parse_pull, "handle [COUNT count] [BLOCK ms]", "Check out up to count deliveries", "fencemq",
               "write", "blocking"),
    "TAKE": _c(parse_take, "handle [BLOCK ms]", "Take one delivery from a push mailbox (EOS at its end)",
               "fencemq", "write", "blocking"),
    "ACK": _c(parse_ack, "handle tag...", "Settle checkouts", "fencemq", "write", "fast"),
    "NACK": _c(parse_nack, "handle tag... [DELAY ms] [DISCARD | RELEASE]", "Return (or discard) checkouts", "fencemq",
               "write", "fast"),
    "RENEW": _c(parse_renew, "handle tag... [LOCK ms]", "Extend checkouts' leases", "fencemq", "write", "fast"),
    "SEEK": _c(parse_seek, "handle (ID id | TIME ms | EARLIEST | LATEST)",
               "Move the group's cursor; the new epoch", "fencemq", "write"),
    "UNSUB": _c(parse_unsub, "handle [MAX n]", "Leave a subscription, or end it after n deliveries", "fencemq",
                "write"),
    "HEARTBEAT": _c(parse_heartbeat, "[SYNC topic group [lmq...]]",
                    "Drain this session's notices (SYNC: resync its lite subscriptions first)", "fencemq", "write"),
}
TABLE: dict[str, Callable[[list[bytes]], Request]] = {verb: c.parse for verb, c in COMMANDS.items()}


def parse(args: list[bytes]) -> Request:
    if not args:
        raise BadArgument("empty command")
    verb = args[0].decode("utf-8", "replace").upper()
    parser = TABLE.get(verb)
    if parser is None:
        shown = args[0][:64].decode("utf-8", "replace")
        raise UnknownCommand(f"unknown command '{shown}'; FenceMQ speaks {', '.join(sorted(TABLE))}")
    return parser(args)
