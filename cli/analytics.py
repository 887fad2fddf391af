"""`fencemq snapshot` and `fencemq analyze`: per-queue atomic snapshots to Parquet, and the PySpark job over them.

``register(app)`` adds both commands to a Typer app (cli/main.py calls it).

Exit codes: 0 success (analyze: and the fence audit passed); 1 failure (no
snapshot there, queues that could not be read, Spark could not start...);
2 no Redis URL, or the Redis at it does not answer; 3 analyze finished but
the fence audit FAILED (the report lists the violations).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from fencemq.model.keys import Keyspace
from fencemq.cli.common import (
    ENV_REDIS_URL,
    CliError,
    fail,
    safe_url,
)

EXIT_AUDIT_FAILED = 3


async def _snapshot(client: Any, keys: Keyspace, url: str, out: Path, batch: int, log_entries: int,
                    journal_entries: int, progress: Any, since: Path | None = None, journal_buckets: int = 8) -> Any:
    from fencemq.ops.snapshot import take_snapshot  # needs pyarrow (checked by the command)

    return await take_snapshot(client, keys, out, progress, batch=batch, log_entries=log_entries,
                               journal_entries=journal_entries, source=safe_url(url), since=since,
                               journal_buckets=journal_buckets)


def snapshot(
    out: Annotated[Path, typer.Option("--out", "-o", metavar="DIR", help="Directory to write the snapshot to "
                                      "(created; an older snapshot there is replaced).")],
    redis_url: Annotated[Optional[str], typer.Option(
        "--redis-url", metavar="URL", show_default=False,
        help=f"Redis/Valkey URL, e.g. redis://host:6379/0 (default: ${ENV_REDIS_URL}, else the private Redis of "
             "the one `fencemq serve` running here); "
             "a Cluster is detected and every master visited")] = None,
    prefix: Annotated[Optional[str], typer.Option(
        "--prefix", show_default=False,
        help="Key prefix of the broker's state (default: $FENCEMQ_PREFIX or fmq)")] = None,
    batch: Annotated[int, typer.Option(min=1, max=10_000, help="Queues per pipelined round trip.")] = 100,
    log_entries: Annotated[int, typer.Option(
        "--log-entries", min=0, help="Per queue, list this many log entries (id, publish ms, size; never "
                                     "payloads) in the messages table.")] = 0,
    journal_entries: Annotated[int, typer.Option(
        "--journal-entries", min=-1, help="Per queue, export the newest N journal events (-1 = all kept).")] = -1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON (no progress display).")] = False,
    since: Annotated[Optional[Path], typer.Option(
        "--since", metavar="BASE", show_default=False,
        help="Incremental: build on the snapshot in BASE; a queue whose state is as BASE read it is not read "
             "again (analyze follows the chain back to a full snapshot).")] = None,
    journal_buckets: Annotated[int, typer.Option(
        "--journal-buckets", min=1, max=100_000,  # 8: fencemq.ops.journal_buckets.DEFAULT_BUCKETS (numpy-free here)
        help="Write the journal as N files bucketed by queue (analyze runs one task per bucket over it and "
             "shuffles none of it): about the cores the analysis will have.")] = 8,
) -> None:
    """Snapshot every queue's whole state (one atomic Lua call per queue) to Parquet + manifest.json.

    Read-only and safe against a live broker: each queue is consistent in
    itself (its rows come from one atomic call); queues are read one after
    another, so the snapshot is not one instant of the whole broker.
    With --since BASE, only queues whose state changed since BASE are written
    (every fence write changes a queue's state digest).
    """
    from fencemq.cli.opskit import Ctx

    ctx = Ctx("snapshot", redis_url, prefix, cluster=False)  # the operator commands' URL, gate and errors
    try:
        import pyarrow  # noqa: F401
    except ImportError as exc:
        fail("snapshot", CliError(f"pyarrow is not installed ({exc}); pip install 'fencemq[spark]'"))
        raise typer.Exit(1) from None
    if since is not None and not (since / "manifest.json").is_file():
        fail("snapshot", CliError(f"no snapshot at {since} to build on (manifest.json missing)"))
        raise typer.Exit(1)
    from fencemq.ops.snapshot import SnapshotError

    def take(progress: Any) -> Any:
        return ctx.run(lambda r, k: _snapshot(r, k, ctx.url, out, batch, log_entries, journal_entries, progress,
                                              since, journal_buckets))

    err = Console(stderr=True, highlight=False)
    try:
        if as_json:
            manifest = take(None)
        else:
            from rich.progress import (
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            with Progress(SpinnerColumn(), TextColumn("snapshot: {task.completed:,} queues"),
                          TimeElapsedColumn(), console=err, transient=True) as bar:
                task = bar.add_task("snapshot", total=None)
                manifest = take(lambda done, _total: bar.update(task, completed=done))
    except SnapshotError as exc:
        fail("snapshot", CliError(str(exc)))
        raise typer.Exit(1) from None

    if as_json:
        typer.echo(manifest.to_json())
    else:
        console = Console(highlight=False)
        table = Table(title=f"snapshot of {manifest.source} → {out}", title_justify="left")
        table.add_column("table")
        table.add_column("rows", justify="right")
        for name, rows in manifest.counts.items():
            table.add_row(name, f"{rows:,}")
        console.print(table)
        console.print(f"{manifest.queues:,} queues from {manifest.nodes} master(s) in {manifest.duration_s:.2f} s "
                      f"({manifest.queues_per_s:,.0f} queues/s)"
                      + (f"; {manifest.vanished} vanished meanwhile" if manifest.vanished else "")
                      + (f"; {manifest.unchanged:,} unchanged since {since} (not read again)"
                         if since is not None else ""))
    if manifest.error_count:
        fail("snapshot", CliError(f"{manifest.error_count} queue(s) could not be read (first: "
                                  f"{manifest.errors[0]}); see {out / 'manifest.json'}"))
        raise typer.Exit(1)


def analyze(
    snapshot_dir: Annotated[Path, typer.Argument(metavar="DIR", help="A directory written by `fencemq snapshot`.")],
    master: Annotated[str, typer.Option(help="Spark master: local[*], local[N], spark://host:7077 ...")] = "local[*]",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", metavar="DIR", show_default=False,
                                                help="Where to write result tables and report.html "
                                                     "(default: DIR/analysis).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    report: Annotated[bool, typer.Option("--report/--no-report", help="Write report.html and its plots.")] = True,
) -> None:
    """Run the PySpark analytics job (in this process) and its fence audit over a snapshot.

    Writes result tables (Parquet), summary.json and report.html with plots;
    the JVM's own output goes to spark.log beside them (a terminal sees one
    progress line instead).
    Exit code 3 when the fence audit fails. Needs pyspark (the "spark"
    extra of the fencemq package) and Java 17+.
    """
    if not (snapshot_dir / "manifest.json").is_file():
        fail("analyze", CliError(f"no snapshot at {snapshot_dir} (manifest.json missing); take one with "
                                 f"`fencemq snapshot --out {snapshot_dir}`"))
        raise typer.Exit(1)
    try:
        from pyspark import SparkContext
        from pyspark.sql import SparkSession

        from fencemq.spark.analytics import AnalyticsError
        from fencemq.spark.analytics import analyze as run_job
        from fencemq.spark.session import build_session, is_small
    except ImportError as exc:
        fail("analyze", CliError(f"PySpark is not installed ({exc}); pip install 'fencemq[spark]'"))
        raise typer.Exit(1) from None

    results = out if out is not None else snapshot_dir / "analysis"
    results.mkdir(parents=True, exist_ok=True)
    log = results / "spark.log"
    # One SparkContext per process: when one runs already (a notebook, a test session), use it
    # (its master wins) and leave it running.
    running = SparkContext._active_spark_context is not None
    with _progress_line(enabled=not as_json) as say:
        try:
            if running:
                spark = SparkSession.builder.getOrCreate()
            else:
                say(f"starting Spark ({master})")
                with _jvm_output_to(log):
                    spark = build_session(master, conf={"spark.ui.showConsoleProgress": "false"},
                                          small_input=is_small(snapshot_dir))
        except Exception as exc:  # noqa: BLE001 — JAVA_GATEWAY_EXITED and friends
            fail("analyze", CliError(f"Spark could not start ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                                     f"is Java 17+ installed (JAVA_HOME)? Spark's own output: {log}"))
            raise typer.Exit(1) from None
        try:
            summary = run_job(spark, snapshot_dir, out, report=report, progress=say)
        except AnalyticsError as exc:
            fail("analyze", CliError(str(exc)))
            raise typer.Exit(1) from None
        finally:
            if not running:
                say("stopping Spark")
                spark.stop()

    audit = summary["audit"]
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
    else:
        console = Console(highlight=False)
        colour = "green" if audit["verdict"] == "PASS" else "red"
        console.print(f"fence audit: [bold {colour}]{audit['verdict']}[/]")
        for c in audit["checks"]:
            mark = "[green]ok[/]" if not c["violations"] else f"[red]{c['violations']:,} violations[/]"
            console.print(f"  {mark}  {c['fence']}: {c['what']} — {c['kind']} check on {c['queues']:,} queues "
                          f"({c['over']})")
        t = summary["totals"]
        skipped = audit["scope"]["history_not_checked"]
        if skipped:
            console.print("[yellow]history checks not run on " + ", ".join(
                f"{n:,} {kind} queues" for kind, n in skipped.items()) + "[/] (no journal: state checks and "
                "churn counters only; FENCEMQ_LITE_JOURNAL_CAP turns lmq journals on)")
        console.print(f"{t['queues']:,} queues ({t['lmqs']:,} lmqs), {t['groups']:,} groups, "
                      f"{t['journal_events']:,} journal events; backlog {t['backlog']:,}; "
                      f"redeliveries {t['redeliveries']:,}; lock expiries {t['timeouts']:,}; "
                      f"preemptions {t['preemptions']:,}, evictions {t['evictions']:,} "
                      f"({t['lmqs_with_churn']:,} lmqs churned); seeks {t['seeks']:,}")
        console.print(f"results: {summary['out']}" + (f"  report: {summary['report']}" if summary["report"] else ""))
    if audit["verdict"] != "PASS":
        raise typer.Exit(EXIT_AUDIT_FAILED)


@contextmanager
def _jvm_output_to(log: Path) -> Iterator[None]:
    """The JVM that PySpark starts inherits this process's stdout and stderr: while it starts, they are
    ``log``, so its warnings (log4j, the JDK's, Hadoop's) and later messages go there, not to the terminal."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    to_log = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(to_log, 1)
        os.dup2(to_log, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, to_log):
            os.close(fd)


@contextmanager
def _progress_line(enabled: bool) -> Iterator[Callable[[str], None]]:
    """One line on a terminal's stderr saying what the job does now and for how long (gone when done);
    nothing elsewhere. It writes to a copy of stderr, so it stays on the terminal while the JVM starts."""
    terminal = enabled and os.isatty(2)
    if not terminal:
        yield lambda _what: None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with os.fdopen(os.dup(2), "w") as stderr_copy:
        console = Console(file=stderr_copy, highlight=False)
        with Progress(SpinnerColumn(), TextColumn("analyze: {task.description}"), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
            task = bar.add_task("starting", total=None)
            yield lambda what: bar.update(task, description=what)


def register(app: typer.Typer) -> None:
    """Add `snapshot` and `analyze` to the operator CLI."""
    app.command("snapshot")(snapshot)
    app.command("analyze")(analyze)


if __name__ == "__main__":  # pragma: no cover
    standalone = typer.Typer(add_completion=False, no_args_is_help=True)
    register(standalone)
    standalone()
    sys.exit(0)
