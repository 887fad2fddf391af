"""Every Lua fence is documented by its header, called by its spec, and fails only with codes in the error table.

The checks run over the real lua/ tree, and each one is also run against a
broken copy of one file, so a check that could not fail would show here.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import fencemq
from fencemq.errors import BY_CODE, TABLE, FenceMQError
from fencemq.fences.lua_sources import LoadError, _raw_files, assemble, parse_header, sources
from fencemq.fences.registry import SPECS, FenceSpec

LUA_BUILTINS = set(
    "pairs ipairs tonumber tostring type error pcall unpack select next assert setmetatable getmetatable rawget"
    " rawset string table math redis cmsgpack cjson bit struct KEYS ARGV K A".split())
LUA_KEYWORDS = set(
    "and break do else elseif end false for function if in local nil not or repeat return then true until while"
    .split())
RAISE = re.compile(r"raise\('([A-Z]+)'")


def all_specs() -> dict[str, FenceSpec]:
    """Every spec declared anywhere in the package (they register themselves when their module loads)."""
    for info in pkgutil.walk_packages(fencemq.__path__, "fencemq."):
        if info.name.startswith(("fencemq.fences.", "fencemq.ops.")):
            importlib.import_module(info.name)
    return dict(SPECS)


def fence_files(files: dict[str, str]) -> dict[str, str]:
    return {name[:-4]: src for name, src in files.items() if "/" not in name}


def header_problems(files: dict[str, str], specs: dict[str, FenceSpec]) -> list[str]:
    problems = []
    fences = fence_files(files)
    for name, src in sorted(fences.items()):
        try:
            header = parse_header(src, f"lua/{name}.lua")
        except LoadError as exc:
            problems.append(str(exc))
            continue
        if not header.keys and header.keys_rest is None:
            problems.append(f"lua/{name}.lua: no KEYS lines")
        if not header.argv and header.argv_rest is None and "-- ARGV: none" not in src:
            problems.append(f"lua/{name}.lua: no ARGV lines (say `-- ARGV: none` when it takes none)")
        for section in ("Returns", "Errors"):
            if section not in header.sections:
                problems.append(f"lua/{name}.lua: no `-- {section}:` line")
        spec = specs.get(name)
        if spec is None:
            problems.append(f"lua/{name}.lua has no FenceSpec")
            continue
        if (spec.keys, spec.keys_rest) != (header.keys, header.keys_rest):
            problems.append(f"lua/{name}.lua KEYS {header.keys} + {header.keys_rest} != spec {spec.keys} + "
                            f"{spec.keys_rest}")
        if (spec.argv, spec.argv_rest) != (header.argv, header.argv_rest):
            problems.append(f"lua/{name}.lua ARGV {header.argv} + {header.argv_rest} != spec {spec.argv} + "
                            f"{spec.argv_rest}")
    for name in specs:
        if name not in fences:
            problems.append(f"spec {name} has no lua/{name}.lua")
    return problems


def raise_problems(files: dict[str, str]) -> list[str]:
    return [f"lua/{name}: raise('{code}', …) is not in fencemq.errors.TABLE"
            for name, src in sorted(files.items()) for code in RAISE.findall(src) if code not in BY_CODE]


def _strip(src: str) -> str:
    src = re.sub(r"^#![^\n]*", "", src)  # the shebang (its script flags)
    src = re.sub(r"--[^\n]*", "", src)
    src = re.sub(r"'(\\.|[^'\\])*'", "''", src)
    return re.sub(r'"(\\.|[^"\\])*"', '""', src)


def undefined_names(files: dict[str, str]) -> list[str]:
    """Names a fence uses that neither it nor its includes define: a missing include fails only at run time."""
    problems = []
    for name in fence_files(files):
        code = _strip(assemble(name, files))
        defined = set(re.findall(r"\blocal\s+function\s+(\w+)", code))
        for m in re.finditer(r"\blocal\s+([\w\s,]+?)\s*(?:=|\n|$)", code):
            defined.update(n.strip() for n in m.group(1).split(",") if n.strip())
        for m in re.finditer(r"\bfunction\s*\w*\s*\(([^)]*)\)", code):
            defined.update(n.strip() for n in m.group(1).split(",") if n.strip())
        for m in re.finditer(r"\bfor\s+([\w\s,]+?)\s+(?:in|=)", code):
            defined.update(n.strip() for n in m.group(1).split(","))
        code = re.sub(r"([{,]\s*)[A-Za-z_]\w*(\s*=[^=])", r"\1\2", code)  # table constructor keys
        used = {m.group(1) for m in re.finditer(r"(?<![\w.:])([A-Za-z_]\w*)", code)}
        missing = sorted(used - defined - LUA_BUILTINS - LUA_KEYWORDS)
        if missing:
            problems.append(f"lua/{name}.lua uses {missing}, defined nowhere it includes")
    return problems


# -- the real tree ---------------------------------------------------------------------------


def test_every_fence_header_names_its_keys_argv_returns_and_errors_as_its_spec_does() -> None:
    assert header_problems(_raw_files(), all_specs()) == []


def test_every_code_a_fence_raises_is_in_the_error_table() -> None:
    assert raise_problems(_raw_files()) == []


def test_every_name_a_fence_uses_is_defined_by_it_or_its_includes() -> None:
    assert undefined_names(_raw_files()) == []


def test_the_error_table_has_each_code_once_and_every_error_class_in_it() -> None:
    codes = [e.code for e in TABLE]
    assert len(codes) == len(set(codes))
    classes = {cls for cls in vars(importlib.import_module("fencemq.errors")).values()
               if isinstance(cls, type) and issubclass(cls, FenceMQError)}
    assert {cls.code for cls in classes} <= set(codes)


def test_each_guarantee_has_its_include_module_and_tests() -> None:
    files = _raw_files()
    for guarantee in ("lite", "seek", "mailbox", "shared", "leases"):
        assert f"lib/{guarantee}.lua" in files
        importlib.import_module(f"fencemq.fences.{guarantee}")


# -- the checks can fail ------------------------------------------------------------------


def _broken(file: str, old: str, new: str) -> dict[str, str]:
    files = dict(_raw_files())
    assert old in files[file], f"{old!r} not in lua/{file}"
    files[file] = files[file].replace(old, new, 1)
    return files


@pytest.mark.parametrize("old, new, found", [
    ("-- KEYS[9] journal\n", "-- KEYS[9] jr\n", "KEYS"),  # a key renamed in the header only
    ("-- ARGV[3] count\n", "", "ARGV"),  # an argument dropped
    ("-- Errors:", "-- Failures:", "no `-- Errors:` line"),
    ("-- Returns:", "-- Gives:", "no `-- Returns:` line"),
])
def test_a_broken_header_is_found(old: str, new: str, found: str) -> None:
    problems = header_problems(_broken("pull.lua", old, new), all_specs())
    assert problems and all("lua/pull.lua" in p for p in problems) and any(found in p for p in problems), problems


def test_a_spec_without_a_fence_and_a_fence_without_a_spec_are_found() -> None:
    specs = all_specs()
    ghost = {**{k: v for k, v in specs.items() if k != "renew"}, "ghost": FenceSpec.__new__(FenceSpec)}
    problems = header_problems(_raw_files(), ghost)
    assert "lua/renew.lua has no FenceSpec" in problems and "spec ghost has no lua/ghost.lua" in problems


def test_a_code_missing_from_the_table_is_found() -> None:
    files = _broken("subscribe.lua", "raise('BUSY', ", "raise('OOPS', ")
    assert raise_problems(files) == ["lua/subscribe.lua: raise('OOPS', …) is not in fencemq.errors.TABLE"]


def test_a_missing_include_is_found() -> None:
    files = _broken("ack.lua", "--@include lib/retention.lua\n", "")
    assert undefined_names(files) == ["lua/ack.lua uses ['forget_below_first', 'group_epoch', 'trim_log'], "
                                      "defined nowhere it includes"]


def test_the_loader_refuses_a_repeated_missing_or_circular_include_with_its_line() -> None:
    files = _broken("pull.lua", "--@include lib/mailbox.lua\n", "--@include lib/mailbox.lua\n--@include lib/mailbox.lua\n")
    with pytest.raises(LoadError, match=r"lua/pull.lua:3 includes lib/mailbox.lua again \(first at line 2\)"):
        assemble("pull", files)
    files = _broken("pull.lua", "--@include lib/mailbox.lua\n", "--@include lib/nothing.lua\n")
    with pytest.raises(LoadError, match=r"lua/pull.lua:2 includes lib/nothing.lua, which is not a file"):
        assemble("pull", files)
    files = _broken("lib/base.lua", "local SEP = '\\0'\n", "--@include lib/meta.lua\nlocal SEP = '\\0'\n")
    with pytest.raises(LoadError, match="include cycle"):
        assemble("pull", files)


def test_a_fence_carries_only_the_helpers_it_reaches() -> None:
    files = _raw_files()
    publish = assemble("publish", files)
    assert "local function revive(" in publish and "local function int_strs(" in publish  # it calls them
    assert "local function check_out(" not in publish  # pull's, in an include publish shares
    assert "local function check_out(" in assemble("pull", files)
    # what a kept helper calls is kept with it: pull -> check_out -> promote_delayed
    assert "local function promote_delayed(" in assemble("pull", files)


def test_a_helper_without_its_own_closing_end_line_is_refused() -> None:
    files = _broken("lib/leases.lua", "  return best\nend\n", "  return best end\n")
    with pytest.raises(LoadError, match="lua/lib/leases.lua: local function next_due has no line 'end'"):
        assemble("sweep", files)


def test_every_fence_says_how_redis_may_run_it_when_memory_is_short() -> None:
    headers = {name: parse_header(src, name) for name, src in fence_files(_raw_files()).items()}
    assert sorted(n for n, h in headers.items() if h.flags is None) == []
    # the loader writes it as the shebang Redis reads a script's flags from
    assert sources()["ack"].startswith("#!lua flags=allow-oom\n")
    assert sources()["publish"].startswith("#!lua\n")
    assert sources()["snapshot"].startswith("#!lua flags=no-writes\n")


def test_a_fence_without_its_flags_or_with_a_flag_redis_does_not_know_is_refused() -> None:
    with pytest.raises(LoadError, match="lua/ack.lua has no --@flags line"):
        assemble("ack", _broken("ack.lua", "--@flags allow-oom\n", ""))
    with pytest.raises(LoadError, match="--@flags allow-everything is not one of"):
        assemble("ack", _broken("ack.lua", "--@flags allow-oom\n", "--@flags allow-everything\n"))
    with pytest.raises(LoadError, match="lua/lib/base.lua:.*--@flags belongs to a fence"):
        assemble("ack", _broken("lib/base.lua", "local SEP = ", "--@flags allow-oom\nlocal SEP = "))


def test_the_operations_doc_lists_every_fence_that_may_write_when_redis_is_full() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs/operations.md").read_text()
    table = doc.split("| fences that may write when Redis is full |")[1].split("\n\n")[0]
    listed = set(re.findall(r"`(\w+)\.lua`", table))
    flagged = {name for name, src in fence_files(_raw_files()).items()
               if "allow-oom" in (parse_header(src, name).flags or ())}
    assert listed == flagged


def undeclared_keys(files: dict[str, str]) -> list[str]:
    """Keys a fence (with the helpers it keeps) reads as ``K.<name>`` that its header does not declare."""
    problems = []
    for name, src in sorted(fence_files(files).items()):
        header = parse_header(src, name)
        declared = set(header.keys) | ({header.keys_rest} if header.keys_rest else set())
        code = "\n".join(line for line in _strip(assemble(name, files)).split("\n") if not line.startswith("local K = "))
        missing = sorted(set(re.findall(r"\bK\.(\w+)", code)) - declared)
        if missing:
            problems.append(f"lua/{name}.lua uses K.{', K.'.join(missing)}, not in its KEYS")
    return problems


def test_every_key_a_fence_touches_is_in_its_keys() -> None:
    assert undeclared_keys(_raw_files()) == []
    # a helper's key counts too: ack's checkouts go through remove_checkouts, which deletes K.held
    files = _broken("ack.lua", "-- KEYS[5] held\n", "-- KEYS[5] kept\n")
    assert any("lua/ack.lua uses K.held" in p for p in undeclared_keys(files))


def rest_problems(files: dict[str, str]) -> list[str]:
    """An lmq at rest has no meta key (lua/lib/meta.lua, put_to_rest): a fence that declares the key but
    not the rest hash, or does not wake the lmq before anything else, would take it for a queue that
    does not exist. The snapshot, which writes nothing, reads it where it rests instead."""
    problems = []
    for name, src in sorted(fence_files(files).items()):
        header = parse_header(src, f"lua/{name}.lua")
        if "meta" not in header.keys:
            continue
        if "rest" not in header.keys:
            problems.append(f"lua/{name}.lua declares meta but not rest")
        body = [line for line in src.splitlines() if line.strip() and not line.startswith(("--", "#!"))]
        first = body[0] if body else ""
        if not re.match(r"(local woke = )?wake_from_rest\(K\)", first) and "rested_meta(K)" not in src:
            problems.append(f"lua/{name}.lua does not wake an lmq at rest first (its first line: {first!r})")
    return problems


def test_every_fence_that_declares_a_meta_key_wakes_an_lmq_at_rest_before_anything_else() -> None:
    assert rest_problems(_raw_files()) == []
    files = _broken("renew.lua", "wake_from_rest(K)  --", "-- (no wake) --")
    assert any("lua/renew.lua does not wake" in p for p in rest_problems(files))
    files = _broken("presence.lua", "-- KEYS[3] rest", "-- KEYS[3] rested")
    assert any("lua/presence.lua declares meta but not rest" in p for p in rest_problems(files))
