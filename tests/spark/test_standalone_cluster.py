"""`fencemq analyze --master spark://…` on a real Spark standalone cluster: a master and one worker
started from pyspark's own distribution on this machine (no Spark install beyond the pip package).

It takes a minute or more (two JVMs start, then the job's driver and executor), so `make test`
leaves it out: `make test-spark-cluster` (run by .ci/run after `make test`) sets
FENCEMQ_SPARK_CLUSTER=1. Skipped, with the reason, when Java is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fencemq.server.embedded import free_port
from tests.ops.test_snapshot import run, snapshot_to
from tests.spark.test_analytics import lite_churn_workload

pyspark = pytest.importorskip("pyspark", reason="the [spark] extra (pyspark) is not installed")

pytestmark = [
    pytest.mark.skipif(os.environ.get("FENCEMQ_SPARK_CLUSTER") != "1",
                       reason="a standalone Spark cluster takes a minute: `make test-spark-cluster` runs it"),
    pytest.mark.skipif(shutil.which("java") is None and not os.environ.get("JAVA_HOME"),
                       reason="Java is missing (no java on PATH, no JAVA_HOME): Spark cannot start"),
    pytest.mark.timeout(600),
]

SPARK_HOME = Path(pyspark.__file__).parent


@dataclass
class Standalone:
    url: str  # spark://127.0.0.1:PORT
    ui: str  # the master's web UI, whose /json lists workers and applications

    def state(self) -> dict:
        with urllib.request.urlopen(f"{self.ui}/json", timeout=5) as r:
            return json.loads(r.read())


def _alive_workers(cluster: Standalone) -> int:
    """How many workers the master lists; 0 while its UI cannot say yet. Spark starts the UI's Jetty
    first and attaches its pages after, so a GET in between is a 404 (seen once in CI), not a failure."""
    try:
        return int(cluster.state().get("aliveworkers", 0))
    except (OSError, ValueError):  # urllib's URLError (a 404 too) is an OSError
        return 0


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _spark_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ, SPARK_HOME=str(SPARK_HOME), PYSPARK_PYTHON=sys.executable,
               PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1", SPARK_LOG_DIR=str(tmp / "logs"),
               SPARK_WORKER_DIR=str(tmp / "work"), SPARK_NO_DAEMONIZE="1")
    env.pop("PYSPARK_GATEWAY_PORT", None)
    return env


@pytest.fixture(scope="module")
def standalone(tmp_path_factory) -> Iterator[Standalone]:
    tmp = tmp_path_factory.mktemp("spark-standalone")
    env = _spark_env(tmp)
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    port, ui_port, worker_ui = free_port(), free_port(), free_port()
    procs: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> None:
        log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 — open while the process runs
        procs.append(subprocess.Popen([spark_class, *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in tmp.glob("*.log"))

    try:
        start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
              "--webui-port", str(ui_port))
        cluster = Standalone(f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{ui_port}")
        deadline = time.monotonic() + 180
        while not (_listening(port) and _listening(ui_port)):
            assert time.monotonic() < deadline and procs[0].poll() is None, f"the master did not start\n{logs()}"
            time.sleep(0.5)
        start("worker", "org.apache.spark.deploy.worker.Worker", cluster.url, "--host", "127.0.0.1",
              "--cores", "2", "--memory", "2g", "--webui-port", str(worker_ui), "--work-dir", str(tmp / "work"))
        while _alive_workers(cluster) < 1:
            assert time.monotonic() < deadline and procs[1].poll() is None, f"the worker did not register\n{logs()}"
            time.sleep(0.5)
        yield cluster
    finally:
        for p in reversed(procs):  # only the processes this fixture started, by their own process group
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def test_fencemq_analyze_runs_on_a_standalone_cluster_and_reports_the_lmq_churn(
        standalone: Standalone, redis_url: str, tmp_path: Path) -> None:
    run(lite_churn_workload(redis_url))
    snap, out = tmp_path / "snap", tmp_path / "analysis"
    run(snapshot_to(redis_url, snap))

    fencemq = Path(sys.executable).parent / "fencemq"
    cmd = [str(fencemq)] if fencemq.exists() else [sys.executable, "-m", "fencemq.cli.main"]
    res = subprocess.run([*cmd, "analyze", str(snap), "--master", standalone.url, "--out", str(out), "--json"],
                         env=_spark_env(tmp_path), capture_output=True, text=True, timeout=500, check=False)
    assert res.returncode == 0, res.stderr[-4000:]
    summary = json.loads(res.stdout)
    t = summary["totals"]
    assert (t["preemptions"], t["evictions"], t["lmqs_with_churn"]) == (4, 1, 3)
    assert summary["audit"]["verdict"] == "PASS" and summary["journal_bucketed"]  # the catalog is the driver's
    assert (out / "report.html").is_file()

    # the job ran on the cluster's worker, not in a local master of the CLI's own
    apps = standalone.state()
    ran = [a for a in apps.get("completedapps", []) + apps.get("activeapps", []) if a["name"] == "fencemq-analyze"]
    assert ran, apps
    assert ran[0]["cores"] >= 1
