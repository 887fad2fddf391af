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
``--py-files spark/result_tables.py,spark/report.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

try:
    from fencemq.spark.result_tables import RESULT_TABLES, compute
except ImportError:  # run as a file (spark-submit spark/analytics.py): its directory is on sys.path
    from result_tables import RESULT_TABLES, compute  # type: ignore[no-redef]

__all__ = ["AGE_BUCKETS", "RESULT_TABLES", "AnalyticsError", "analyze", "build_session", "load_tables", "main"]

SCHEMA_VERSION = 1
SNAPSHOT_TABLES = ("queues", "groups", "members", "checkouts", "ready", "journal")
AUDITS = ("audit_evicted_out", "audit_stale_epoch", "audit_double_ack")
AGE_BUCKETS = ((1_000, "< 1 s"), (10_000, "1-10 s"), (60_000, "10 s-1 min"), (600_000, "1-10 min"),
               (3_600_000, "10 min-1 h"), (86_400_000, "1 h-1 d"), (None, "> 1 d"))


class AnalyticsError(Exception):
    """A problem the user can fix (no snapshot there, wrong schema version)."""


def build_session(master: str | None = "local[*]", *, shuffle_partitions: int = 8,
                  driver_memory: str | None = None, conf: dict[str, str] | None = None,
                  app_name: str = "fencemq-analyze"):
    """A SparkSession (or the running one: Spark allows one per process).

    ``master`` None keeps the one spark-submit configured.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    builder = (builder
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.adaptive.enabled", "true"))
    if driver_memory:
        builder = builder.config("spark.driver.memory", driver_memory)
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def load_tables(spark, snapshot_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, {table: DataFrame}) of a finished snapshot."""
    root = Path(snapshot_dir)
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        raise AnalyticsError(f"no snapshot at {root} (manifest.json missing); take one with "
                             f"`fencemq snapshot --out {root}`")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise AnalyticsError(f"snapshot at {root} has schema version {manifest.get('schema_version')!r}; "
                             f"this job reads version {SCHEMA_VERSION}")
    tables = {}
    for name in SNAPSHOT_TABLES:
        path = root / manifest.get("tables", {}).get(name, f"{name}.parquet")
        if not path.exists():
            raise AnalyticsError(f"snapshot at {root} lacks table {name} ({path.name})")
        tables[name] = spark.read.parquet(str(path))
    return manifest, tables


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


def analyze(spark, snapshot_dir: str | Path, out_dir: str | Path | None = None, *, report: bool = True,
            report_rows: int = 50, partitions: int | None = None) -> dict[str, Any]:
    """Run the job; returns the summary (also written to ``summary.json``)."""
    from pyspark.sql import functions as F

    started = time.perf_counter()
    snapshot_dir = Path(snapshot_dir)
    out = Path(out_dir) if out_dir is not None else snapshot_dir / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    manifest, tables = load_tables(spark, snapshot_dir)
    persisted: list[Any] = []
    partitions = partitions or int(spark.conf.get("spark.sql.shuffle.partitions"))
    # Joins on (queue, group[, member]) of frames hash-partitioned by queue alone need no shuffle.
    co_partition = "spark.sql.requireAllClusterKeysForCoPartition"
    before = spark.conf.get(co_partition, None)
    spark.conf.set(co_partition, "false")
    try:
        results = compute(tables, partitions, persisted)
        for name in RESULT_TABLES:
            results[name].write.mode("overwrite").parquet(str(out / name))
    finally:
        for df in persisted:
            df.unpersist()
        if before is None:
            spark.conf.unset(co_partition)
        else:
            spark.conf.set(co_partition, before)
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
        "outs", "redeliveries", "acks", "nacks", "discards", "dead_letters", "timeouts", "preemptions",
        "evictions", "fenced_pulls", "seeks")]).first().asDict()
    c = res["consumers"].agg(F.sum("suspicions").alias("suspicions"),
                             F.count(F.when(col("suspected_now"), True)).alias("suspected_now")).first().asDict()
    # a queue whose journal is off (lmqs by default) has nothing for the audit to read
    q = tables["queues"].agg(F.count(F.lit(1)).alias("queues"),
                             F.count(F.when(col("kind") == "lmq", True)).alias("lmqs"),
                             F.count(F.when(col("journal_cap") == 0, True)).alias("not_audited")).first().asDict()
    totals = {**q, "groups": counts["backlog"], "members": tables["members"].count(),
              "journal_events": tables["journal"].count(), **b, **a, **c}
    totals = {k: (0 if v is None and k != "max_oldest_unacked_age_ms" else v) for k, v in totals.items()}
    audit = {name[len("audit_"):]: counts[name] for name in AUDITS}
    verdict = "PASS" if not any(audit.values()) else "FAIL"
    summary: dict[str, Any] = {
        "snapshot": str(snapshot_dir),
        "snapshot_created": manifest.get("created"),
        "source": manifest.get("source"),
        "out": str(out),
        "report": str(out / "report.html") if report else None,
        "tables": counts,
        "totals": totals,
        "audit": {"verdict": verdict, **audit},
    }

    if report:
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
        for name in AUDITS:
            data[name] = _rows(res[name].orderBy("queue", "group", *(
                ["first_seq"] if name == "audit_double_ack" else ["seq"])), report_rows)
        html.render(out, summary, manifest, data)
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
                           conf={"spark.ui.showConsoleProgress": "false"}))
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
        print(f"fence audit: {audit['verdict']} (evicted_out={audit['evicted_out']}, "
              f"stale_epoch={audit['stale_epoch']}, double_ack={audit['double_ack']})")
        print(f"results in {summary['out']}" + (f"; report {summary['report']}" if summary["report"] else ""))
    return 0 if summary["audit"]["verdict"] == "PASS" else 3


if __name__ == "__main__":
    sys.exit(main())
