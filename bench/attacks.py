"""The hostile-client attacks of issue #16, re-measured: worker memory and a well-behaved client under each;
and (issue #25) the same at the MQTT and web UI doors, with 50 wrong passwords at once at each door
(bench.attack_doors).

    python -m bench.attacks [--out bench/results] [--scale 1.0] [--only name,name]

A worker runs in its own process (its RSS read from /proc) in front of a
private Redis, with the shipped defaults except where an attack says (a
password, so that unauthenticated attacks meet the pre-authentication
limits; shorter timeouts so that the run is short). Meanwhile a
well-behaved client does PUB + PULL + ACK round trips on its own
connection: its slowest round trip and its rounds per second during the
attack say whether it was starved. ``--scale`` shrinks the floods (0.1 for a
quick look). Writes ``<out>/attacks.json``: per attack, the worker's RSS
before and at its peak, the budget the settings give it, and the verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from bench import attack_doors
from bench.attack_doors import closed, connect
from bench.attack_harness import PASSWORD, GoodClient, Worker, add_user
from fencemq.config import Config
from fencemq.server.embedded import EmbeddedRedis

MiB = 1 << 20
SETTINGS = dict(password=PASSWORD, auth_timeout_ms=2000, request_timeout_ms=2000, output_timeout_ms=2000,
                tls_handshake_timeout_ms=2000)


def handle_of(sub_reply: bytes) -> bytes:
    """The handle in a RESP2 SUB reply (a flat map: *8, $6 handle, $n <handle>, ...)."""
    return sub_reply.split(b"\r\n")[4]


def auth(s: socket.socket) -> None:
    s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(PASSWORD), PASSWORD.encode()))
    assert s.recv(100).startswith(b"+OK"), "AUTH failed"


def cmd(*args: bytes | str) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def send_quietly(s: socket.socket, data: bytes, chunk: int = 1 << 20) -> int:
    """Send what the worker takes; the bytes it took before refusing or closing."""
    sent = 0
    try:
        for i in range(0, len(data), chunk):
            s.sendall(data[i : i + chunk])
            sent += len(data[i : i + chunk])
    except OSError:
        pass
    return sent


# -- the attacks --------------------------------------------------------------------------------------
# Each returns what it observed; the harness adds RSS and the good client's figures.


def unauthenticated_bulks(port: int, scale: float) -> dict[str, Any]:
    """10 unauthenticated connections each send a 50 MB bulk (was: RSS 866 MB)."""
    size = int(50_000_000 * scale)
    refused = 0
    for _ in range(10):
        s = connect(port)
        frame = b"*3\r\n$3\r\nPUB\r\n$6\r\norders\r\n$%d\r\n" % size
        send_quietly(s, frame + b"Q" * size)
        s.settimeout(5)
        try:
            refused += s.recv(200).startswith(b"-NOAUTH")
        except OSError:
            pass
        s.close()
    return {"connections": 10, "bulk_bytes": size, "refused_from_header": refused}


def error_echo(port: int, scale: float) -> dict[str, Any]:
    """An option word of 50 MB echoed in a BADARG (was: a 52 MB error reply, RSS 1.36 GB)."""
    s = connect(port)
    auth(s)
    big = b"Q" * int(50_000_000 * scale)
    send_quietly(s, cmd("PUB", "orders", "x", big))
    s.settimeout(10)
    reply = s.recv(1 << 20)
    s.close()
    return {"argument_bytes": len(big), "reply_bytes": len(reply), "reply": reply[:80].decode(errors="replace")}


def held_partial_bulks(port: int, scale: float) -> dict[str, Any]:
    """8 authenticated connections each declare a 60 MB bulk and send 50 MB of it (was: 514 MB)."""
    socks, refused = [], 0
    for _ in range(8):
        s = connect(port)
        auth(s)
        declared = int(60_000_000 * scale)
        send_quietly(s, b"*3\r\n$3\r\nPUB\r\n$6\r\norders\r\n$%d\r\n" % declared + b"Q" * int(50_000_000 * scale))
        socks.append(s)
    for s in socks:
        s.settimeout(5)
        try:
            refused += s.recv(200).startswith(b"-")
        except OSError:
            pass
        s.close()
    return {"connections": 8, "refused": refused}


def largest_allowed_partial_bulks(port: int, scale: float) -> dict[str, Any]:
    """8 authenticated connections each hold the largest bulk framing allows, less one byte."""
    socks = []
    limit = Config().frame_bulk_limit
    for _ in range(8):
        s = connect(port)
        auth(s)
        send_quietly(s, b"*3\r\n$3\r\nPUB\r\n$6\r\norders\r\n$%d\r\n" % limit + b"Q" * (limit - 1))
        socks.append(s)
    time.sleep(1)
    for s in socks:
        s.close()
    return {"connections": 8, "bulk_bytes_each": limit - 1}


def flood_behind_long_poll(port: int, scale: float) -> dict[str, Any]:
    """420 MB sent behind a PULL BLOCK 3000 (was: all of it in RSS, kept after the client left)."""
    s = connect(port)
    auth(s)
    s.sendall(cmd("HELLO", "2", "SETNAME", "flooder"))
    s.recv(4096)
    s.sendall(cmd("SUB", "flood", "GROUP", "g"))
    handle = handle_of(s.recv(4096))
    total = int(420 * MiB * scale)
    chunk = cmd("PING", "x" * 1000) * 1000
    s.sendall(cmd("PULL", handle, "BLOCK", "3000"))
    s.settimeout(1)
    sent = 0
    deadline = time.monotonic() + 2.5  # while the long poll waits
    try:
        while sent < total and time.monotonic() < deadline:
            sent += s.send(chunk)
    except (TimeoutError, OSError):
        pass
    s.close()
    return {"offered_bytes": total, "taken_by_the_socket_while_blocked": sent}


def pipelined_pings_behind_long_poll(port: int, scale: float) -> dict[str, Any]:
    """3.5 M pipelined PINGs behind one BLOCK 3000 (was: RSS 2.36 GB, the event loop frozen 31 s)."""
    s = connect(port)
    auth(s)
    s.sendall(cmd("SUB", "pings", "GROUP", "g"))
    handle = handle_of(s.recv(4096))
    n = int(3_500_000 * scale)
    ping = b"*1\r\n$4\r\nPING\r\n"
    s.sendall(cmd("PULL", handle, "BLOCK", "3000"))
    replies = 0
    reader_done = threading.Event()

    def read() -> None:
        nonlocal replies
        s.settimeout(30)
        try:
            while replies < n:
                data = s.recv(1 << 20)
                if not data:
                    break
                replies += data.count(b"+PONG")
        except OSError:
            pass
        reader_done.set()

    threading.Thread(target=read, daemon=True).start()
    batch = ping * 10_000
    for _ in range(n // 10_000):
        send_quietly(s, batch)
    reader_done.wait(60)
    s.close()
    return {"pings": n, "pongs_read": replies}


def auth_guessing(port: int, scale: float) -> dict[str, Any]:
    """Wrong passwords as fast as possible (was: 91,625/s on one connection, AUTH still open after 3,000)."""
    attempts, closed_after, started = 0, [], time.monotonic()
    while time.monotonic() - started < 5:
        s = connect(port)
        n = 0
        try:
            while True:
                s.sendall(cmd("AUTH", f"guess{attempts}"))
                reply = s.recv(200)
                if not reply:
                    break
                attempts += 1
                n += 1
        except OSError:
            pass
        closed_after.append(n)
        s.close()
    elapsed = time.monotonic() - started
    return {"attempts": attempts, "attempts_per_s": round(attempts / elapsed, 1),
            "closed_after_failures": sorted(set(closed_after))}


def open_after(socks: list[socket.socket], timeout_ms: int) -> int:
    """How many of ``socks`` the worker still holds open a second past ``timeout_ms``; all closed after."""
    time.sleep(timeout_ms / 1000 + 1)
    still_open = sum(not closed(s, timeout=0.05) for s in socks)
    for s in socks:
        s.close()
    return still_open


def slowloris(port: int, scale: float) -> dict[str, Any]:
    """300 connections that never authenticate (was: all held open)."""
    socks = [connect(port) for _ in range(300)]
    for s in socks:
        s.sendall(b"*2\r\n$4\r\nAUTH\r\n$5\r\nab")  # a frame never finished
    return {"connections": 300, "open_after_auth_timeout": open_after(socks, SETTINGS["auth_timeout_ms"])}


def slowloris_after_auth(port: int, scale: float) -> dict[str, Any]:
    """300 authenticated connections that each begin a request and never finish it."""
    socks = []
    for _ in range(300):
        s = connect(port)
        auth(s)
        s.sendall(b"*3\r\n$3\r\nPUB\r\n$6\r\norders\r\n$1000\r\nab")
        socks.append(s)
    return {"connections": 300, "open_after_request_timeout": open_after(socks, SETTINGS["request_timeout_ms"])}


def not_reading(port: int, scale: float) -> dict[str, Any]:
    """A client that asks for 100 MB of replies and never reads them."""
    s = connect(port)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    auth(s)
    request = cmd("ECHO", "y" * 60_000)
    n = int(1700 * scale)
    threading.Thread(target=send_quietly, args=(s, request * n), daemon=True).start()
    time.sleep(SETTINGS["output_timeout_ms"] / 1000 + 2)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    ended = closed(s, timeout=5)
    s.close()
    return {"reply_bytes_asked": n * 60_000, "closed_by_worker": ended}


def stalled_tls_handshakes(port: int, scale: float) -> dict[str, Any]:
    """300 TCP connections to a TLS worker that never start a handshake, and 30 that send junk."""
    socks = [connect(port) for _ in range(300)]
    for _ in range(30):
        j = connect(port)
        j.sendall(b"PING\r\n" * 10)
        closed(j, 5)
        j.close()
    time.sleep(SETTINGS["tls_handshake_timeout_ms"] / 1000 + 1)
    still_open = sum(not closed(s, timeout=0.05) for s in socks)
    for s in socks:
        s.close()
    return {"stalled": 300, "open_after_timeout": still_open, "junk_handshakes": 30}


ATTACKS: list[tuple[str, Callable[[int, float], dict[str, Any]], int]] = [
    # name, attack, the bytes its budget allows above the idle worker
    ("unauthenticated_bulks", unauthenticated_bulks, 10 * 2 * 16_384 + 10 * 2 * 65_536),
    ("error_echo", error_echo, 2 * Config().frame_bulk_limit),
    ("held_partial_bulks", held_partial_bulks, 8 * 2 * Config().frame_bulk_limit),
    ("largest_allowed_partial_bulks", largest_allowed_partial_bulks, 8 * 2 * Config().frame_bulk_limit),
    ("flood_behind_long_poll", flood_behind_long_poll, 2 * (Config().max_read_ahead + 65_536)),
    ("pipelined_pings_behind_long_poll", pipelined_pings_behind_long_poll, 2 * (Config().max_read_ahead + 65_536)),
    ("auth_guessing", auth_guessing, 8 * MiB),
    ("slowloris", slowloris, 300 * 64 * 1024),
    ("slowloris_after_auth", slowloris_after_auth, 300 * 64 * 1024),
    ("not_reading", not_reading, 2 * Config().max_read_ahead + 64 * 1024 * 1024),
]
DOOR_ATTACKS = attack_doors.ATTACKS  # at the MQTT and UI doors, and the password attacks at all three
SLACK = 48 * MiB  # allocator and interpreter noise: Python does not give every freed page back at once


def run_one(redis_url: str, name: str, attack: Callable[[Any, float], dict[str, Any]], budget: int, scale: float,
            doors: bool = False, **extra: Any) -> dict[str, Any]:
    w = Worker(redis_url, doors, **{**SETTINGS, **extra})
    try:
        good = GoodClient(w.port, tls="tls_cert_file" in extra)
        good.start()
        time.sleep(0.5)
        before = w.rss()
        peak = before
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, w.rss())
                time.sleep(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        good.latencies.clear()
        started = time.monotonic()
        observed = attack(w.ports if doors else w.port, scale)
        elapsed = time.monotonic() - started
        time.sleep(0.3)
        done.set()
        sampler.join()
        good.stop.set()
        good.join(10)
        lat = sorted(good.latencies)
        slowest = lat[-1] if lat else None
        result = {
            **observed,
            "rss_before_mb": round(before / MiB, 1), "rss_peak_mb": round(peak / MiB, 1),
            "rss_after_mb": round(w.rss() / MiB, 1),
            "budget_mb": round((budget + SLACK) / MiB, 1), "within_budget": peak - before <= budget + SLACK,
            "attack_s": round(elapsed, 2),
            "good_client": {"rounds": len(lat), "slowest_ms": round(slowest * 1000, 1) if slowest else None,
                            "p50_ms": round(lat[len(lat) // 2] * 1000, 2) if lat else None,
                            "failure": good.failure or None},
            "good_client_not_starved": bool(lat) and not good.failure and slowest is not None and slowest < 1.0,
        }
        if name == "mqtt_not_reading":
            result["closed_by_worker"] = any("has not read what it was sent" in x for x in w.log_lines())
        if name == "stalled_tls_handshakes":
            lines = [x for x in w.log_lines() if "TLS handshake" in x]
            result["handshake_log_lines"] = len(lines)
            result["tracebacks_logged"] = sum("Traceback" in x for x in w.log_lines())
        return result
    finally:
        w.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--only", default=None, help="comma-separated attack names")
    opts = ap.parse_args()
    results: dict[str, Any] = {}
    chosen = set(opts.only.split(",")) if opts.only else None
    with EmbeddedRedis() as server:
        for name, attack, budget in ATTACKS:
            if chosen and name not in chosen:
                continue
            redis.Redis.from_url(server.url).flushall()
            results[name] = run_one(server.url, name, attack, budget, opts.scale)
            print(name, json.dumps(results[name]), flush=True)
        for name, door_attack, budget in DOOR_ATTACKS:
            if chosen and name not in chosen:
                continue
            redis.Redis.from_url(server.url).flushall()
            add_user(server.url)
            results[name] = run_one(server.url, name, door_attack, budget, opts.scale, doors=True, users=True)
            print(name, json.dumps(results[name]), flush=True)
        if chosen is None or "stalled_tls_handshakes" in chosen:
            try:
                import trustme
            except ImportError:
                results["stalled_tls_handshakes"] = {"skipped": "trustme is not installed"}
            else:
                with tempfile.TemporaryDirectory() as d:
                    cert = trustme.CA().issue_cert("127.0.0.1")
                    pem = os.path.join(d, "server.pem")
                    cert.private_key_and_cert_chain_pem.write_to_path(pem)
                    results["stalled_tls_handshakes"] = run_one(
                        server.url, "stalled_tls_handshakes", stalled_tls_handshakes, 330 * 64 * 1024, opts.scale,
                        tls_cert_file=pem, tls_key_file=pem)
                    print("stalled_tls_handshakes", json.dumps(results["stalled_tls_handshakes"]), flush=True)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"settings": {**SETTINGS, "password": "…", "defaults": {
        k: getattr(Config(), k) for k in ("preauth_max_args", "preauth_max_bulk", "max_frame_bulk", "max_read_ahead",
                                          "auth_max_failures", "auth_delay_ms", "auth_delay_max_ms",
                                          "max_arg_bytes", "max_connections", "max_password_checks")
        if hasattr(Config(), k)}},
           "scale": opts.scale, "attacks": results}
    (out / "attacks.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out / 'attacks.json'}")


if __name__ == "__main__":
    main()
