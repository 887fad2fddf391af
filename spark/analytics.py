"""FenceMQ analytics: a PySpark job over a snapshot written by broker/ops/snapshot.py.

    python -m spark SNAPSHOT_DIR [--out DIR] [--master local[*]]
    spark-submit spark/analytics.py SNAPSHOT_DIR --out DIR
    fencemq analyze SNAPSHOT_DIR [--master local[*] | spark://host:7077] [--out DIR]

Reads the snapshot's Parquet tables and writes, under ``--out`` (default
``SNAPSHOT_DIR/analysis``), one Parquet directory per result table (what
each holds, and the fence audit: spark/result_tables.py), a ``summary.json`` and
``report.html`` with PNG plots (spark/report.py).

Only pyspark (+ matplotlib for the plots) is needed: spark/ imports
nothing from the broker, so ``spark-submit`` can ship the directory alone
(run as a file, its siblings are found on ``sys.path``; on a cluster, add
``--py-files spark/result_tables.py,spark/report.py,spark/session.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

try:
    from fencemq.spark.result_tables import RESULT_TABLES, compute
    from fencemq.spark.session import MAX_CHAIN, SMALL_INPUT_CONF, build_session, is_small, settings
except ImportError:  # run as a file (spark-submit spark/analytics.py): its directory is on sys.path
    from result_tables import RESULT_TABLES, compute  # type: ignore[no-redef]
    from session import MAX_CHAIN, SMALL_INPUT_CONF, build_session, is_small, settings  # type: ignore[no-redef]

__all__ = ["AGE_BUCKETS", "RESULT_TABLES", "AnalyticsError", "analyze", "build_session", "load_tables", "main"]

SCHEMA_VERSION = 3
# version 1 lacks the churn columns (read as null) and incremental snapshots; versions 1 and 2 lack the
# scheduled and priority columns (read as null: a queue of theirs has no level counts)
READS_VERSIONS = (1, 2, 3)
SNAPSHOT_TABLES = ("queues", "groups", "members", "checkouts", "ready", "journal")
AUDITS = ("audit_evicted_out", "audit_stale_epoch", "audit_double_ack", "audit_marked_holding",
          "audit_stale_checkout")
# (audit table, the guarantee it checks, what it checks, on what: "history" = queues with a journal,
#  "state" = every queue)
AUDIT_CHECKS = (
    ("audit_evicted_out", "eviction fence", "no checkout handed to a client after its eviction, before it "
                                            "subscribed again", "history"),
    ("audit_marked_holding", "eviction fence", "no evicted (marked) client holds a checkout", "state"),
    ("audit_stale_epoch", "epoch fence", "no checkout under an epoch lower than one its group had reached",
     "history"),
    ("audit_stale_checkout", "epoch fence", "no checkout under an epoch below its group's", "state"),
    ("audit_double_ack", "ack-once", "no message acknowledged twice in a group without a rewind between",
     "history"),
)
# columns a version-1 snapshot lacks: read as null
ADDED_IN_2 = {"groups": (("preemptions", "bigint"), ("evictions", "bigint"), ("fenced_pulls", "bigint"),
                         ("churn_clients", "array<string>"), ("churn_clients_capped", "boolean"),
                         ("first_churn_ms", "bigint"), ("last_churn_ms", "bigint")),
              "queues": (("digest", "string"),)}
ADDED_IN_3 = {"queues": (("scheduled", "bigint"), ("priority", "boolean"), ("held_by_level", "array<bigint>")),
              "groups": (("unread_by_level", "array<bigint>"),)}
AGE_BUCKETS = ((1_000, "< 1 s"), (10_000, "1-10 s"), (60_000, "10 s-1 min"), (600_000, "1-10 min"),
               (3_600_000, "10 min-1 h"), (86_400_000, "1 h-1 d"), (None, "> 1 d"))


class AnalyticsError(Exception):
    """A problem the user can fix (no snapshot there, wrong schema version)."""


def _bucketed_journal(spark, path: Path, buckets: int, created: list[str]):
    """The journal directory as a table bucketed by queue (broker/ops/journal_buckets.py wrote it the way
    Spark hashes): Spark then knows every queue's rows are in one task and shuffles none of them."""
    schema = spark.read.parquet(str(path)).schema
    columns = ", ".join(f"`{f.name}` {f.dataType.simpleString()}" for f in schema.fields)
    name = f"fencemq_journal_{uuid.uuid4().hex}"
    location = str(path.resolve()).replace("\\", "\\\\").replace("'", "\\'")
    # an external table (LOCATION): dropping it leaves the snapshot's files alone
    spark.sql(f"CREATE TABLE {name} ({columns}) USING parquet CLUSTERED BY (queue) INTO {buckets} BUCKETS "
              f"LOCATION '{location}'")
    created.append(name)
    return spark.table(name)


def _load_one(spark, root: Path, created: list[str]) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(manifest, {table: DataFrame}, unchanged queues or None) of one snapshot, not following its base."""
    from pyspark.sql import functions as F

    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        raise AnalyticsError(f"no snapshot at {root} (manifest.json missing); take one with "
                             f"`fencemq snapshot --out {root}`")
    manifest = json.loads(manifest_path.read_text())
    version = manifest.get("schema_version")
    if version not in READS_VERSIONS:
        raise AnalyticsError(f"snapshot at {root} has schema version {version!r}; "
                             f"this job reads versions {', '.join(map(str, READS_VERSIONS))}")
    tables = {}
    buckets = int(manifest.get("journal_buckets") or 0)
    for name in SNAPSHOT_TABLES:
        path = root / manifest.get("tables", {}).get(name, f"{name}.parquet")
        if not path.exists():
            raise AnalyticsError(f"snapshot at {root} lacks table {name} ({path.name})")
        if name == "journal" and buckets and path.is_dir():
            df = _bucketed_journal(spark, path, buckets, created)
        else:
            df = spark.read.parquet(str(path))
        for column, typ in (*ADDED_IN_2.get(name, ()), *ADDED_IN_3.get(name, ())):
            if column not in df.columns:
                df = df.withColumn(column, F.lit(None).cast(typ))
        tables[name] = df
    unchanged = None
    if manifest.get("base"):
        path = root / manifest.get("tables", {}).get("unchanged", "unchanged.parquet")
        if not path.exists():
            raise AnalyticsError(f"incremental snapshot at {root} lacks table unchanged ({path.name})")
        unchanged = spark.read.parquet(str(path)).select("queue", "snapshot_ms")
    return manifest, tables, unchanged


def load_tables(spark, snapshot_dir: str | Path,
                created: list[str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, {table: DataFrame}) of a finished snapshot; an incremental one with its chain.

    An incremental snapshot (``fencemq snapshot --since BASE``) holds rows of the
    queues that changed and names the others in ``unchanged``: their rows are
    taken from the base (which may be incremental too, back to a full
    snapshot), with this snapshot's time (``snapshot_ms``: an unchanged queue's
    oldest message is older now). The manifest returned is the newest one,
    with ``chain``: every directory read, newest first, and ``journal_bucketed``:
    whether the journal DataFrame is read from bucketed tables (every snapshot
    of the chain written with the same buckets), so the job need not shuffle it. A bucketed journal
    is a catalog table (an external one, over the snapshot's files): its name
    is appended to ``created``, for the caller to drop when done.
    """
    created = [] if created is None else created
    created_before = len(created)
    chain: list[tuple[dict[str, Any], dict[str, Any], Any]] = []
    root = Path(snapshot_dir)
    seen: set[Path] = set()
    while True:
        if root.resolve() in seen or len(chain) >= MAX_CHAIN:
            raise AnalyticsError(f"snapshot chain loops or is too long at {root}")
        seen.add(root.resolve())
        manifest, tables, unchanged = _load_one(spark, root, created)
        chain.append((manifest, tables, unchanged))
        if not manifest.get("base"):
            break
        root = root / manifest["base"]
        if not (root / "manifest.json").is_file():
            raise AnalyticsError(f"the base of snapshot {chain[-1][0].get('created')} is gone: no snapshot at "
                                 f"{root} (an incremental snapshot needs its whole chain)")
    # fold from the oldest: each step keeps its own rows and takes the unchanged queues' from the one before
    _, tables, _ = chain[-1]
    for manifest, newer, unchanged in reversed(chain[:-1]):
        merged = {}
        for name in SNAPSHOT_TABLES:
            carried = tables[name].join(unchanged, "queue", "left_semi") if name not in ("queues", "groups") else (
                tables[name].drop("snapshot_ms").join(unchanged, "queue")
                .select(*newer[name].columns))
            merged[name] = newer[name].unionByName(carried)
        tables = merged
    newest = dict(chain[0][0])
    newest["chain"] = [str(Path(snapshot_dir))] + [m.get("base") for m, _, _ in chain[:-1]]
    newest["chain_length"] = len(chain)
    # Spark keeps the buckets' partitioning through the chain's unions and semi-joins (the unchanged
    # queues are the small side), as long as every snapshot has the same buckets
    buckets = {m.get("journal_buckets") for m, _, _ in chain}
    newest["journal_bucketed"] = len(created) - created_before == len(chain) and len(buckets) == 1
    return newest, tables


def _age_bucket(col):
    from pyspark.sql import functions as F

    expr = None
    lower = 0
    for i, (upper, label) in enumerate(AGE_BUCKETS):
        cond = col < upper if upper is not None else col >= lower
        expr = F.when(cond, F.lit(i)) if expr is None else expr.when(cond, F.lit(i))
        lower = upper or lower
    return expr


def _rows(df, limit: int | None = None) -> list[dict[str, Any]]:
    if limit is not None:
        df = df.limit(limit)
    return [r.asDict(recursive=True) for r in df.collect()]


@contextmanager
def _cleaned_up(spark, created: list[str], persisted: list[Any]) -> Iterator[None]:
    """Drops what the block cached (``persisted``) and the catalog tables it made (``created``)."""
    try:
        yield
    finally:
        for df in persisted:
            df.unpersist()
        for name in created:
            spark.sql(f"DROP TABLE IF EXISTS {name}")  # external: the snapshot's files stay


def analyze(spark, snapshot_dir: str | Path, out_dir: str | Path | None = None, *, report: bool = True,
            report_rows: int = 50, partitions: int | None = None,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the job; returns the summary (also written to ``summary.json``). ``progress`` is told each
    step as it starts ("writing backlog (1/16)"), for a progress line. A small snapshot (is_small) runs
    with the settings for small inputs and one shuffle partition: the same tables, sooner."""
    small = is_small(snapshot_dir)
    with settings(spark, SMALL_INPUT_CONF if small else {}):
        return _job(spark, snapshot_dir, out_dir, report, report_rows, partitions or (1 if small else None),
                    progress)


def _job(spark, snapshot_dir: str | Path, out_dir: str | Path | None, report: bool, report_rows: int,
         partitions: int | None, progress: Callable[[str], None] | None) -> dict[str, Any]:
    from pyspark.sql import functions as F

    step = progress or (lambda _what: None)

    started = time.perf_counter()
    timings: dict[str, float] = {}  # seconds per step (summary.json: where the time goes)
    snapshot_dir = Path(snapshot_dir)
    out = Path(out_dir) if out_dir is not None else snapshot_dir / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    created: list[str] = []
    persisted: list[Any] = []
    partitions = partitions or int(spark.conf.get("spark.sql.shuffle.partitions"))
    job_conf = {
        # Joins on (queue, group[, member]) of frames hash-partitioned by queue alone need no shuffle.
        "spark.sql.requireAllClusterKeysForCoPartition": "false",
        # A bucketed journal is read as buckets even where the plan being cached (the journal's
        # persisted projection) has no join or aggregation yet: those come in later plans over it.
        "spark.sql.sources.bucketing.autoBucketedScan.enabled": "false",
    }
    with settings(spark, job_conf), _cleaned_up(spark, created, persisted):
        step("reading the snapshot")
        manifest, tables = load_tables(spark, snapshot_dir, created)
        results = compute(tables, partitions, persisted, journal_bucketed=manifest["journal_bucketed"])
        for i, name in enumerate(RESULT_TABLES, 1):
            step(f"writing {name} ({i}/{len(RESULT_TABLES)})")
            t0 = time.perf_counter()
            results[name].write.mode("overwrite").parquet(str(out / name))
            timings[f"write {name}"] = round(time.perf_counter() - t0, 2)
    step("summing up and auditing")
    t0 = time.perf_counter()
    res = {name: spark.read.parquet(str(out / name)) for name in RESULT_TABLES}
    every = None  # every table's row count in one job (Parquet footers), not one job per table
    for name in RESULT_TABLES:
        part = res[name].select(F.lit(name).alias("table"))
        every = part if every is None else every.unionByName(part)
    counts = {name: 0 for name in RESULT_TABLES}
    counts.update({r["table"]: r["count"] for r in every.groupBy("table").count().collect()})

    col = F.col
    b = res["backlog"].agg(
        F.sum("backlog").alias("backlog"), F.sum("unread").alias("unread"), F.sum("ready").alias("ready"),
        F.sum("delayed").alias("delayed"), F.sum("checkouts").alias("checkouts"),
        F.max("oldest_unacked_age_ms").alias("max_oldest_unacked_age_ms"),
        F.countDistinct("topic").alias("topics")).first().asDict()
    a = res["group_activity"].agg(*[F.sum(c).alias(c) for c in (
        "outs", "redeliveries", "acks", "nacks", "discards", "dead_letters", "timeouts", "seeks")]).first().asDict()
    # churn from the preemptions table: the meta counters (every lmq) and the journal, merged per group
    p = res["preemptions"].agg(
        F.sum("preemptions").alias("preemptions"), F.sum("evictions").alias("evictions"),
        F.sum("fenced_pulls").alias("fenced_pulls"),
        F.count(F.when(col("lmq").isNotNull(), True)).alias("lmqs_with_churn"),
        F.count(F.lit(1)).alias("groups_with_churn")).first().asDict()
    c = res["consumers"].agg(F.sum("suspicions").alias("suspicions"),
                             F.count(F.when(col("suspected_now"), True)).alias("suspected_now")).first().asDict()
    # a queue whose journal is off (lmqs by default) has no history for the audit to read
    q = tables["queues"].agg(F.count(F.lit(1)).alias("queues"),
                             F.count(F.when(col("kind") == "lmq", True)).alias("lmqs"),
                             F.count(F.when(F.coalesce(col("journal_cap"), F.lit(0)) == 0, True))
                             .alias("not_audited"),
                             F.sum("scheduled").alias("scheduled"),  # null in snapshots before version 3: 0
                             F.count(F.when(col("priority"), True)).alias("priority_queues")).first().asDict()
    coverage = _rows(res["audit_coverage"].orderBy("kind", "journal"))
    totals = {**q, "groups": counts["backlog"], "members": tables["members"].count(), "journal_events": sum(r["journal_events"] or 0 for r in coverage),
              **b, **a, **p, **c}
    totals = {k: (0 if v is None and k != "max_oldest_unacked_age_ms" else v) for k, v in totals.items()}
    audit: dict[str, Any] = {name[len("audit_"):]: counts[name] for name in AUDITS}
    verdict = "PASS" if not any(audit.values()) else "FAIL"
    history = [r for r in coverage if r["journal"]]
    scope = {
        "history": {"queues": sum(r["queues"] for r in history),
                    "journal_events": sum(r["journal_events"] or 0 for r in history),
                    "by_kind": {r["kind"]: r["queues"] for r in history}},
        "state": {"queues": sum(r["queues"] for r in coverage), "checkouts": sum(r["checkouts"] for r in coverage),
                  "marked_members": sum(r["marked_members"] for r in coverage),
                  "by_kind": {k: sum(r["queues"] for r in coverage if r["kind"] == k)
                              for k in sorted({r["kind"] for r in coverage})}},
        "history_not_checked": {r["kind"]: r["queues"] for r in coverage if not r["journal"]},
    }
    checks = []
    for table, fence, what, kind in AUDIT_CHECKS:
        on = scope[kind]
        checks.append({"check": table[len("audit_"):], "fence": fence, "what": what, "kind": kind,
                       "queues": on["queues"], "over": (f"{on['journal_events']} journal events" if kind == "history"
                                                        else f"{on['checkouts']} checkouts"),
                       "violations": counts[table], "table": table})
    summary: dict[str, Any] = {
        "snapshot": str(snapshot_dir),
        "snapshot_created": manifest.get("created"),
        "source": manifest.get("source"),
        "out": str(out),
        "report": str(out / "report.html") if report else None,
        "tables": counts,
        "totals": totals,
        "audit": {"verdict": verdict, **audit, "checks": checks, "scope": scope},
        "chain": manifest.get("chain"),
        "journal_bucketed": manifest["journal_bucketed"],  # read in its buckets, not shuffled
    }

    timings["summary"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    if report:
        step("drawing the report")
        try:
            from fencemq.spark import report as html
        except ImportError:  # run as a file (spark-submit spark/analytics.py): its directory is on sys.path
            import report as html  # type: ignore[no-redef]
        age = res["backlog"].where(col("oldest_unacked_age_ms").isNotNull())
        ages = {r["bucket"]: r["groups"] for r in _rows(
            age.groupBy(_age_bucket(col("oldest_unacked_age_ms")).alias("bucket"))
            .agg(F.count(F.lit(1)).alias("groups")))}
        data = {
            "age_histogram": [(label, ages.get(i, 0)) for i, (_, label) in enumerate(AGE_BUCKETS)],
            "delivery_counts": _rows(res["delivery_counts"].orderBy("acquisitions")),
            "events": _rows(res["events"].orderBy(col("count").desc())),
            "backlog": _rows(res["backlog"].orderBy(col("backlog").desc(), "queue", "group"), report_rows),
            "oldest": _rows(age.orderBy(col("oldest_unacked_age_ms").desc(), "queue", "group"), report_rows),
            "consumers": _rows(res["consumers"].where((col("lock_expiries") > 0) | col("suspected_now"))
                               .orderBy(col("lock_expiries").desc(), "queue", "group", "member"), report_rows),
            "preemptions": _rows(res["preemptions"].orderBy(
                (col("preemptions") + col("evictions")).desc(), "queue", "group"), report_rows),
            "seeks": _rows(res["seeks"].orderBy(col("seeks").desc(), "queue", "group"), report_rows),
            "backlog_by_topic": _rows(res["backlog_by_topic"].orderBy(col("backlog").desc()), report_rows),
        }
        data["redeliveries"] = _rows(res["redeliveries"].where(col("redeliveries") > 0)
                                     .orderBy(col("redeliveries").desc(), "queue", "group"), report_rows)
        data["audit_coverage"] = coverage
        order = {"audit_double_ack": ["first_seq"], "audit_marked_holding": ["tag"], "audit_stale_checkout": ["tag"]}
        for name in AUDITS:
            data[name] = _rows(res[name].orderBy("queue", "group", *order.get(name, ["seq"])), report_rows)
        html.render(out, summary, manifest, data)
    timings["report"] = round(time.perf_counter() - t0, 2)
    summary["timings"] = timings
    summary["seconds"] = round(time.perf_counter() - started, 3)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spark", description="FenceMQ snapshot analytics (PySpark)")
    parser.add_argument("snapshot", help="a directory written by `fencemq snapshot`")
    parser.add_argument("--out", help="where to write the results (default: SNAPSHOT/analysis)")
    parser.add_argument("--master", default=None,
                        help="Spark master (default: local[*], or whatever spark-submit set)")
    parser.add_argument("--shuffle-partitions", type=int, default=8)
    parser.add_argument("--driver-memory", default=None, help="e.g. 4g (local mode: before the JVM starts)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--no-report", action="store_true", help="skip report.html and its plots")
    args = parser.parse_args(argv)
    # Under spark-submit (it starts the gateway) its --master holds unless --master is given here.
    master = args.master or (None if "PYSPARK_GATEWAY_PORT" in os.environ else "local[*]")
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    running = SparkContext._active_spark_context is not None  # one per process: reuse, leave running
    spark = (SparkSession.builder.getOrCreate() if running else
             build_session(master, shuffle_partitions=args.shuffle_partitions, driver_memory=args.driver_memory,
                           conf={"spark.ui.showConsoleProgress": "false"}, small_input=is_small(args.snapshot)))
    try:
        summary = analyze(spark, args.snapshot, args.out, report=not args.no_report)
    except AnalyticsError as exc:
        print(f"analyze: {exc}", file=sys.stderr)
        return 1
    finally:
        if not running:
            spark.stop()
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        audit = summary["audit"]
        print(f"fence audit: {audit['verdict']} (" + ", ".join(
            f"{c['check']}={c['violations']}" for c in audit["checks"]) + ")")
        print(f"results in {summary['out']}" + (f"; report {summary['report']}" if summary["report"] else ""))
    return 0 if summary["audit"]["verdict"] == "PASS" else 3


if __name__ == "__main__":
    sys.exit(main())
