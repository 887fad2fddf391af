"""``fencemq bench``: the end-to-end benchmark (``python -m bench.run``) from a source checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from fencemq.cli.common import CliError, fail
from fencemq.cli.opskit import ROOT


def _bench_out(args: list[str]) -> Path:
    out = ROOT / "bench" / "results"
    for i, a in enumerate(args):
        if a == "--out" and i + 1 < len(args):
            out = Path(args[i + 1])
        elif a.startswith("--out="):
            out = Path(a.split("=", 1)[1])
    return out.resolve()


def _relay(argv: list[str], **kw: Any) -> int:
    """Run a command, copying its stdout and stderr to ours line by line (so they can be captured)."""
    import threading

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, **kw)

    def copy(src: Any, dst: Any) -> None:
        for line in src:
            dst.write(line)
            dst.flush()

    err = threading.Thread(target=copy, args=(proc.stderr, sys.stderr), daemon=True)
    err.start()
    try:
        copy(proc.stdout, sys.stdout)
        return proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
        err.join(5)
        proc.stdout.close()
        proc.stderr.close()


def bench(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Finish with a JSON summary {returncode, out, written}.")] = False,
) -> None:
    """Run the end-to-end benchmark (`python -m bench.run`), passing every other argument through.

    E.g. `fencemq bench --messages 20000 --repeat 1`; `fencemq bench -- --help`
    lists bench.run's options. Needs a source checkout (bench/ is not installed).
    """
    if not (ROOT / "bench" / "run.py").is_file():
        fail("bench", CliError(f"no benchmark at {ROOT / 'bench'}: `fencemq bench` runs from a source checkout"))
        raise typer.Exit(1)
    args = list(ctx.args)
    out = _bench_out(args)
    started = time.time()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        # In the caller's directory (a relative --out is where they expect it); bench/ found via PYTHONPATH.
        returncode = _relay([sys.executable, "-m", "bench.run", *args], env=env)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    written = sorted(str(p) for p in out.glob("*") if p.is_file() and p.stat().st_mtime >= started - 1) \
        if out.is_dir() else []
    if as_json:
        typer.echo(json.dumps({"returncode": returncode, "out": str(out), "written": written}))
    elif written:
        typer.echo(f"results written to {out}: {', '.join(Path(w).name for w in written)}")
    elif returncode == 0:
        typer.echo(f"no results written (results go to {out})")
    if returncode:
        fail("bench", CliError(f"python -m bench.run exited with {returncode}"))
        raise typer.Exit(returncode if returncode in (1, 2) else 1)
