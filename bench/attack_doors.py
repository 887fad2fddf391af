"""The attacks of bench.attacks at the other doors of a worker: MQTT (3.1.1 and 5.0 share one listener)
and the web UI (``serve --http-port``), and the password-hashing attack at all three.

Each attack takes the worker's ports (``Ports``) and the scale, and returns what it observed;
bench.attacks runs them beside a well-behaved client and adds the worker's RSS. Wrong passwords
come from 50 client addresses at once (127.0.0.2 …: the loopback network), so that the per-address
throttle does not serialize them and what bounds the worker is the gate's own limit on password
hashes at a time.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from fencemq.config import Config
from fencemq.protocol.mqtt.codec import encode
from fencemq.protocol.mqtt.packets import MQTT_5, Connect, Subscribe, SubscriptionOptions
from fencemq.protocol.mqtt.stream import MqttStreamDecoder

USER, USER_PASSWORD = "bench-user", "bench user secret"  # a user of `fencemq user`: its checks hash with scrypt
LEGACY_PASSWORD = "bench secret"  # the worker's --password (bench.attack_harness.PASSWORD)
GUESSERS = 50
MiB = 1 << 20


@dataclass
class Ports:
    resp: int
    mqtt: int
    http: int


def source(n: int) -> str:
    """A distinct client address on the loopback network: 127.0.0.2, 127.0.0.3, …"""
    return f"127.0.{(n + 2) // 250}.{(n + 2) % 250 or 1}"


def connect(port: int, n: int | None = None, timeout: float = 30) -> socket.socket:
    src = (source(n), 0) if n is not None else None
    return socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=src)


def closed(s: socket.socket, timeout: float = 10) -> bool:
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


def mqtt_connect(client_id: str, user: str | None = None, password: str | None = None) -> bytes:
    return encode(Connect(client_id, MQTT_5, True, 0, user, password.encode() if password is not None else None),
                  MQTT_5)


def connack_code(s: socket.socket, timeout: float = 60) -> int | None:
    """The reason code of the CONNACK the worker answers (None: closed without one)."""
    decoder = MqttStreamDecoder(protocol_level=MQTT_5)
    s.settimeout(timeout)
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return None
            for packet in decoder.packets(data):
                return int(packet.reason_code)
    except OSError:
        return None


def in_parallel(n: int, one: Any) -> list[Any]:
    """``one(i)`` on n threads released together; their results."""
    results: list[Any] = [None] * n
    go = threading.Event()

    def run(i: int) -> None:
        go.wait()
        try:
            results[i] = one(i)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            results[i] = repr(exc)[:120]

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(120)
    return results


# -- password hashing: 50 wrong passwords at once, from 50 addresses ---------------------------------


def resp_parallel_wrong_passwords(ports: Ports, scale: float) -> dict[str, Any]:
    """50 wrong AUTHs of a user at once, from 50 addresses (was: each one a 16 MiB scrypt hash at once)."""
    def one(i: int) -> str:
        s = connect(ports.resp, i)
        s.sendall(b"*3\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n$5\r\nwrong\r\n" % (len(USER), USER.encode()))
        s.settimeout(60)
        reply = s.recv(200)
        s.close()
        return reply.split(b" ", 1)[0].decode(errors="replace")

    started = time.monotonic()
    replies = in_parallel(GUESSERS, one)
    return {"guesses": GUESSERS, "addresses": GUESSERS, "refused": replies.count("-WRONGPASS"),
            "all_answered_s": round(time.monotonic() - started, 2)}


def mqtt_parallel_wrong_passwords(ports: Ports, scale: float) -> dict[str, Any]:
    """50 wrong MQTT CONNECT passwords of a user at once, from 50 addresses."""
    def one(i: int) -> int | None:
        s = connect(ports.mqtt, i)
        s.sendall(mqtt_connect(f"guess-{i}", USER, "wrong"))
        code = connack_code(s)
        s.close()
        return code

    started = time.monotonic()
    codes = in_parallel(GUESSERS, one)
    return {"guesses": GUESSERS, "addresses": GUESSERS, "refused_0x86": codes.count(0x86),
            "all_answered_s": round(time.monotonic() - started, 2)}


def ui_parallel_wrong_passwords(ports: Ports, scale: float) -> dict[str, Any]:
    """50 wrong UI logins of a user at once, from 50 addresses."""
    # the clients are made first: an httpx client costs tens of ms of this process's CPU to make
    clients = [httpx.Client(transport=httpx.HTTPTransport(local_address=source(i)), timeout=60)
               for i in range(GUESSERS)]

    def one(i: int) -> int:
        return clients[i].post(f"http://127.0.0.1:{ports.http}/login",
                               data={"user": USER, "password": "wrong", "next": "/"}).status_code

    started = time.monotonic()
    codes = in_parallel(GUESSERS, one)
    for http in clients:
        http.close()
    return {"guesses": GUESSERS, "addresses": GUESSERS, "refused_401": codes.count(401),
            "all_answered_s": round(time.monotonic() - started, 2)}


# -- before authentication ---------------------------------------------------------------------


def mqtt_unauthenticated_connects(ports: Ports, scale: float) -> dict[str, Any]:
    """100 connections each announce a CONNECT of 1 MB before any authentication and send all of it but
    its last byte (was: each held, RESP allowing 16 KiB)."""
    size = 1_000_000
    header = bytes([0x10, 0xBF, 0x84, 0x3D])  # Remaining Length 999,999: a 1,000,003-byte CONNECT
    socks, refused_at_once = [], 0
    for _ in range(int(100 * scale) or 1):
        s = connect(ports.mqtt)
        s.sendall(header)
        if closed(s, timeout=0.5):
            refused_at_once += 1
        else:
            send_all_but_one(s, size - 1)
        socks.append(s)
    time.sleep(1)
    for s in socks:
        s.close()
    return {"connections": len(socks), "connect_bytes": size, "closed_from_the_header": refused_at_once}


def send_all_but_one(s: socket.socket, n: int) -> None:
    try:
        s.sendall(b"Q" * n)
    except OSError:
        pass


def ui_unauthenticated_logins(ports: Ports, scale: float) -> dict[str, Any]:
    """10 login forms of 50 MB each (was: read whole before the password was looked at)."""
    size = int(50_000_000 * scale)
    refused = 0
    for _ in range(10):
        with httpx.Client(timeout=30) as http:
            try:
                r = http.post(f"http://127.0.0.1:{ports.http}/login", content=b"user=x&password=" + b"Q" * size,
                              headers={"content-type": "application/x-www-form-urlencoded"})
                refused += r.status_code == 413
            except httpx.HTTPError:
                refused += 1  # closed on it
    return {"requests": 10, "body_bytes": size, "refused_413": refused}


def mqtt_slowloris(ports: Ports, scale: float, auth_timeout_ms: int = 2000) -> dict[str, Any]:
    """300 MQTT connections that never send a CONNECT (was: held 10 s whatever auth_timeout_ms said)."""
    socks = [connect(ports.mqtt) for _ in range(300)]
    for s in socks:
        s.sendall(b"\x10\x20")  # a CONNECT begun, never finished
    time.sleep(auth_timeout_ms / 1000 + 1)
    still_open = sum(not closed(s, timeout=0.05) for s in socks)
    for s in socks:
        s.close()
    return {"connections": 300, "open_after_auth_timeout": still_open}


def mqtt_guessing(ports: Ports, scale: float) -> dict[str, Any]:
    """Wrong MQTT passwords from one address as fast as it goes, 5 s (a refused CONNECT closes its connection)."""
    attempts, started = 0, time.monotonic()
    while time.monotonic() - started < 5:
        s = connect(ports.mqtt)
        s.sendall(mqtt_connect(f"g{attempts}", USER, f"guess{attempts}"))
        connack_code(s, timeout=10)
        s.close()
        attempts += 1
    return {"attempts": attempts, "attempts_per_s": round(attempts / (time.monotonic() - started), 1)}


def ui_guessing(ports: Ports, scale: float) -> dict[str, Any]:
    """Wrong UI passwords from one address as fast as it goes, 5 s."""
    attempts, started = 0, time.monotonic()
    with httpx.Client(timeout=30) as http:
        while time.monotonic() - started < 5:
            http.post(f"http://127.0.0.1:{ports.http}/login", data={"user": USER, "password": f"guess{attempts}"})
            attempts += 1
    return {"attempts": attempts, "attempts_per_s": round(attempts / (time.monotonic() - started), 1)}


def mqtt_not_reading(ports: Ports, scale: float, password: str = "", output_timeout_ms: int = 2000) -> dict[str, Any]:
    """An MQTT subscriber that never reads while 100 MB is published to it (was: ~124 MiB held, never closed)."""
    import redis

    s = connect(ports.mqtt)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(mqtt_connect("not-reading", "default", password))
    assert connack_code(s) == 0, "the subscriber was not let in"
    s.sendall(encode(Subscribe(1, (("flood/#", SubscriptionOptions(0)),)), MQTT_5))
    time.sleep(0.3)
    r = redis.Redis(port=ports.resp, password=password or None, socket_timeout=30)
    payload = b"z" * 60_000
    n = int(1700 * scale)
    for start in range(0, n, 50):
        r.execute_command("MPUB", "flood/x", min(50, n - start), *([payload] * min(50, n - start)))
    time.sleep(output_timeout_ms / 1000 + 2)
    r.close()
    s.close()  # whether the worker closed it first, its log says (bench.attacks)
    return {"published_bytes": n * 60_000}


# name, attack, the bytes its budget allows above the idle worker: on a worker that serves RESP, MQTT and
# the UI, with users (a user's password check hashes with scrypt, ~16 MiB).
SCRYPT = 16 * MiB
PASSWORD_CHECKS = getattr(Config(), "max_password_checks", 2)  # (a worker of before issue #25 had no such limit)
ATTACKS: list[tuple[str, Callable[[Ports, float], dict[str, Any]], int]] = [
    ("resp_parallel_wrong_passwords", resp_parallel_wrong_passwords,
     PASSWORD_CHECKS * SCRYPT + GUESSERS * 64 * 1024),
    ("mqtt_parallel_wrong_passwords", mqtt_parallel_wrong_passwords,
     PASSWORD_CHECKS * SCRYPT + GUESSERS * 64 * 1024),
    ("ui_parallel_wrong_passwords", ui_parallel_wrong_passwords,
     PASSWORD_CHECKS * SCRYPT + GUESSERS * 64 * 1024),
    ("mqtt_unauthenticated_connects", mqtt_unauthenticated_connects, 100 * 2 * 16_384 + 100 * 2 * 65_536),
    ("ui_unauthenticated_logins", ui_unauthenticated_logins, 10 * 2 * 16_384 + 10 * 2 * 65_536),
    ("mqtt_slowloris", mqtt_slowloris, 300 * 64 * 1024),
    ("mqtt_guessing", mqtt_guessing, 8 * MiB),
    ("ui_guessing", ui_guessing, 8 * MiB),
    ("mqtt_not_reading", lambda ports, scale: mqtt_not_reading(ports, scale, LEGACY_PASSWORD),
     2 * 64 * 60_000 + 64 * MiB),
]
