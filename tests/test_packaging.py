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
    """The app behind a console script such as `fencemq = fencemq.cli.main:app`."""
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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Build from a copy so the build/ and *.egg-info droppings stay out of the work tree.
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCES)
    return _build_wheel(src, tmp / "dist")


def test_the_wheel_installs_one_import_root_with_the_lua_fences(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    lua_files = sorted(p.relative_to(ROOT / "lua").as_posix() for p in (ROOT / "lua").rglob("*.lua"))
    assert lua_files, "the repo's lua/ directory has no .lua scripts"
    missing = [f for f in lua_files if f"fencemq/lua/{f}" not in names]
    assert not missing, f"Lua scripts missing from the wheel: {missing}"
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith((".dist-info", ".data"))}
    assert tops == {"fencemq"}, f"the wheel installs more than one top-level package: {sorted(tops)}"
    for folder, package in (("broker", "fencemq"), ("cli", "fencemq/cli"), ("spark", "fencemq/spark")):
        for module in (ROOT / folder).rglob("*.py"):
            rel = module.relative_to(ROOT / folder).as_posix()
            assert f"{package}/{rel}" in names, f"{folder}/{rel} is missing from the wheel"
    assert "fencemq/py.typed" in names
    ui_files = sorted(p.relative_to(ROOT / "broker").as_posix() for folder in ("templates", "static")
                      for p in (ROOT / "broker" / "ui" / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert ui_files and not [f for f in ui_files if f"fencemq/{f}" not in names], "UI files missing from the wheel"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "fencemq = fencemq.cli.main:app" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.long  # `make test-long` (.ci/run) runs it, to keep make test short
def test_a_fresh_venv_with_the_wheel_imports_fencemq_and_runs_the_command(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, timeout=300)
    # The dependencies come from this test run's environment, the project itself only from the wheel:
    # a plain path entry (not a site dir) carries no .pth, so the editable install stays out.
    deps = next(p for p in map(Path, sys.path) if p.name == "site-packages" and (p / "redis").is_dir())
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "zz_test_deps.pth").write_text(str(deps) + "\n")
    probe = ("import importlib.util, fencemq, fencemq.cli, fencemq.spark, fencemq.lua; "
             "from fencemq import Client, SyncClient; "
             "print(fencemq.__file__); "
             "print([n for n in ('broker', 'cli', 'spark') if importlib.util.find_spec(n)])")
    run = subprocess.run([str(py), "-I", "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    where, strays = run.stdout.split("\n")[:2]
    assert where.startswith(str(site)), f"fencemq was imported from {where}, not the wheel"
    assert strays == "[]", f"top-level packages besides fencemq: {strays}"
    cli = subprocess.run([str(venv / "bin" / "fencemq"), "--help"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "serve" in cli.stdout, cli.stderr
