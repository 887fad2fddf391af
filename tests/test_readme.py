"""The README's command blocks run as written.

Each fenced block is taken from README.md in order and run the way a reader
would, in a fresh shell — the PATH as the test found it, nothing added: ``sh``
blocks line by line in a shell (``make`` lines as a dry run, since ``make
test`` runs this very test; a line ending in ``&`` in the background; a line
the README calls live until interrupted; a line whose comment says it exits N
must exit N, any other 0; a line it calls optional is left out, as a newcomer
would), a redis-cli transcript (lines after a ``127.0.0.1:7379>`` prompt)
typed into the ``redis-cli`` the block before it opened, each reply held
against the one the README shows, and a ``python`` block run by the Python
that has fencemq's dependencies. What the reader fills in is filled in:
``redis://…`` is this test's Redis, port 7379 a free port, ``<field>`` the
value of ``field`` in a reply above, and ``…`` in a reply stands for whatever
the server says there. The reader works in a scratch directory, so
``.venv/bin/`` (relative to the repository, where the reader stands) is the
venv that runs this test.
"""

from __future__ import annotations

import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from tests.helpers import Terminal, free_port

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "127.0.0.1:7379> "
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LIVE = re.compile(r"#.*\blive\b")
OPTIONAL = re.compile(r"#\s*optional\b")
EXIT = re.compile(r"#.*\bexits? (\d+)\b")


def blocks(text: str) -> list[tuple[str, list[str]]]:
    return [(kind, body.splitlines()) for kind, body in BLOCK.findall(text)]


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


class Reader:
    """Runs what the README says, as a reader at a shell would, in a scratch directory."""

    def __init__(self, redis_url: str, cwd: Path) -> None:
        self.port = free_port()
        self.redis_url = redis_url
        self.cwd = cwd
        self.env = dict(os.environ)  # a fresh shell: PATH as it was, no FENCEMQ_* settings
        for name in [n for n in self.env if n.startswith("FENCEMQ_")]:
            del self.env[name]
        self.env["FENCEMQ_RUNTIME_DIR"] = str(cwd / "run")  # where serve records its private Redis for the CLI
        self.background: list[subprocess.Popen] = []
        self.cli: subprocess.Popen | None = None
        self.replies: list[str] = []  # every reply so far, for <field>

    def fill_in(self, line: str) -> str:
        line = line.replace("redis://…", self.redis_url).replace("7379", str(self.port))
        line = line.replace(".venv/bin/", str(Path(sys.executable).parent) + "/")

        def value(m: re.Match[str]) -> str:
            for reply in reversed(self.replies):
                found = re.search(rf'"{re.escape(m.group(1))}"\n\s*\d+\) "([^"]*)"', reply)
                if found:
                    return found.group(1)
            raise AssertionError(f"no reply above gave {m.group(0)}")

        return re.sub(r"<(\w+)>", value, line)

    def shell_line(self, line: str) -> None:
        command = line.split("  #", 1)[0].strip()
        if not command or OPTIONAL.search(line):
            return
        command = self.fill_in(command)
        words = shlex.split(command)
        if words[0] == "export":
            name, _, val = words[1].partition("=")
            self.env[name] = val
        elif words[0] == "make":
            self._run(shlex.join(["make", "-n", "--no-print-directory", "-C", str(ROOT), *words[1:]]), line)
        elif command.endswith("&"):
            self.background.append(subprocess.Popen(command[:-1], shell=True, cwd=self.cwd, env=self.env,
                                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                    start_new_session=True))
            deadline = time.monotonic() + 30
            while not _answers(self.port) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _answers(self.port), f"{line!r} did not start a worker on {self.port}"
        elif words == ["redis-cli", "-p", str(self.port)]:
            # interactive: the transcript block that follows is typed into it
            self.cli = subprocess.Popen(words[:1] + ["--no-raw"] + words[1:], cwd=self.cwd, env=self.env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        elif LIVE.search(line):
            # a live view runs on a terminal, as a person runs it (on a pipe it draws only when it ends), and ^C
            # (typed: the terminal sends it to the view's process group) once its first frame is drawn
            # PYTHONFAULTHANDLER: a view that outlives its ^C is aborted below and shows where it was
            with Terminal(*words, columns=120, rows=40, cwd=self.cwd,
                          env={**self.env, "PYTHONFAULTHANDLER": "1"}) as term:
                assert term.read_until(b"FenceMQ top", timeout=60), f"{line!r} drew no frame in 60 s:\n" \
                    + term.seen.decode(errors="replace")[-2000:]
                assert term.proc.poll() is None, f"{line!r} ended by itself: {term.seen.decode()[-2000:]}"
                interrupted = time.monotonic()
                term.type(b"\x03")
                try:
                    code = term.exit_code(timeout=30)
                except subprocess.TimeoutExpired:
                    # what ^C met: the view's signal masks, the terminal's ISIG and foreground group
                    status = [x for x in Path(f"/proc/{term.proc.pid}/status").read_text().splitlines()
                              if x.startswith("Sig")]
                    isig = bool(termios.tcgetattr(term.fd)[3] & termios.ISIG)
                    met = f"{status}, ISIG {isig}, foreground {os.tcgetpgrp(term.fd)}, view {term.proc.pid}"
                    os.killpg(term.proc.pid, signal.SIGABRT)  # the fault handler prints every thread's stack
                    term.read_until(b"\0never\0", 5)
                    stacks = term.seen.decode(errors="replace")
                    raise AssertionError(f"{line!r} still ran 30 s after ^C ({met}); its stacks:\n"
                                         + stacks[stacks.find("Fatal Python error"):][:4000]) from None
                out = term.seen.decode(errors="replace")
                print(f"{time.monotonic() - interrupted:6.1f} s  {line!r} after ^C")
                assert code in (0, 130), f"{line!r} exited {code}: {out[-2000:]}"
                assert "Traceback" not in out, out[-2000:]
        else:
            self._run(command, line)

    def _run(self, command: str, line: str) -> None:
        started = time.monotonic()
        proc = subprocess.Popen(command, shell=True, cwd=self.cwd, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=400)
        finally:
            if proc.poll() is None:  # timed out, or the test was: nothing of it may outlive the test
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        print(f"{time.monotonic() - started:6.1f} s  {command}")
        run = subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
        out = run.stdout + run.stderr
        documented = EXIT.search(line)  # "# … exit 1 when …": the README says what it exits with
        expected = int(documented.group(1)) if documented else 0
        assert run.returncode == expected, f"{line!r} exited {run.returncode}:\n{out[-3000:]}"
        if expected == 0:
            assert not re.search(r"^\(error\)|^(ERR|NOPERM|BADARG|NOTFOUND) ", out, re.M), f"{line!r}:\n{out}"
        # what the terminal would show is the command's own: no JVM or library warnings (Spark's go to spark.log)
        assert not re.search(r"\bWARN(ING)?\b|log4j|Traceback", run.stderr), f"{line!r} printed:\n{run.stderr}"
        self.replies.append(out)

    def python(self, lines: list[str]) -> None:
        code = self.fill_in("\n".join(lines))
        self._run(shlex.join([sys.executable, "-c", code]), "the python block")

    def transcript(self, lines: list[str]) -> None:
        assert self.cli is not None, "a transcript with no `redis-cli -p 7379` before it"
        steps: list[tuple[str, list[str]]] = []
        for line in lines:
            if line.startswith(PROMPT):
                steps.append((line[len(PROMPT):], []))
            else:
                assert steps, f"a reply before any command: {line!r}"
                steps[-1][1].append(line)
        for command, shown in steps:
            self.cli.stdin.write((self.fill_in(command) + "\n").encode())
            self.cli.stdin.flush()
            got = self._reply()
            self.replies.append(got)
            assert _matches(shown, got.splitlines()), f"{command!r}: the README shows\n" \
                + "\n".join(shown) + f"\nredis-cli printed\n{got}"

    def _reply(self) -> str:
        # redis-cli prints each reply whole; a short quiet spell ends it
        out = b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if select.select([self.cli.stdout], [], [], 0.3 if out else 5)[0]:
                chunk = os.read(self.cli.stdout.fileno(), 65536)
                if not chunk:
                    break
                out += chunk
            elif out:
                break
        return out.decode()

    def close(self) -> None:
        if self.cli is not None:
            self.cli.stdin.close()
            self.cli.wait(10)
        for proc in self.background:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _matches(shown: list[str], got: list[str]) -> bool:
    """The README's reply against redis-cli's: ``…`` alone is any lines, ``…`` in a line any text."""
    if not shown:
        return not got
    head, rest = shown[0], shown[1:]
    if head == "…":
        return any(_matches(rest, got[i:]) for i in range(len(got) + 1))
    if not got:
        return False
    pattern = ".*".join(re.escape(part) for part in head.split("…"))
    return re.fullmatch(pattern, got[0]) is not None and _matches(rest, got[1:])


def test_matching_a_shown_reply_allows_only_what_the_ellipses_stand_for():
    assert _matches(["1) \"…\"", "…", "(integer) 1"], ["1) \"x\"", "a", "b", "(integer) 1"])
    assert not _matches(["1) \"…\"", "(integer) 1"], ["1) \"x\"", "(integer) 2"])
    assert not _matches(["OK"], ["OK", "more"])


@pytest.mark.long  # `make test-long` (.ci/run) runs it, to keep make test short
@pytest.mark.slow
@pytest.mark.timeout(900)  # the analytics block starts a Spark JVM: a minute or more on a busy 2-core machine
@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="the README's quick start uses redis-cli")
def test_every_command_block_of_the_readme_runs_as_written(redis_url: str, tmp_path: Path) -> None:
    reader = Reader(redis_url, tmp_path)
    ran = 0
    try:
        for kind, lines in blocks((ROOT / "README.md").read_text()):
            if kind == "sh":
                for line in lines:
                    reader.shell_line(line)
                    ran += 1
            elif kind == "python":
                reader.python(lines)
                ran += 1
            elif lines and lines[0].startswith(PROMPT):
                reader.transcript(lines)
                ran += 1
    finally:
        reader.close()
    assert ran > 15, "the README has fewer command lines than it used to: was a block's fence changed?"
    assert (tmp_path / "report" / "report.html").exists(), "the analytics block made no report"
    found = [r for r in reader.replies if "the broker of `fencemq serve` here" in r]
    assert len(found) >= 10, "the operating section's commands did not find the quick start's broker by themselves"
