"""What COMMAND, COMMAND INFO and COMMAND DOCS answer, from the command table.

Redis 7's shapes, so that redis-cli shows argument hints for FenceMQ's verbs
and client libraries that ask the server what it speaks get an answer. No
I/O; the verbs (fencemq.server.verbs) hand these replies to the client.
"""

from __future__ import annotations

from typing import Any

from fencemq.protocol.commands import COMMANDS
from fencemq.protocol.resp import SimpleString


def known(names: list[bytes]) -> list[str | None]:
    """The table's spelling of each name asked for (None for one it does not have)."""
    out: list[str | None] = []
    for raw in names:
        verb = raw.decode("utf-8", "replace").upper()
        out.append(verb if verb in COMMANDS else None)
    return out


def command_info(verb: str | None) -> Any:
    """COMMAND INFO's entry: name, arity, flags, first/last key and step (no keys), categories, tips, key specs."""
    if verb is None:
        return None
    c = COMMANDS[verb]
    return [verb.lower(), c.arity, [SimpleString(f) for f in c.flags], 0, 0, 0,
            [SimpleString("@" + c.group)], [], [], []]


def command_docs(verbs: list[str], since: str) -> dict[str, Any]:
    """COMMAND DOCS: name -> summary, since, group, complexity, arguments (a map; a flat array in RESP2)."""
    out: dict[str, Any] = {}
    for verb in verbs:
        c = COMMANDS[verb]
        doc: dict[str, Any] = {"summary": c.summary, "since": since, "group": c.group,
                               "complexity": "O(1) per argument"}
        if c.arguments:
            doc["arguments"] = [a.doc() for a in c.arguments]
        out[verb.lower()] = doc
    return out
