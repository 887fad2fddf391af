"""The Lua fences' sources: each fence's file, its header, its includes, ready to load.

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

tests/fences/test_headers.py holds every header to its spec (broker/fences/registry.py) and every
``raise('CODE', …)`` to the error table.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources

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
