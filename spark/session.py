"""The SparkSession the analytics job runs in, and its settings for small snapshots.

Spark's fixed costs per query (planning, code generation, the JVM's JIT compiling for a long run)
are the whole cost of analysing a small snapshot: such a snapshot is analysed with settings for
small inputs (spark/analytics.py applies them; the CLI starts its JVM for a short job), the same
tables sooner (bench/analyze_small.py measures both side by side).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MAX_CHAIN = 10_000  # snapshots in a chain of incremental ones, at most

# A snapshot this small (rows of its largest table, its chain included) is analyzed with settings for
# small inputs: Spark's fixed costs per query (planning, code generation, JIT compilation) are then the
# job's whole cost, not its rows (bench/analyze_small.py measures both settings side by side).
SMALL_ROWS = 200_000
SMALL_INPUT_CONF = {
    "spark.sql.adaptive.enabled": "false",  # re-planning each stage buys nothing on a few rows
    "spark.sql.codegen.wholeStage": "false",  # compiling generated code costs more than it saves here
}
# The JVM's JIT: its first tier only (its second compiles for long runs; a short job pays and never gains)
SMALL_INPUT_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1"


def snapshot_rows(snapshot_dir: str | Path) -> int:
    """Rows of the largest table of a snapshot and the chain it builds on (from the manifests only)."""
    total: dict[str, int] = {}
    root, seen = Path(snapshot_dir), 0
    while seen < MAX_CHAIN:
        try:
            manifest = json.loads((root / "manifest.json").read_text())
        except (OSError, ValueError):
            break  # analyze() says what is wrong with it
        for name, rows in (manifest.get("counts") or {}).items():
            total[name] = total.get(name, 0) + int(rows or 0)
        if not manifest.get("base"):
            break
        root, seen = root / manifest["base"], seen + 1
    return max(total.values(), default=0)


def is_small(snapshot_dir: str | Path) -> bool:
    return snapshot_rows(snapshot_dir) <= SMALL_ROWS


def build_session(master: str | None = "local[*]", *, shuffle_partitions: int = 8,
                  driver_memory: str | None = None, conf: dict[str, str] | None = None,
                  app_name: str = "fencemq-analyze", small_input: bool = False):
    """A SparkSession (or the running one: Spark allows one per process).

    ``master`` None keeps the one spark-submit configured. ``small_input``: the JVMs are started for a
    short job (is_small(snapshot)): the JIT compiles for start-up, not for a long run.
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
    # The job is a batch of scans, shuffles and aggregations: the throughput collector spends less CPU
    # than G1's concurrent work (1M lmqs / 10M events on 2 CPUs: 142 JVM CPU seconds instead of 194,
    # bench/results/analyze.json). A JVM already running (spark-submit's driver) keeps its own.
    for key in ("spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions"):
        if key not in (conf or {}):
            builder = builder.config(key, "-XX:+UseParallelGC" + (f" {SMALL_INPUT_JAVA_OPTIONS}" if small_input else ""))
    # The bucketed journal is a table in the session's catalog, whose default database Spark would
    # otherwise make as an empty spark-warehouse/ in the current directory (no data goes there).
    if "spark.sql.warehouse.dir" not in (conf or {}):
        builder = builder.config("spark.sql.warehouse.dir",
                                 str(Path(tempfile.gettempdir()) / "fencemq-spark-warehouse"))
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark



@contextmanager
def settings(spark, conf: dict[str, str]) -> Iterator[None]:
    """The session's SQL settings ``conf`` while the block runs; as they were after it."""
    before = {key: spark.conf.get(key, None) for key in conf}
    for key, value in conf.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
