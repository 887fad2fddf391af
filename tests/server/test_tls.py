"""TLS on both sides: clients → worker (optionally mutual), worker → Redis (rediss://).

Certificates come from a throwaway CA (``trustme``): a server certificate for
127.0.0.1/localhost, used by the worker and by the TLS Redis, and a client
certificate for mutual TLS.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
import trustme
from typer.testing import CliRunner

from fencemq import ConnectionLost, SyncClient
from fencemq.config import Config
from fencemq.server.embedded import EmbeddedRedis, free_port
from fencemq.errors import BadArgument
from fencemq.server.runner import WorkerThread
from fencemq.server.worker import Worker
from fencemq.cli.main import app
from tests.helpers import worker
from tests.cli.test_cli import ROOT, _read_until


class Files:
    def __init__(self, root: Path) -> None:
        ca = trustme.CA()
        server = ca.issue_cert("127.0.0.1", "localhost")
        client = ca.issue_cert("fencemq-client@example.test")
        other_ca = trustme.CA()
        self.ca = root / "ca.pem"
        self.other_ca = root / "other-ca.pem"
        self.cert, self.key = root / "server.pem", root / "server.key"
        self.client_cert, self.client_key = root / "client.pem", root / "client.key"
        ca.cert_pem.write_to_path(str(self.ca))
        other_ca.cert_pem.write_to_path(str(self.other_ca))
        server.cert_chain_pems[0].write_to_path(str(self.cert))
        server.private_key_pem.write_to_path(str(self.key))
        client.cert_chain_pems[0].write_to_path(str(self.client_cert))
        client.private_key_pem.write_to_path(str(self.client_key))


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return Files(tmp_path_factory.mktemp("tls"))


def tls_url(port: int, ca: Path, **extra: Path) -> str:
    query = "&".join(f"{k}={quote(str(v))}" for k, v in {"ssl_ca_certs": ca, **extra}.items())
    return f"rediss://127.0.0.1:{port}?{query}"


def round_trip(url: str, client_id: str) -> None:
    with SyncClient.connect(url, client_id=client_id) as c:
        sub = c.subscribe(f"tls-{client_id}", start="earliest")
        c.publish(f"tls-{client_id}", b"over tls")
        (d,) = sub.pull(1)
        assert d.payload == b"over tls" and sub.ack(d) == 1


def test_a_tls_worker_serves_the_sdk_over_tls(redis_url: str, tls: Files) -> None:
    with worker(redis_url, tls_cert_file=str(tls.cert), tls_key_file=str(tls.key)) as w:
        round_trip(tls_url(w.port, tls.ca), "tls-a")


def test_a_plain_client_gets_nothing_from_a_tls_worker_and_the_worker_serves_on(redis_url: str, tls: Files) -> None:
    with worker(redis_url, tls_cert_file=str(tls.cert), tls_key_file=str(tls.key)) as w:
        with socket.create_connection(("127.0.0.1", w.port), timeout=5) as plain:
            plain.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = plain.recv(100)
            assert b"PONG" not in reply  # a TLS alert or a closed connection, never a RESP reply
        round_trip(tls_url(w.port, tls.ca), "tls-after-plain")


def test_a_client_that_does_not_trust_the_workers_ca_cannot_connect(redis_url: str, tls: Files) -> None:
    with worker(redis_url, tls_cert_file=str(tls.cert), tls_key_file=str(tls.key)) as w:
        with pytest.raises(ConnectionLost):
            SyncClient.connect(tls_url(w.port, tls.other_ca), client_id="distrustful")


def test_mutual_tls_refuses_a_client_without_a_certificate_and_serves_one_with(redis_url: str, tls: Files) -> None:
    settings = {"tls_cert_file": str(tls.cert), "tls_key_file": str(tls.key), "tls_ca_file": str(tls.ca)}
    with worker(redis_url, **settings) as w:
        with pytest.raises(ConnectionLost):
            round_trip(tls_url(w.port, tls.ca), "no-cert")
        round_trip(tls_url(w.port, tls.ca, ssl_certfile=tls.client_cert, ssl_keyfile=tls.client_key), "with-cert")


@pytest.mark.parametrize("settings", [
    {"tls_cert_file": "cert.pem"},
    {"tls_key_file": "key.pem"},
    {"tls_ca_file": "ca.pem"},
])
def test_incomplete_tls_settings_are_refused_before_the_worker_starts(settings: dict[str, str]) -> None:
    with pytest.raises(BadArgument, match="tls_cert_file"):
        Worker(Config(redis_url="redis://127.0.0.1:1/0", **settings))


def test_a_worker_reaches_redis_over_tls(tls: Files) -> None:
    tls_port = free_port()
    args = ["--tls-port", str(tls_port), "--tls-cert-file", str(tls.cert), "--tls-key-file", str(tls.key),
            "--tls-ca-cert-file", str(tls.ca), "--tls-auth-clients", "no"]
    try:
        server = EmbeddedRedis(extra_args=args).start()
    except Exception as exc:  # noqa: BLE001 - a server built without TLS says so at start
        pytest.skip(f"this Redis/Valkey binary does not start with TLS: {exc}")
    try:
        url = tls_url(tls_port, tls.ca).replace("?", "/0?")
        context = ssl.create_default_context(cafile=str(tls.ca))
        with socket.create_connection(("127.0.0.1", tls_port), timeout=5) as raw, \
                context.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            assert s.recv(100) == b"+PONG\r\n", "the server's TLS port answers"
        w = WorkerThread(Config(redis_url=url, port=0)).start()
        try:
            round_trip(f"redis://127.0.0.1:{w.port}", "via-tls-redis")
        finally:
            w.stop()
    finally:
        server.stop()


def test_fencemq_serve_takes_the_tls_options(redis_url: str, tls: Files) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "--port", "0", "--redis-url", redis_url,
         "--tls-cert", str(tls.cert), "--tls-key", str(tls.key)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = next(ln for ln in _read_until(proc, "listening on", 30).splitlines() if "listening on" in ln)
        port = int(line.split("listening on 127.0.0.1:")[1].split(",")[0])
        assert ", TLS (redis:" in line
        round_trip(tls_url(port, tls.ca), "via-cli")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_fencemq_serve_refuses_half_a_tls_setting(tls: Files) -> None:
    result = CliRunner().invoke(app, ["serve", "--tls-cert", str(tls.cert), "--port", "0"])
    assert result.exit_code == 1
    assert "TLS needs both tls_cert_file and tls_key_file" in result.stderr
