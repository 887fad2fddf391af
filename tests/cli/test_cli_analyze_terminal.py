"""What `fencemq analyze` shows on a terminal: one progress line, never the JVM's own output.

The JVM PySpark starts inherits the process's stdout and stderr; `analyze` points them at
spark.log while it starts (``_jvm_output_to``) and draws its progress line on a copy of the
terminal (``_progress_line``). Held here with a stand-in for the JVM — a child process that
writes warnings at start and later — so no Spark is needed; tests/test_readme.py runs the real
`fencemq analyze` and holds its stderr to the same.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

from tests.helpers import Terminal

ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")

STAND_IN = textwrap.dedent("""
    import subprocess, sys, time
    from pathlib import Path
    from fencemq.cli.analytics import _jvm_output_to, _progress_line

    log = Path(sys.argv[1])
    with _progress_line(enabled=True) as say:
        say("starting Spark (local[*])")
        with _jvm_output_to(log):
            jvm = subprocess.Popen([sys.executable, "-c",
                "import sys, time; print('WARN Utils: noisy start', file=sys.stderr, flush=True); "
                "print('Setting default log level', flush=True); time.sleep(1.5); "
                "print('WARN later, while the job runs', file=sys.stderr, flush=True)"])
            time.sleep(0.5)
        say("writing backlog (1/16)")
        time.sleep(1.0)
        jvm.wait()
        say("drawing the report")
        time.sleep(0.5)
    print("fence audit: PASS")
""")


def test_on_a_terminal_analyze_shows_a_progress_line_and_the_jvms_output_goes_to_its_log(tmp_path: Path) -> None:
    log = tmp_path / "spark.log"
    with Terminal(sys.executable, "-c", STAND_IN, str(log), columns=100) as term:
        assert term.exit_code(30) == 0, term.seen
    seen = ANSI.sub(b"", term.seen).decode()
    assert "analyze: starting Spark (local[*])" in seen and "analyze: writing backlog (1/16)" in seen, seen
    assert "fence audit: PASS" in seen
    assert "WARN" not in seen and "Setting default log level" not in seen, seen
    written = log.read_text()
    assert "WARN Utils: noisy start" in written and "WARN later, while the job runs" in written
    assert "Setting default log level" in written


def test_without_a_terminal_there_is_no_progress_line(tmp_path: Path) -> None:
    import subprocess

    run = subprocess.run([sys.executable, "-c", STAND_IN, str(tmp_path / "spark.log")], capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "fence audit: PASS\n" and run.stderr == "", (run.stdout, run.stderr)
