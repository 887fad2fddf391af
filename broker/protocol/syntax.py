"""A verb's syntax line, read once: its arity and Redis's argument docs come from it.

The command table (fencemq.protocol.commands) writes each verb's arguments the
way docs/protocol.md does — ``handle [COUNT count] [BLOCK ms]`` — and this
module turns that line into what ``COMMAND INFO`` and ``COMMAND DOCS`` answer
(Redis 7's shapes: the arity, and the argument maps redis-cli builds its hints
from). The grammar:

- an UPPER-CASE word (or one starting with a digit) is a token typed as is;
  a lower-case word is an argument (an integer when its name says so);
- ``[…]`` is optional, ``(a | b)`` one of several, ``a|b`` one of several
  words, ``…`` after a word or a bracket repeats it.

No I/O; a malformed line fails when the table is built (at import).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from fencemq.protocol.resp import SimpleString

INTEGER_NAMES = frozenset({"count", "ms", "epoch", "capacity", "protover", "index", "id", "n", "max"})
_TOKENS = re.compile(r"\[|\]|\(|\)|\.\.\.|\||[^\s\[\]()|.]+(?:\|[^\s\[\]()|.]+)*|\S")


@dataclass(slots=True)
class Arg:
    """One node of a syntax line: a word, a token, a block or a choice."""

    kind: str  # "arg", "token", "block", "oneof"
    name: str = ""
    optional: bool = False
    multiple: bool = False
    parts: list[Arg] = field(default_factory=list)

    def min_words(self) -> int:
        if self.optional:
            return 0
        if self.kind == "block":
            return sum(p.min_words() for p in self.parts)
        if self.kind == "oneof":
            return min(p.min_words() for p in self.parts)
        return 1

    def fixed(self) -> bool:
        if self.optional or self.multiple:
            return False
        if self.kind == "block":
            return all(p.fixed() for p in self.parts)
        if self.kind == "oneof":
            return len({p.min_words() for p in self.parts}) == 1 and all(p.fixed() for p in self.parts)
        return True

    def doc(self) -> dict[str, Any]:
        """Redis 7's argument map (COMMAND DOCS)."""
        out: dict[str, Any] = {}
        if self.kind == "token":
            out = {"name": self.name.lower(), "type": "pure-token", "token": self.name}
        elif self.kind == "arg":
            out = {"name": self.name, "type": "integer" if self.name in INTEGER_NAMES else "string"}
        else:
            # "QOS 0|1", "LOCK ms": a token that introduces one value is that value's token
            if self.kind == "block" and len(self.parts) == 2 and self.parts[0].kind == "token" \
                    and not self.parts[0].optional and self.parts[1].kind in ("arg", "oneof") \
                    and not self.parts[1].optional:
                out = self.parts[1].doc()
                if self.parts[1].kind == "oneof":
                    out["name"] = self.parts[0].name.lower()
                out["token"] = self.parts[0].name
                if self.parts[1].multiple:
                    out["flags"] = ["multiple"]
            elif self.kind == "block" and len(self.parts) == 1:
                out = self.parts[0].doc()
            else:
                out = {"name": self.name or "_".join(p.name.lower() for p in self.parts if p.name)[:32] or self.kind,
                       "type": self.kind, "arguments": [p.doc() for p in self.parts]}
        flags = list(out.get("flags", []))
        if self.optional:
            flags.append("optional")
        if self.multiple and "multiple" not in flags:
            flags.append("multiple")
        if flags:
            out["flags"] = [SimpleString(f) for f in flags]  # status replies, as redis-cli insists
        return out


def parse_syntax(line: str) -> list[Arg]:
    """The top-level arguments of a syntax line."""
    words = _TOKENS.findall(line)
    pos = 0

    def sequence(closing: str | None) -> list[Arg]:
        nonlocal pos
        alternatives: list[list[Arg]] = [[]]
        while pos < len(words) and words[pos] != closing:
            w = words[pos]
            pos += 1
            if w in ("[", "("):
                inner = sequence("]" if w == "[" else ")")
                if pos >= len(words):
                    raise ValueError(f"unclosed {w} in {line!r}")
                pos += 1
                node = _group(inner)
                node.optional = w == "["
            elif w == "|":
                alternatives.append([])
                continue
            elif w == "...":
                if not alternatives[-1]:
                    raise ValueError(f"nothing to repeat in {line!r}")
                alternatives[-1][-1].multiple = True
                continue
            elif w in ("]", ")"):
                raise ValueError(f"unbalanced {w} in {line!r}")
            elif "|" in w:
                node = Arg("oneof", parts=[_word(x) for x in w.split("|")])
                for p in node.parts:
                    p.kind = "token"
            else:
                node = _word(w)
            alternatives[-1].append(node)
        if len(alternatives) == 1:
            return alternatives[0]
        return [Arg("oneof", parts=[_group(a) for a in alternatives])]

    args = sequence(None)
    if pos != len(words):
        raise ValueError(f"unbalanced brackets in {line!r}")
    return args


def _word(w: str) -> Arg:
    return Arg("arg", name=w) if w[0].islower() else Arg("token", name=w)


def _group(parts: list[Arg]) -> Arg:
    if len(parts) == 1 and parts[0].kind in ("oneof", "block"):
        return parts[0]
    return Arg("block", parts=parts)


def arity(args: list[Arg]) -> int:
    """Redis's arity: the verb and its words; negative when that is only the minimum."""
    n = 1 + sum(a.min_words() for a in args)
    return n if all(a.fixed() for a in args) else -n
