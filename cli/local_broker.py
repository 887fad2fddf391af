"""Where `fencemq serve` tells the CLI on the same machine about the private Redis it started.

`fencemq serve` without a Redis URL starts a private Redis on a free port, with a random password.
While it runs, it keeps a record of it — ``serve-<pid>.json``: the Redis URL (password included),
the key prefix, the worker's address — in a directory only its user may enter:
``$FENCEMQ_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/fencemq``, else ``<tmp>/fencemq-<uid>``
(made with mode 0700; a directory there that is not ours alone is not used). The record is
written 0600 and removed when serve stops; one left by a serve that was killed is removed by
the next reader, which checks that its process still lives.

An operator command given no --redis-url and no $FENCEMQ_REDIS_URL uses the one local broker
recorded there, and says so on stderr; with several it names them and asks for --redis-url.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ENV_RUNTIME_DIR = "FENCEMQ_RUNTIME_DIR"
PATTERN = "serve-*.json"


@dataclass(frozen=True)
class LocalBroker:
    path: Path
    pid: int
    redis_url: str
    prefix: str
    worker: str  # host:port of the worker that serve runs
    started: str


def runtime_dir() -> Path:
    if os.environ.get(ENV_RUNTIME_DIR):
        return Path(os.environ[ENV_RUNTIME_DIR])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "fencemq"
    return Path(tempfile.gettempdir()) / f"fencemq-{os.getuid()}"


def _private_dir(create: bool) -> Path | None:
    """The runtime directory if it is ours alone (a directory, not a link, ours, mode 0700), else None."""
    d = runtime_dir()
    if create:
        try:
            d.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            pass
        except OSError:
            return None
    try:
        st = d.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return d


def _serve_runs(pid: int) -> bool:
    """Whether our user still has a process ``pid`` (another user's has the pid of a serve long gone)."""
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


@contextmanager
def recorded(redis_url: str, prefix: str, worker: str) -> Iterator[Path | None]:
    """Keep a record of this process's private Redis while the block runs (None: no private
    directory to keep it in; the CLI then needs --redis-url, as before)."""
    d = _private_dir(create=True)
    if d is None:
        yield None
        return
    path = d / f"serve-{os.getpid()}.json"
    record = {"pid": os.getpid(), "redis_url": redis_url, "prefix": prefix, "worker": worker,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        path.unlink(missing_ok=True)  # a stale one of a dead process that had our pid
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(record, out)
    except OSError:
        yield None
        return
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def running() -> list[LocalBroker]:
    """The local brokers recorded by serves that still run (records of dead ones are removed)."""
    d = _private_dir(create=False)
    if d is None:
        return []
    found = []
    for path in sorted(d.glob(PATTERN)):
        try:
            raw = json.loads(path.read_text())
            broker = LocalBroker(path, int(raw["pid"]), str(raw["redis_url"]), str(raw.get("prefix") or "fmq"),
                                 str(raw.get("worker", "?")), str(raw.get("started", "?")))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written right now, or not one of ours: not ours to judge
        if _serve_runs(broker.pid):
            found.append(broker)
        else:
            path.unlink(missing_ok=True)
    return found
