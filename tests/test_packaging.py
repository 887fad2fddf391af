"""What ships: the compose/Docker command lines name real CLI commands, and the
wheel carries every package (including the Lua scripts)."""

from __future__ import annotations

import importlib
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
EXPECTED_COMMANDS = {"serve", "demo", "status"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _scripts() -> dict[str, str]:
    return _pyproject()["project"]["scripts"]


def _cli_app(script: str) -> typer.Typer:
    """The app behind a console script such as `fencemq = cli.main:app`."""
    module_name, _, attr = _scripts()[script].partition(":")
    app = getattr(importlib.import_module(module_name), attr)
    assert isinstance(app, typer.Typer), f"{_scripts()[script]} is not a typer.Typer"
    return app


def _cli_group(script: str):
    """The click group typer builds (typer vendors click, so duck-typed here)."""
    group = typer.main.get_command(_cli_app(script))
    assert hasattr(group, "commands"), f"{script} has no subcommands"
    return group


def _assert_runs(argv: list[str], where: str) -> None:
    """argv[0] is a declared console script, argv[1] one of its commands, and the
    options that follow parse (unknown options or bad values fail here)."""
    scripts = _scripts()
    assert argv and argv[0] in scripts, (
        f"{where}: {argv[:1]} is not in [project.scripts] {sorted(scripts)}")
    group = _cli_group(argv[0])
    assert len(argv) > 1 and argv[1] in group.commands, (
        f"{where}: {argv[1:2]} is not a command of {argv[0]} (has {sorted(group.commands)})")
    command = group.commands[argv[1]]
    try:
        command.make_context(argv[1], list(argv[2:]))  # parse only; does not run it
    except Exception as exc:  # click's UsageError/BadParameter (typer vendors click)
        message = exc.format_message() if hasattr(exc, "format_message") else repr(exc)
        pytest.fail(f"{where}: `{shlex.join(argv)}` does not parse: {message}")


def _compose_services() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def test_cli_app_has_the_expected_commands() -> None:
    assert "fencemq" in _scripts()
    group = _cli_group("fencemq")
    assert EXPECTED_COMMANDS <= set(group.commands), sorted(group.commands)
    result = CliRunner().invoke(_cli_app("fencemq"), ["--help"])
    assert result.exit_code == 0, result.output
    for name in EXPECTED_COMMANDS:
        assert name in result.output


def test_compose_commands_are_real_cli_commands() -> None:
    services = _compose_services()
    ours = {name: svc for name, svc in services.items() if "build" in svc}
    assert {"worker1", "worker2"} <= set(ours)
    for name, svc in ours.items():
        assert "command" in svc, f"service {name} builds our image but sets no command"
        command = svc["command"]
        argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        _assert_runs(argv, f"docker-compose.yml service {name}")


def test_compose_topology() -> None:
    services = _compose_services()
    redis = services["redis"]
    assert redis["image"].startswith("redis:7")
    assert "--appendonly yes" in redis["command"] and "healthcheck" in redis
    published = {}
    for name in ("worker1", "worker2"):
        svc = services[name]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert "redis://redis:6379/" in svc["command"]
        published[name] = {p.split(":")[0] for p in svc["ports"]}
    assert "7379" in published["worker1"] and "7380" in published["worker2"]


def test_compose_runs_the_analytics_job_on_demand() -> None:
    services = _compose_services()
    snapshot, analyze = services["snapshot"], services["analyze"]
    for svc in (snapshot, analyze):  # not part of `docker compose up`: run with --profile analytics
        assert svc["profiles"] == ["analytics"] and svc["build"]["target"] == "analytics"
        assert "analytics:/data" in svc["volumes"]
    assert "--out /data/snapshot" in snapshot["command"] and "redis://redis:6379/" in snapshot["command"]
    assert analyze["command"].startswith("fencemq analyze /data/snapshot")
    assert analyze["depends_on"]["snapshot"]["condition"] == "service_completed_successfully"
    stage = _dockerfile_stages()["analytics"]
    assert "openjdk-17-jre" in stage and ".[spark]" in stage, "Spark needs Java 17 and the spark extra"


def _dockerfile_stages() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text()
    parts = re.split(r"(?im)^FROM\s+\S+\s+AS\s+(\S+)\s*$", text)
    return dict(zip(parts[1::2], parts[2::2]))


def test_dockerfile_cmds_are_real_cli_commands() -> None:
    stages = _dockerfile_stages()
    assert {"base", "runtime"} <= set(stages)
    for stage, body in stages.items():
        for cmd in re.findall(r"(?m)^CMD\s+(\[.*\])\s*$", body):
            _assert_runs(json.loads(cmd), f"Dockerfile stage {stage} CMD")
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


# --- the wheel ------------------------------------------------------------------------

_NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
    ".hypothesis", "bench", "tests", "spark-warehouse", "metastore_db", "snapshots", "reports")


def _build_wheel(src: Path, out: Path) -> Path:
    base = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", str(out)]
    # Prefer the venv's own setuptools (no network); if it cannot build wheels
    # (e.g. the `wheel` package is missing), let pip fetch the declared backend.
    attempts = [base + ["--no-build-isolation", str(src)], base + [str(src)]]
    logs = []
    for cmd in attempts:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        wheels = sorted(out.glob("fencemq-*.whl"))
        if run.returncode == 0 and wheels:
            return wheels[0]
        logs.append(f"$ {shlex.join(cmd)}\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    pytest.fail("could not build the wheel:\n" + "\n".join(logs))


def test_wheel_contains_all_packages_and_lua_scripts(tmp_path: Path) -> None:
    # Build from a copy so the build/ and *.egg-info droppings stay out of the work tree.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCES)
    wheel = _build_wheel(src, tmp_path / "dist")
    names = set(zipfile.ZipFile(wheel).namelist())

    # Compare with the copy that was built (the work tree may change meanwhile).
    lua_files = sorted(p.name for p in (src / "lua").glob("*.lua"))
    assert lua_files, "the repo's lua/ directory has no .lua scripts"
    missing = [f for f in lua_files if f"fencemq_lua/{f}" not in names]
    assert not missing, f"Lua scripts missing from the wheel: {missing}"
    for package in ("broker", "cli", "spark", "fencemq_lua"):
        assert f"{package}/__init__.py" in names, f"package {package} missing from the wheel"
    for module in (src / "broker").glob("*.py"):
        assert f"broker/{module.name}" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "fencemq = cli.main:app" in zipfile.ZipFile(wheel).read(entry_points).decode()
