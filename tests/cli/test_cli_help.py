"""`fencemq … --help` reads as written: no type noise beside the options, literal text kept literal."""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

from fencemq.cli.main import app


def _paths(command, prefix=()) -> list[tuple[str, ...]]:
    out = [prefix]
    for name, sub in getattr(command, "commands", {}).items():
        out += _paths(sub, (*prefix, name))
    return out


PATHS = _paths(typer.main.get_command(app))


def _help(*path: str, width: int = 80) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(width)}, terminal_width=width)
    assert result.exit_code == 0, result.output
    return result.output


def test_every_command_is_walked() -> None:
    assert {("serve",), ("status",), ("inspect", "queue"), ("dlq", "list"), ("user", "add")} <= set(PATHS)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "fencemq")
def test_no_help_shows_a_type_in_angle_brackets(path: tuple[str, ...]) -> None:
    noise = re.findall(r"<(?:bool|str|int|float|path|list|text|integer)[^>]*>", _help(*path), re.I)
    assert not noise, f"fencemq {' '.join(path)} --help shows {sorted(set(noise))}"


def test_a_flag_shows_no_value_and_a_number_shows_N() -> None:
    text = _help("top", width=200)
    assert re.search(r"--json\s{2,}Print JSON", text), text
    assert re.search(r"--interval\s+N \[x>=0\.05\]", text), text


def test_help_text_in_square_brackets_is_shown_literally() -> None:
    assert "pip install 'fencemq[fast]'" in _help("serve", width=200)
    assert "local[*], local[N], spark://host:7077" in _help("analyze", width=200)
    assert "'$share/<group>/<filter>'" in _help("inspect", "queue", width=200)
