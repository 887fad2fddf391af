"""Installing FenceMQ is quiet: `make demo` shows the demo, not the install, and the build warns of nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                      ".hypothesis", "node_modules", "spark-warehouse", "metastore_db")


def test_building_the_package_raises_no_setuptools_deprecation(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCES)
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                          "--no-cache-dir", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout + run.stderr
    assert "running bdist_wheel" in out or "Building wheel" in out, "pip -v hid the backend's output"
    for noise in ("SetuptoolsDeprecationWarning", "License classifiers are deprecated", "project.license",
                  "is absent from the `packages` configuration"):  # e.g. the UI's templates/ and static/
        assert noise not in out, f"the build warns: {noise}"


@pytest.mark.long  # `make test-long` (.ci/run) runs it, to keep make test short
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_demo_in_a_fresh_venv_says_two_lines_before_the_demo(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run = subprocess.run(["make", "--no-print-directory", f"VENV={venv}", f"PYTHON={sys.executable}", "demo"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "FENCEMQ_REDIS_URL": ""})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    before_demo = run.stdout.split("FenceMQ demo")[0].splitlines()
    assert [line for line in before_demo if not line.startswith(("╭", "│"))] == [
        f"creating {venv}", f"installing fencemq into {venv} (log: {venv}/install.log)"]
    assert run.stderr == "", run.stderr[-2000:]
    assert (venv / "install.log").exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_bare_make_installs_fencemq_and_says_what_else_there_is(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run = subprocess.run(["make", "-n", "--no-print-directory", f"VENV={venv}", f"PYTHON={sys.executable}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "-m venv" in run.stdout and "-m pip install -e . " in run.stdout, run.stdout  # fencemq, not just a venv
    for target in ("make demo", "make test", "make serve"):
        assert target in run.stdout, run.stdout
    assert f"{venv}/bin/fencemq" in run.stdout
