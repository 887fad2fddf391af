"""A worker at its file limit: it refuses what does not fit and keeps serving the rest."""

from __future__ import annotations

import socket

import pytest

from fencemq.errors import BadArgument
from fencemq.server.file_limit import RESERVED, plan

from tests.helpers import Closed, Err, RespConn, direct, free_port, subprocess_worker, wait_for


def test_open_files_are_shared_out_between_a_reserve_redis_and_clients():
    small = plan(256)
    assert (small.redis_pool, small.clients, small.reserved) == (24, 168, RESERVED)
    large = plan(65_536)
    assert large.redis_pool == 256 and large.clients == 65_536 - RESERVED - 256
    cluster = plan(65_536, servers=3)
    assert cluster.clients == 65_536 - RESERVED - 3 * 256, "a Cluster has a pool per master"
    with pytest.raises(BadArgument, match="no room for clients"):
        plan(64)


def _log_of(proc) -> str:
    proc.log.seek(0)
    return proc.log.read().decode(errors="replace")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_worker_under_a_file_limit_of_256_refuses_the_excess_of_400_connections_and_keeps_serving(redis_url, loop):
    port = free_port()
    proc = subprocess_worker(redis_url, port, file_limit=256, loop=loop, session_lease_ms=1000)
    conns: list[RespConn] = []
    try:
        # all at once, as a reconnect storm does: 400 connections, then a named session on each
        conns = [RespConn(port, timeout=20) for _ in range(400)]
        for i, c in enumerate(conns):
            try:
                c.send("HELLO", 2, "SETNAME", f"c{i}")
            except OSError:
                pass  # refused and closed already
        served, refused = [], 0
        for c in conns:
            try:
                reply = c.reply()
            except (Closed, OSError):
                refused += 1  # closed without a word: out of descriptors even for the refusal
                continue
            if isinstance(reply, Err):
                assert "max number of clients" in reply, reply
                assert c.is_closed(timeout=5)
                refused += 1
            else:
                served.append(c)
        assert proc.poll() is None, f"the worker exited:\n{_log_of(proc)[-3000:]}"
        assert refused >= 400 - 256, "more connections than open files were served"
        assert len(served) >= 100, f"only {len(served)} of 400 connections were served under a limit of 256"
        for c in served:  # every connection it kept still works, Redis included
            assert c.call("SUB", "orders", "GROUP", "g", timeout=20) is not None
            assert c.call("PING") == "PONG"
        for c in conns:
            c.close()
        # every session's cleanup ran: nothing is left of them once their lease is over
        r = direct(redis_url)
        wait_for(lambda: r.zcard("fmq:sessions") == 0, timeout=30, what="every session to be ended")
        with RespConn(port) as again:
            assert again.call("HELLO", 2, "SETNAME", "after")[0] == "server"
        assert proc.poll() is None
        log = _log_of(proc)
        assert "Too many open files" not in log, log[-3000:]
        print(f"{len(served)} served, {refused} refused;", log.splitlines()[0])
    finally:
        for c in conns:
            c.close()
        proc.terminate()
        proc.wait(10)


SHEDDING_SERVER = """
import os, sys, anyio
from fencemq.server.accepting import RESP_REFUSAL, SpareDescriptor, shedding

async def main():
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    print(listener.extra(anyio.abc.SocketAttribute.local_port), flush=True)
    listener = shedding(listener, SpareDescriptor(), RESP_REFUSAL)
    filler = []

    async def handler(stream):
        await stream.send(b"+hello\\r\\n")
        async for data in stream:
            if data.startswith(b"fill"):  # take every descriptor left
                try:
                    while True:
                        filler.append(os.open(os.devnull, os.O_RDONLY))
                except OSError:
                    pass
                await stream.send(b"+full\\r\\n")
            elif data.startswith(b"free"):
                while filler:
                    os.close(filler.pop())
                await stream.send(b"+freed\\r\\n")

    await listener.serve(handler)

anyio.run(main)
"""


def test_a_listener_out_of_descriptors_refuses_each_newcomer_with_an_error_and_serves_again_once_some_are_free():
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", SHEDDING_SERVER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        port = int(proc.stdout.readline())
        with RespConn(port) as first:
            assert first.reply() == "hello"
            first.send_raw(b"fill")
            assert first.reply() == "full"
            for _ in range(3):
                with RespConn(port) as refused:
                    reply = refused.reply()
                    assert isinstance(reply, Err) and "max number of clients" in reply
                    assert refused.is_closed()
            first.send_raw(b"free")
            assert first.reply() == "freed"
            with RespConn(port) as later:
                assert later.reply() == "hello"
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(10)


def mqtt_connect(client_id: str, level: int) -> bytes:
    """A CONNECT packet (Clean Start, Keep Alive 60) in MQTT 3.1.1 (level 4) or 5.0 (level 5), as raw bytes."""
    cid = client_id.encode()
    variable = b"\x00\x04MQTT" + bytes([level, 0x02]) + b"\x00\x3c" + (b"\x00" if level == 5 else b"")
    body = variable + len(cid).to_bytes(2, "big") + cid
    return b"\x10" + bytes([len(body)]) + body


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def read_connack(sock: socket.socket) -> int | None:
    """The CONNACK's return or reason code, or None if the connection closed first."""
    data = b""
    try:
        while len(data) < 4:
            chunk = sock.recv(64)
            if not chunk:
                return None
            data += chunk
    except (ConnectionResetError, TimeoutError):
        return None
    assert data[0] == 0x20, data
    return data[3]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_an_mqtt_worker_under_a_file_limit_of_256_refuses_the_excess_of_400_connects_with_a_connack(redis_url, loop):
    port, mqtt_port = free_port(), free_port()
    proc = subprocess_worker(redis_url, port, file_limit=256, loop=loop, mqtt_port=mqtt_port)
    socks: list[socket.socket] = []
    try:
        wait_for(lambda: _listens(mqtt_port), what="the MQTT port to listen")  # RESP may answer a moment before
        socks = [socket.create_connection(("127.0.0.1", mqtt_port), timeout=20) for _ in range(400)]
        for i, s in enumerate(socks):
            try:
                s.sendall(mqtt_connect(f"m{i}", 4 + i % 2))
            except OSError:
                pass
        served, refused = [], 0
        for i, s in enumerate(socks):
            code = read_connack(s)
            if code == 0:
                served.append(s)
                continue
            # Quota exceeded (5.0), Server unavailable (3.1.1), or closed for want of a descriptor
            assert code in (None, 0x97 if i % 2 else 0x03), (i, code)
            refused += 1
        assert proc.poll() is None, f"the worker exited:\n{_log_of(proc)[-3000:]}"
        assert refused >= 400 - 256 and len(served) >= 100, (len(served), refused, _log_of(proc)[-4000:])
        for s in served:  # PINGREQ -> PINGRESP: every connection it kept is served
            s.sendall(b"\xc0\x00")
            assert s.recv(2) == b"\xd0\x00"
        # MQTT and RESP connections count together: RESP clients are let in only while the MQTT
        # ones leave room (a probe that closed may still be leaving), then told
        resp: list[RespConn] = []
        while True:
            c = RespConn(port)
            c.send("PING")
            reply = c.reply()
            if reply != "PONG":
                assert "max number of clients" in reply, f"{reply!r}; the worker's log:\n{_log_of(proc)[-3000:]}"
                c.close()
                break
            resp.append(c)
            assert len(resp) <= 2, f"{len(resp)} RESP clients let in beside {len(served)} MQTT ones"
        for c in resp:
            c.close()
        served.pop().close()

        def resp_served() -> bool:
            with RespConn(port) as c:
                return c.call("PING") == "PONG"

        wait_for(resp_served, what="a RESP client to be served once an MQTT one left")
        assert "Too many open files" not in _log_of(proc)
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(10)
