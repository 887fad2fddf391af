"""Regenerate docs/example-report/ (report.html + summary.json) from the scripted workloads.

    PYSPARK_PYTHON=.venv/bin/python .venv/bin/python -m bench.example_report [--out docs/example-report]

A private Redis (never 6379) gets the workload of tests/ops/test_snapshot.py (a topic with
two pulling groups, lease expiries, a dead letter, a seek, a push mailbox, QoS 0, and lmqs
with their journal on: a preemption, an eviction, a rewinding preemption) and the one of
issue #19 (tests/spark/test_analytics.py ``lite_churn_workload``: default config, so lmqs
keep no journal: 4 preemptions, an operator eviction, a fenced pull). Then a snapshot, and
the analytics job on local[2].
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "example-report")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    sys.path.insert(0, str(ROOT))
    from fencemq.server.embedded import EmbeddedRedis
    from fencemq.spark.analytics import analyze, build_session
    from tests.ops.test_snapshot import run, run_workload, snapshot_to
    from tests.spark.test_analytics import lite_churn_workload

    work = Path(tempfile.mkdtemp(prefix="fencemq-example-report-"))
    try:
        with EmbeddedRedis() as server:
            run(run_workload(server.url))
            run(lite_churn_workload(server.url))
            run(snapshot_to(server.url, work / "snapshot"))
        spark = build_session("local[2]", shuffle_partitions=2, conf={"spark.ui.showConsoleProgress": "false"})
        try:
            summary = analyze(spark, work / "snapshot", work / "analysis")
        finally:
            spark.stop()
        args.out.mkdir(parents=True, exist_ok=True)
        for old in args.out.iterdir():
            if old.is_file():
                old.unlink()
        shutil.copy(work / "analysis" / "report.html", args.out / "report.html")
        # paths of this machine's temporary directory, said as what they are
        summary.update(snapshot="snapshot/", out="analysis/", report="analysis/report.html", chain=["snapshot/"])
        summary["source"] = "redis://127.0.0.1/0 (a private server)"
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        t = summary["totals"]
        print(f"audit {summary['audit']['verdict']}; preemptions {t['preemptions']}, evictions {t['evictions']}; "
              f"wrote {args.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
