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
from fencemq.model.topics import check_share_syntax


@dataclass(slots=True)
class Request:
    verb: str
    args: dict[str, Any] = field(default_factory=dict)

    def batch_key(self) -> tuple[Any, ...] | None:
        """Requests with the same key, pipelined back to back, run as one fence call."""
        plain = not (self.args.get("dedup_ids") or self.args.get("headers") or self.args.get("retain"))
        if self.verb in ("PUB", "MPUB") and plain:
            return ("PUB", self.args["topic"], self.args.get("lmq"), self.args.get("qos", 1))
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


def _need(verb: str, args: list[bytes], n: int, usage: str) -> None:
    if len(args) < n:
        raise FenceMQError(f"wrong number of arguments for '{verb}'; usage: {usage}")


def _tags_and_options(verb: str, args: list[bytes], keywords: set[str]) -> tuple[list[str], list[bytes]]:
    """Split `handle tag... [OPTION value]...`: tags end at the first keyword."""
    i = 2
    while i < len(args) and args[i].decode("utf-8", "replace").upper() not in keywords:
        i += 1
    return [_text(t, "tag") for t in args[2:i]], args[i:]


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
        else:
            raise opts.unknown(word, "AUTH user pass, SETNAME id")
    return Request("HELLO", out)


def parse_pub(args: list[bytes]) -> Request:
    _need("PUB", args, 3, "PUB topic payload [LMQ name] [QOS 0|1] [RETAIN] [ID id] [HDR k v]...")
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
        else:
            raise opts.unknown(word, "LMQ, QOS, RETAIN, ID, HDR")
    if headers:
        out["headers"] = headers
    return Request("PUB", out)


def parse_mpub(args: list[bytes]) -> Request:
    _need("MPUB", args, 4, "MPUB topic n payload1 ... payloadN [LMQ name] [QOS 0|1]")
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
        else:
            raise opts.unknown(word, "LMQ, QOS")
    return Request("MPUB", out)


def parse_sub(args: list[bytes]) -> Request:
    _need("SUB", args, 2, "SUB topic [LMQ name] [GROUP g] [MODE m] [POLICY p] [FROM ...] [QOS q] [LOCK ms] [PUSH [CAPACITY n]] [MAX n] [EPOCH e]")
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


def _handle_verb(verb: str, usage: str, options: dict[str, tuple[str, int, int | None]]) -> Callable[[list[bytes]], Request]:
    """``VERB handle [OPTION n]…`` where each option takes one integer: OPTION -> (field, minimum, default)."""

    def parse(args: list[bytes]) -> Request:
        _need(verb, args, 2, usage)
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


parse_pull = _handle_verb("PULL", "PULL handle [COUNT n] [BLOCK ms]", {"COUNT": ("count", 1, 1), "BLOCK": ("block_ms", 0, None)})
parse_take = _handle_verb("TAKE", "TAKE handle [BLOCK ms]", {"BLOCK": ("block_ms", 0, None)})
parse_unsub = _handle_verb("UNSUB", "UNSUB handle [MAX n]", {"MAX": ("max_messages", 0, None)})


def parse_ack(args: list[bytes]) -> Request:
    _need("ACK", args, 3, "ACK handle tag [tag ...]")
    return Request("ACK", {"handle": _text(args[1], "handle"), "tags": [_text(t, "tag") for t in args[2:]]})


def parse_nack(args: list[bytes]) -> Request:
    _need("NACK", args, 3, "NACK handle tag [tag ...] [DELAY ms] [DISCARD]")
    tags, rest = _tags_and_options("NACK", args, {"DELAY", "DISCARD"})
    out: dict[str, Any] = {"handle": _text(args[1], "handle"), "tags": tags, "delay_ms": 0, "discard": False}
    opts = _Options("NACK", rest, 0)
    for word in opts:
        if word == "DELAY":
            out["delay_ms"] = _int(opts.value(word), "DELAY", 0)
        elif word == "DISCARD":
            out["discard"] = True
        else:
            raise opts.unknown(word, "DELAY, DISCARD")
    if not tags:
        raise BadArgument("NACK needs at least one delivery tag")
    return Request("NACK", out)


def parse_renew(args: list[bytes]) -> Request:
    _need("RENEW", args, 3, "RENEW handle tag [tag ...] [LOCK ms]")
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
    _need("SEEK", args, 3, "SEEK handle ID id | TIME ms | EARLIEST | LATEST")
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


def parse_simple(verb: str, low: int, high: int, usage: str) -> Callable[[list[bytes]], Request]:
    def parse(args: list[bytes]) -> Request:
        if not low <= len(args) - 1 <= high:
            raise FenceMQError(f"wrong number of arguments for '{verb.lower()}' command; usage: {usage}")
        return Request(verb, {"argv": [a for a in args[1:]]})

    return parse


TABLE: dict[str, Callable[[list[bytes]], Request]] = {
    "HELLO": parse_hello,
    "PING": parse_simple("PING", 0, 1, "PING [message]"),
    "QUIT": parse_simple("QUIT", 0, 0, "QUIT"),
    "AUTH": parse_simple("AUTH", 1, 2, "AUTH [user] password"),
    "CLIENT": parse_simple("CLIENT", 1, 8, "CLIENT SETNAME id | GETNAME | ID | SETINFO ..."),
    "COMMAND": parse_simple("COMMAND", 0, 8, "COMMAND"),
    "SELECT": parse_simple("SELECT", 1, 1, "SELECT 0"),
    "PUB": parse_pub,
    "MPUB": parse_mpub,
    "SUB": parse_sub,
    "PULL": parse_pull,
    "TAKE": parse_take,
    "ACK": parse_ack,
    "NACK": parse_nack,
    "RENEW": parse_renew,
    "SEEK": parse_seek,
    "UNSUB": parse_unsub,
    "HEARTBEAT": parse_heartbeat,
}


def parse(args: list[bytes]) -> Request:
    if not args:
        raise BadArgument("empty command")
    verb = args[0].decode("utf-8", "replace").upper()
    parser = TABLE.get(verb)
    if parser is None:
        shown = args[0][:64].decode("utf-8", "replace")
        raise UnknownCommand(f"unknown command '{shown}'; FenceMQ speaks {', '.join(sorted(TABLE))}")
    return parser(args)
