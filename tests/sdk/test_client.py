"""The client SDK (broker/client.py): multiplexing, push routing, errors, epochs, sync facade.

Three kinds of peer:
* the private Redis of conftest (``redis_url``): the multiplexing layer alone
  (hundreds of concurrent calls on one connection, RESP3 push frames, connection
  loss), since any Redis command goes through the same path;
* a scripted fake worker (``FakeWorker``): replies the real worker does not give
  yet (TAKE / EOS, UNSUB MAX, HEARTBEAT SYNC) and the exact wire form of every verb;
* a real worker (``fencemq.server.runner.WorkerThread``) in front of that Redis.

Every test runs twice: with the link's own reply reader and with redis-py's it replaces
(``Link.own_reader``), which must give every call the same outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis

from fencemq import Client, ConnectionLost, EndOfStream, Reconnect, SyncClient
from fencemq.config import Config
from fencemq.errors import BadArgument, FenceMQError, NoAuth, NoPermission, Stale
from fencemq.model.messages import Delivery
from fencemq.sdk.link import Link
from fencemq.sdk.replies import _notice
from fencemq.protocol.resp import NULL_ARRAY, ErrorReply, Push, RequestParser, SimpleString, encode_many
from fencemq.server.runner import WorkerThread


@pytest.fixture(autouse=True, scope="module", params=["own reader", "redis-py's reader"])
def reply_reader(request: pytest.FixtureRequest) -> Iterator[str]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Link, "own_reader", request.param == "own reader")
        yield request.param


def run(coro: Any, timeout: float = 60) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def flushed(client: Client) -> None:
    """Let tasks just created send their commands (frames are written once per loop iteration)."""
    await asyncio.sleep(0)
    while client._out or client._flush_scheduled:
        await asyncio.sleep(0)


# =====================================================================================
# The multiplexer, against a real Redis


@pytest.mark.parametrize("protocol", [2, 3])
def test_many_concurrent_calls_share_one_connection(redis_url: str, protocol: int) -> None:
    async def main() -> None:
        async with Client(redis_url, client_id="mux", protocol=protocol) as c:
            async def task(i: int) -> None:
                assert await c.execute("SET", f"k{i}", f"v{i}") == b"OK"
                echoes = await asyncio.gather(*(c.execute("ECHO", f"{i}-{j}") for j in range(5)))
                assert echoes == [f"{i}-{j}".encode() for j in range(5)]
                assert await c.execute("GET", f"k{i}") == f"v{i}".encode()
                assert await c.ping(f"p{i}") == f"p{i}"
                await c.execute("INCR", "counter")
                assert await c.execute("CLIENT", "GETNAME") == b"mux"

            await asyncio.gather(*(task(i) for i in range(200)))
            assert await c.execute("GET", "counter") == b"200"
            ids = set(await asyncio.gather(*(c.execute("CLIENT", "ID") for _ in range(50))))
            assert len(ids) == 1  # every call went over the same connection
            assert not c._link.pending

    run(main())
    other = redis.Redis.from_url(redis_url)
    try:
        assert not [cl for cl in other.client_list() if cl["name"] == "mux"]  # closed on exit
    finally:
        other.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_hello_names_the_connection_sets_no_library_and_a_refused_client_deliveries_does_no_harm(
        redis_url: str, protocol: int) -> None:
    async def main() -> None:
        # Redis refuses the CLIENT DELIVERIES FLAT that goes with HELLO in RESP3, as an older worker would
        async with Client(redis_url, client_id="named", protocol=protocol) as c:
            assert c.id == "named"
            assert c.hello["proto"] == protocol
            info = (await c.execute("CLIENT", "INFO")).decode()
            fields = dict(f.split("=", 1) for f in info.split() if "=" in f)
            assert fields["name"] == "named"
            assert fields["resp"] == str(protocol)
            assert fields.get("lib-name", "") == "" and fields.get("lib-ver", "") == ""  # no CLIENT SETINFO

    run(main())


def test_error_replies_raise_fencemq_errors_and_the_connection_survives(redis_url: str) -> None:
    async def main() -> None:
        async with await Client.connect(redis_url, client_id="errs") as c:
            calls = []
            for i in range(100):
                if i % 3 == 0:
                    calls.append(c.execute("EVAL", f"return redis.error_reply('BADARG bad handle {i}')", 0))
                elif i % 3 == 1:
                    calls.append(c.execute("EVAL", "return redis.error_reply('STALE old epoch')", 0))
                else:
                    calls.append(c.execute("ECHO", str(i)))
            results = await asyncio.gather(*calls, return_exceptions=True)
            for i, r in enumerate(results):
                if i % 3 == 0:
                    assert type(r) is BadArgument and r.message == f"bad handle {i}"
                elif i % 3 == 1:
                    assert type(r) is Stale and r.code == "STALE"
                else:
                    assert r == str(i).encode()
            with pytest.raises(FenceMQError) as err:
                await c.execute("NOSUCHCOMMAND")
            assert err.value.code == "ERR"
            # NOAUTH / WRONGPASS must not be turned into redis-py's connection-killing errors
            with pytest.raises(FenceMQError):
                await c.execute("AUTH", "nobody", "wrong")
            assert await c.ping() == "PONG"

    run(main())


def test_resp3_push_frames_are_routed_to_notices_not_replies(redis_url: str) -> None:
    seen: list[dict] = []
    n = 300

    async def main() -> None:
        async with Client(redis_url, client_id="pushy", on_notice=seen.append) as c:
            assert await c.execute("CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", "pk:") == b"OK"
            writer = redis.asyncio.Redis.from_url(redis_url)
            try:
                async def writes() -> None:
                    for i in range(n):
                        await writer.set(f"pk:{i}", i)

                async def echoes() -> list[bytes]:
                    return await asyncio.gather(*(c.execute("ECHO", f"e{i}") for i in range(2000)))

                _, got = await asyncio.gather(writes(), echoes())
                assert got == [f"e{i}".encode() for i in range(2000)]
                keys: set[str] = set()
                async def collect() -> None:
                    async for notice in c.notices():
                        assert notice["type"] == "invalidate"
                        keys.update(notice["data"][0])
                        if len(keys) == n:
                            return
                await asyncio.wait_for(collect(), 10)
                assert keys == {f"pk:{i}" for i in range(n)}
                assert await c.execute("GET", "pk:1") == b"1"
            finally:
                await writer.aclose()

    run(main())
    assert seen and all(s["type"] == "invalidate" for s in seen)


def test_a_flood_of_pushes_on_an_idle_connection(redis_url: str) -> None:
    """Thousands of pushes with no reply in between (the parser must not recurse per push)."""
    n = 3000

    async def main() -> None:
        async with Client(redis_url, client_id="flood") as c:
            await c.execute("CLIENT", "TRACKING", "ON")
            await asyncio.gather(*(c.execute("GET", f"f:{i}") for i in range(n)))  # now tracked
            writer = redis.asyncio.Redis.from_url(redis_url)
            try:
                async with writer.pipeline(transaction=False) as pipe:
                    for i in range(n):
                        pipe.set(f"f:{i}", 1)
                    await pipe.execute()
            finally:
                await writer.aclose()
            keys: set[str] = set()
            async for notice in c.notices():
                keys.update(notice["data"][0])
                if len(keys) == n:
                    break
            assert await c.ping() == "PONG"
            assert not c.closed

    run(main())


async def killed_with_calls_in_flight(c: Client, redis_url: str) -> tuple[int, list[Any]]:
    """A BLPOP and 20 ECHOs on the wire when Redis kills the client's connection: its id, their outcomes."""
    conn_id = int(await c.execute("CLIENT", "ID"))
    blocked = asyncio.ensure_future(c.execute("BLPOP", "nothing", 30))
    behind = [asyncio.ensure_future(c.execute("ECHO", str(i))) for i in range(20)]
    await flushed(c)
    await asyncio.sleep(0.1)
    killer = redis.asyncio.Redis.from_url(redis_url)
    try:
        assert await killer.client_kill_filter(_id=conn_id) == 1
    finally:
        await killer.aclose()
    return conn_id, await asyncio.gather(blocked, *behind, return_exceptions=True)


def test_a_lost_connection_reconnects_and_sends_again_what_is_safe_to_send_again(redis_url: str) -> None:
    async def main() -> None:
        told: list[dict] = []
        c = await Client.connect(redis_url, client_id="phoenix", on_notice=told.append)
        conn_id, results = await killed_with_calls_in_flight(c, redis_url)
        # a Redis command the SDK cannot know to be safe again is the caller's to retry ...
        assert isinstance(results[0], ConnectionLost) and "may or may not have run" in str(results[0])
        # ... and the rest went out again, in order, on the next connection
        assert results[1:] == [str(i).encode() for i in range(20)]
        assert not c.closed and int(await c.execute("CLIENT", "ID")) != conn_id
        assert [n["type"] for n in told] == ["disconnected", "reconnected"]
        assert told[1]["resent"] == 20
        await c.close()

    run(main())


def test_without_reconnect_a_lost_connection_fails_every_pending_call(redis_url: str) -> None:
    async def main() -> None:
        c = await Client.connect(redis_url, client_id="doomed", reconnect=False)
        _, results = await killed_with_calls_in_flight(c, redis_url)
        assert all(isinstance(r, ConnectionLost) for r in results), results
        assert all(isinstance(r, ConnectionError) for r in results)  # the builtin one too
        assert c.closed
        with pytest.raises(ConnectionError):
            await c.ping()
        assert [n async for n in c.notices()] == []  # ends instead of hanging
        await c.close()

    run(main())


def test_a_cancelled_caller_does_not_shift_the_replies(redis_url: str) -> None:
    async def main() -> None:
        async with Client(redis_url, client_id="cancel") as c:
            blocked = asyncio.ensure_future(c.execute("BLPOP", "nothing", 0.3))
            victim = asyncio.ensure_future(c.execute("ECHO", "victim"))
            after = asyncio.ensure_future(c.execute("ECHO", "after"))
            await flushed(c)
            victim.cancel()
            assert await blocked is None
            assert await after == b"after"
            with pytest.raises(asyncio.CancelledError):
                await victim
            # a caller cancelled by a timeout, while its reply is pending
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(c.execute("BLPOP", "nothing", 0.3), 0.05)
            assert await c.execute("ECHO", "still in step") == b"still in step"

    run(main())


def test_connect_failure_is_a_connection_error() -> None:
    from fencemq.server.embedded import free_port

    with pytest.raises(ConnectionError):
        run(Client.connect(f"redis://127.0.0.1:{free_port()}", connect_timeout=2))


def test_closed_client(redis_url: str) -> None:
    async def main() -> None:
        c = Client(redis_url)
        with pytest.raises(ConnectionLost):
            await c.ping()  # not opened yet
        async with c:
            assert c.id is not None  # Redis's HELLO gives its connection id
            assert await c.ping() == "PONG"
        assert c.closed
        with pytest.raises(ConnectionLost):
            await c.ping()
        await c.close()  # idempotent

    run(main())


# =====================================================================================
# A scripted fake worker: exact wire forms, and replies the worker does not give yet


class FakeWorker:
    """Answers each command with ``handler(args) -> reply``; records every command."""

    def __init__(self, handler: Callable[[list[bytes]], Any], pieces: int | None = None) -> None:
        self.handler = handler
        self.pieces = pieces  # write every answer in pieces of this many bytes, each on its own
        self.commands: list[list[bytes]] = []
        self.proto = 2
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parser = RequestParser()
        try:
            while data := await reader.read(65536):
                parser.feed(data)
                out = []
                while (cmd := parser.gets()) is not None:
                    self.commands.append(cmd)
                    verb = cmd[0].upper()
                    if verb == b"HELLO":
                        self.proto = int(cmd[1])
                        name = cmd[cmd.index(b"SETNAME") + 1] if b"SETNAME" in cmd else b""
                        out.append({"server": "fencemq", "proto": self.proto, "id": name})
                        continue
                    if verb == b"CLIENT" and cmd[1:2] == [b"DELIVERIES"]:  # the SDK's part of the handshake
                        out.append(SimpleString("OK"))
                        continue
                    reply = self.handler(cmd)
                    if reply == "CLOSE":
                        writer.close()
                        return
                    out.extend(reply if isinstance(reply, tuple) else [reply])
                data = encode_many(out, self.proto)
                if not self.pieces:
                    writer.write(data)
                    continue
                for at in range(0, len(data), self.pieces):
                    writer.write(data[at:at + self.pieces])
                    await writer.drain()
                    await asyncio.sleep(0.001)  # the client reads what came so far
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        async with server:
            yield f"redis://127.0.0.1:{self.port}"


def delivery(i: int, epoch: int = 0, **extra: Any) -> dict[str, Any]:
    d = {"id": str(i), "tag": f"t{i}", "epoch": epoch, "topic": "top", "payload": b"p%d" % i,
         "deliveries": 1, "ts": 1000 + i}
    d.update(extra)
    return d


SUB_REPLY = {"handle": "hX", "mode": "exclusive", "epoch": 3, "qos": 1, "owner": "me"}


@pytest.mark.parametrize("protocol", [2, 3])
def test_every_verb_on_the_wire(protocol: int) -> None:
    def handler(cmd: list[bytes]) -> Any:
        verb = cmd[0].upper()
        return {
            b"PUB": "42", b"MPUB": ["1", "2"], b"SUB": SUB_REPLY, b"PULL": [], b"ACK": 2, b"NACK": 1,
            b"RENEW": 1, b"SEEK": 7, b"UNSUB": SimpleString("OK"), b"HEARTBEAT": [],
        }[verb]

    fake = FakeWorker(handler)
    made: list[str] = []

    async def main() -> None:
        async with fake.running() as url, Client(url, client_id="me", protocol=protocol) as c:
            made.append(c._dedup_prefix)
            assert await c.publish("top", b"x") == "42"
            assert await c.publish("top", b"x", lmq="q", qos=0, retain=True, dedup_id="d1",
                                   headers={"a": "1", "b": "2"}) == "42"
            assert await c.mpublish("top", [b"a", b"b"], lmq="q", qos=0) == ["1", "2"]
            sub = await c.subscribe("top")
            assert (sub.handle, sub.mode, sub.epoch, sub.owner) == ("hX", "exclusive", 3, "me")
            await c.subscribe("top", lmq="q", group="g", mode="shared", policy="reject", start=("id", 5), qos=0,
                              lock_ms=100, push=True, capacity=10, max=3, epoch=2)
            await c.subscribe("top", start="latest")
            await c.subscribe("top", start=("time", 1234))
            assert await sub.pull() == []
            assert await sub.pull(10, block_ms=50) == []
            assert await sub.ack("t1", "t2") == 2
            assert await sub.ack() == 0  # nothing to settle: no round trip
            assert await sub.nack("t1", delay_ms=5, discard=True) == 1
            assert await sub.renew("t1", lock_ms=9) == 1
            assert await sub.seek("earliest") == 7 and sub.epoch == 7
            await sub.seek("latest")
            await sub.seek(id=12)
            await sub.seek(time_ms=99)
            assert await sub.unsubscribe(max=5) is None
            await sub.unsubscribe()
            assert await c.heartbeat() == []
            assert await c.heartbeat(sync=("top", "g", ["a", "b"])) == []
            with pytest.raises(ValueError):
                await sub.seek("earliest", id=3)

    run(main())
    sent = [[a.decode() for a in cmd] for cmd in fake.commands]
    hello = ["HELLO", str(protocol), "SETNAME", "me"]
    assert sent == [
        hello,
        # in RESP3, in HELLO's write: deliveries as flat arrays, which hiredis parses faster than maps
        *([["CLIENT", "DELIVERIES", "FLAT"]] if protocol == 3 else []),
        # a publish without an application's dedup id gets one of the client's: safe to send again
        ["PUB", "top", "x", "ID", f"{made[0]}1"],
        ["PUB", "top", "x", "LMQ", "q", "QOS", "0", "RETAIN", "ID", "d1", "HDR", "a", "1", "HDR", "b", "2"],
        ["MPUB", "top", "2", "a", "b", "LMQ", "q", "QOS", "0", "ID", f"{made[0]}2"],
        ["SUB", "top"],
        ["SUB", "top", "LMQ", "q", "GROUP", "g", "MODE", "shared", "POLICY", "reject", "FROM", "ID", "5",
         "QOS", "0", "LOCK", "100", "PUSH", "CAPACITY", "10", "MAX", "3", "EPOCH", "2"],
        ["SUB", "top", "FROM", "LATEST"],
        ["SUB", "top", "FROM", "TIME", "1234"],
        ["PULL", "hX"],
        ["PULL", "hX", "COUNT", "10", "BLOCK", "50"],
        ["ACK", "hX", "t1", "t2"],
        ["NACK", "hX", "t1", "DELAY", "5", "DISCARD"],
        ["RENEW", "hX", "t1", "LOCK", "9"],
        ["SEEK", "hX", "EARLIEST"],
        ["SEEK", "hX", "LATEST"],
        ["SEEK", "hX", "ID", "12"],
        ["SEEK", "hX", "TIME", "99"],
        ["UNSUB", "hX", "MAX", "5"],
        ["UNSUB", "hX"],
        ["HEARTBEAT"],
        ["HEARTBEAT", "SYNC", "top", "g", "a", "b"],
    ]


@pytest.mark.parametrize("protocol", [2, 3])
def test_deliveries_are_decoded_in_both_protocols(protocol: int) -> None:
    reply = [delivery(1, epoch=3, headers={"k": "v", "x": "y"}, lmq="q"),
             delivery(2, epoch=3, payload=b"\x00\xffbin")]

    def handler(cmd: list[bytes]) -> Any:
        return SUB_REPLY if cmd[0] == b"SUB" else reply

    async def main() -> None:
        async with FakeWorker(handler).running() as url, Client(url, protocol=protocol) as c:
            sub = await c.subscribe("top")
            assert await sub.pull(2) == [
                Delivery(id="1", tag="t1", epoch=3, topic="top", payload=b"p1", deliveries=1, ts=1001,
                         lmq="q", headers={"k": "v", "x": "y"}),
                Delivery(id="2", tag="t2", epoch=3, topic="top", payload=b"\x00\xffbin", deliveries=1,
                         ts=1002),
            ]
            assert sub.dropped == 0

    run(main())


def test_pull_fence_keeps_or_drops_whole_replies() -> None:
    replies: list[Any] = []

    def handler(cmd: list[bytes]) -> Any:
        if cmd[0] == b"SUB":
            return SUB_REPLY  # epoch 3
        return replies.pop(0)

    async def main() -> None:
        async with FakeWorker(handler).running() as url, Client(url, client_id="me") as c:
            sub = await c.subscribe("top")
            replies.extend([
                [delivery(1, epoch=2), delivery(2, epoch=2)],  # older than SUB's epoch: dropped whole
                [delivery(3, epoch=3)],  # current: kept
                [delivery(4, epoch=5)],  # newer (someone seeked the group): kept, epoch raised
                [delivery(5, epoch=4), delivery(6, epoch=4)],  # now stale
            ])
            assert await sub.pull(2) == [] and sub.dropped == 2
            assert [d.id for d in await sub.pull(2)] == ["3"]
            assert [d.id for d in await sub.pull(2)] == ["4"] and sub.epoch == 5
            assert await sub.pull(2) == [] and sub.dropped == 4

    run(main())


def test_reply_in_flight_while_a_seek_commits_is_dropped() -> None:
    """PULL and SEEK pipelined: the PULL was read before the seek, so its reply never reaches the caller."""
    def handler(cmd: list[bytes]) -> Any:
        return {b"SUB": SUB_REPLY, b"PULL": [delivery(1, epoch=3), delivery(2, epoch=3)], b"SEEK": 4}[cmd[0]]

    async def main() -> None:
        async with FakeWorker(handler).running() as url, Client(url, client_id="me") as c:
            sub = await c.subscribe("top")
            pull = asyncio.ensure_future(sub.pull(2))
            seek = asyncio.ensure_future(sub.seek("earliest"))
            assert await pull == []
            assert sub.dropped == 2 and sub.epoch == 4
            assert await seek == 4

    run(main())


def test_a_seek_whose_caller_was_cancelled_still_raises_the_epoch() -> None:
    def handler(cmd: list[bytes]) -> Any:
        return {b"SUB": SUB_REPLY, b"PULL": [delivery(1, epoch=3)], b"SEEK": 9}[cmd[0]]

    async def main() -> None:
        async with FakeWorker(handler).running() as url, Client(url, client_id="me") as c:
            sub = await c.subscribe("top")
            seek = asyncio.ensure_future(sub.seek("latest"))
            await flushed(c)
            seek.cancel()
            assert await sub.pull() == []  # its reply arrived after the seek's: fenced
            assert sub.epoch == 9

    run(main())


@pytest.mark.parametrize("protocol", [2, 3])
def test_take_iteration_ends_cleanly_at_end_of_stream(protocol: int) -> None:
    takes: list[Any] = [delivery(1, epoch=3), None, delivery(2, epoch=1), delivery(3, epoch=3),
                        SimpleString("EOS")]

    def handler(cmd: list[bytes]) -> Any:
        if cmd[0] == b"SUB":
            return SUB_REPLY
        if cmd[0] == b"TAKE":
            return takes.pop(0) if takes else SimpleString("EOS")
        raise AssertionError(cmd)

    async def main() -> None:
        async with FakeWorker(handler).running() as url, Client(url, client_id="me", protocol=protocol) as c:
            sub = await c.subscribe("top", push=True, capacity=4)
            got = [d.id async for d in sub]  # the nil is skipped, the epoch-1 delivery is fenced
            assert got == ["1", "3"] and sub.dropped == 1
            with pytest.raises(EndOfStream):
                await sub.take()

    run(main())


def test_take_returns_none_on_timeout() -> None:
    def handler(cmd: list[bytes]) -> Any:
        return SUB_REPLY if cmd[0] == b"SUB" else (NULL_ARRAY if cmd[0] == b"TAKE" else None)

    async def main() -> None:
        async with FakeWorker(handler).running() as url, Client(url, client_id="me", protocol=2) as c:
            sub = await c.subscribe("top", push=True)
            assert await sub.take(block_ms=10) is None

    run(main())


def test_worker_notices_pushed_between_replies() -> None:
    notice = {"type": "unsubscribe", "handle": "hA", "reason": "preempted", "tags": ["1", "2"]}

    def handler(cmd: list[bytes]) -> Any:
        if cmd[0] == b"PING":
            return (Push(["notice", notice]), SimpleString("PONG"))  # the push arrives before the reply
        if cmd[0] == b"HEARTBEAT":
            return [notice]
        raise AssertionError(cmd)

    async def main() -> None:
        async with FakeWorker(handler).running() as url, Client(url, client_id="me") as c:
            assert await asyncio.gather(*(c.ping() for _ in range(50))) == ["PONG"] * 50
            assert await c.heartbeat() == [notice]
            got = []
            async for n in c.notices():
                got.append(n)
                if len(got) == 50:
                    break
            assert got == [notice] * 50

    run(main())


@pytest.mark.parametrize("pieces", [1, 3, 1000])
@pytest.mark.parametrize("protocol", [2, 3])
def test_replies_errors_and_push_frames_cut_anywhere_are_read_whole_and_in_order(protocol: int, pieces: int) -> None:
    notice = {"type": "unsubscribe", "handle": "hX", "reason": "preempted", "tags": ["t1"]}

    def handler(cmd: list[bytes]) -> Any:
        verb = cmd[0].upper()
        if verb == b"PING":
            return (Push(["notice", notice]), SimpleString("PONG")) if protocol == 3 else SimpleString("PONG")
        if verb == b"ECHO":
            return ErrorReply("BADARG no echo here")
        return {b"SUB": SUB_REPLY, b"PULL": [delivery(i, 3) for i in range(20)], b"ACK": 20}[verb]

    async def main() -> None:
        async with FakeWorker(handler, pieces).running() as url, \
                Client(url, client_id="me", protocol=protocol) as c:
            sub = await c.subscribe("top")
            pings = [asyncio.ensure_future(c.ping()) for _ in range(3)]
            got = await sub.pull(count=20)
            echo = asyncio.ensure_future(c.execute("ECHO", "x"))
            assert await sub.ack(*[d.tag for d in got]) == 20
            assert [await p for p in pings] == ["PONG"] * 3
            with pytest.raises(BadArgument, match="no echo here"):
                await echo
            assert [(d.id, d.tag, d.payload) for d in got] == [(str(i), f"t{i}", b"p%d" % i) for i in range(20)]
            assert await c.ping() == "PONG", "the connection still reads replies in step"
            if protocol == 3:
                assert [await anext(aiter(c.notices())) for _ in range(4)] == [notice] * 4

    run(main())


def test_heartbeat_notices_in_resp2() -> None:
    notice = {"type": "message_timeout", "handle": "hA", "tags": ["7"]}

    async def main() -> None:
        async with FakeWorker(lambda cmd: [notice, notice]).running() as url, Client(url, protocol=2) as c:
            assert await c.heartbeat() == [notice, notice]

    run(main())


def test_server_closing_mid_call_without_reconnect() -> None:
    def handler(cmd: list[bytes]) -> Any:
        return "CLOSE" if cmd[0] == b"PULL" else SUB_REPLY

    async def main() -> None:
        async with FakeWorker(handler).running() as url, Client(url, client_id="me", reconnect=False) as c:
            sub = await c.subscribe("top")
            with pytest.raises(ConnectionLost):
                await sub.pull()
            with pytest.raises(ConnectionLost):
                await sub.ack("t1")

    run(main())


def test_a_command_whose_connection_drops_every_time_is_given_up_after_max_sends() -> None:
    fake = FakeWorker(lambda cmd: "CLOSE" if cmd[0] == b"PULL" else SUB_REPLY if cmd[0] == b"SUB" else 1)

    async def main() -> None:
        policy = Reconnect(first_delay_s=0.01, max_delay_s=0.02, max_sends=3)
        async with fake.running() as url, Client(url, client_id="me", reconnect=policy) as c:
            sub = await c.subscribe("top")
            with pytest.raises(ConnectionLost, match="3 connections"):
                await sub.pull()
            assert await sub.ack("t1") == 1  # the client itself goes on

    run(main())
    assert [cmd[0] for cmd in fake.commands].count(b"PULL") == 3


# =====================================================================================
# End to end, against a real worker


@pytest.fixture(scope="module")
def worker_url(redis_server: Any, reply_reader: str) -> Iterator[str]:
    """One worker for the module and reader (stopping one takes seconds), each reader's in a keyspace
    of its own; tests use their own names."""
    prefix = "fmq" if reply_reader == "own reader" else "fmq-redis-py-reader"
    with WorkerThread(Config(redis_url=redis_server.url, port=0, prefix=prefix)) as w:
        yield f"redis://127.0.0.1:{w.port}"


@pytest.mark.parametrize("protocol", [2, 3])
def test_publish_subscribe_pull_ack_round_trip(worker_url: str, protocol: int) -> None:
    async def main() -> None:
        topic = f"orders{protocol}"
        async with await Client.connect(worker_url, client_id=f"rt{protocol}", protocol=protocol) as c:
            assert c.id == f"rt{protocol}" and c.hello["server"] == "fencemq"
            assert await c.ping() == "PONG"
            ids = await c.mpublish(topic, [b"a", b"b"])
            one = await c.publish(topic, b"c", headers={"k": "v"})
            assert len(set(ids + [one])) == 3
            sub = await c.subscribe(topic, start="earliest")
            assert sub.handle and sub.mode == "exclusive"
            got = await sub.pull(10)
            assert [d.payload for d in got] == [b"a", b"b", b"c"]
            assert [d.id for d in got] == ids + [one]
            assert got[2].headers == {"k": "v"} and got[0].headers == {}
            assert {d.topic for d in got} == {topic} and all(d.epoch == sub.epoch for d in got)
            assert await sub.renew(got[0], lock_ms=10_000) == 1
            assert await sub.nack(got[0].tag) == 1
            again = await sub.pull(10)
            assert [(d.id, d.deliveries) for d in again] == [(ids[0], 2)]
            assert await sub.ack(*got[1:], *again) == 3
            assert await sub.ack(*got[1:]) == 0  # already settled
            assert await sub.pull(10) == []
            t0 = time.monotonic()
            assert await sub.pull(1, block_ms=200) == []
            assert time.monotonic() - t0 >= 0.15
            await sub.unsubscribe()
            assert await c.heartbeat() == []

    run(main())


def test_lite_queue_delivery_carries_lmq(worker_url: str) -> None:
    async def main() -> None:
        async with await Client.connect(worker_url, client_id="lite") as c:
            await c.publish("chats", b"hi", lmq="room-1")
            sub = await c.subscribe("chats", lmq="room-1", start="earliest")
            [d] = await sub.pull(5)
            assert (d.lmq, d.topic, d.payload) == ("room-1", "chats", b"hi")
            assert await sub.ack(d) == 1

    run(main())


def test_without_reconnect_an_unnamed_client_is_an_anonymous_session_and_learns_its_id(worker_url: str) -> None:
    async def main() -> None:
        async with await Client.connect(worker_url, reconnect=False) as c:
            await c.subscribe("anon-topic")
            assert c.id and c.id.startswith("anon-")

    run(main())


def test_a_reconnecting_client_names_its_session_itself_and_ends_it_when_closed(worker_url: str,
                                                                                 redis_url: str) -> None:
    async def main() -> str:
        async with await Client.connect(worker_url) as c:
            assert c.id and c.id.startswith("sdk-")
            await c.subscribe("named-topic")
            return c.id

    client_id = run(main())
    # QUIT ended it at once: nobody else knows its name to resume it
    r = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 3  # well before its 10 s lease
        while r.zscore("fmq:sessions", client_id) is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert r.zscore("fmq:sessions", client_id) is None
    finally:
        r.close()


def test_concurrent_publishes_from_many_tasks(worker_url: str) -> None:
    n = 500

    async def main() -> None:
        async with await Client.connect(worker_url, client_id="many") as c:
            ids = await asyncio.gather(*(c.publish("busy", b"m%d" % i) for i in range(n)))
            assert len(set(ids)) == n
            batches = await asyncio.gather(*(c.mpublish("busy", [b"b%d-%d" % (i, j) for j in range(10)])
                                             for i in range(20)))
            assert len({i for b in batches for i in b} | set(ids)) == n + 200
            sub = await c.subscribe("busy", start="earliest")
            got: list[Delivery] = []
            while batch := await sub.pull(1000):
                got += batch
                await sub.ack(*batch)
            assert sorted(d.payload for d in got) == sorted(
                [b"m%d" % i for i in range(n)] + [b"b%d-%d" % (i, j) for i in range(20) for j in range(10)])
            # ids match payloads: each task got the id of its own message
            by_payload = {d.payload: d.id for d in got}
            assert all(by_payload[b"m%d" % i] == ids[i] for i in range(n))

    run(main())


def test_bad_and_foreign_handles(worker_url: str) -> None:
    async def main() -> None:
        async with await Client.connect(worker_url, client_id="owner") as a, \
                await Client.connect(worker_url, client_id="thief") as b:
            sub = await a.subscribe("guarded")
            with pytest.raises(BadArgument):
                await b.execute("PULL", "not-a-handle")
            with pytest.raises(NoPermission):
                await b.execute("ACK", sub.handle, "1")
            with pytest.raises(BadArgument):
                await sub.pull(count=0)
            assert await sub.pull() == []  # both connections still fine
            assert await b.ping() == "PONG"

    run(main())


def test_seek_raises_the_epoch_and_redelivers(worker_url: str) -> None:
    async def main() -> None:
        async with await Client.connect(worker_url, client_id="seeker") as c:
            await c.mpublish("log", [b"1", b"2", b"3"])
            sub = await c.subscribe("log", start="earliest")
            first = await sub.pull(3)
            e0 = sub.epoch
            assert {d.epoch for d in first} == {e0}
            e1 = await sub.seek("earliest")
            assert e1 > e0 and sub.epoch == e1
            assert await sub.ack(*first) == 0  # taken under the old epoch: settle nothing
            again = await sub.pull(3)
            assert [d.payload for d in again] == [b"1", b"2", b"3"] and {d.epoch for d in again} == {e1}
            assert sub.dropped == 0

    run(main())


def test_pull_in_flight_during_a_seek_is_dropped_end_to_end(worker_url: str) -> None:
    async def main() -> None:
        async with await Client.connect(worker_url, client_id="racer") as c:
            await c.mpublish("race", [b"%d" % i for i in range(5)])
            sub = await c.subscribe("race", start="earliest")
            pull = asyncio.ensure_future(sub.pull(5))
            seek = asyncio.ensure_future(sub.seek("earliest"))
            await flushed(c)
            time.sleep(0.5)  # noqa: ASYNC251 - block the loop on purpose: both replies arrive before the reader looks
            assert await pull == []  # read under the old epoch, handed over after the seek committed
            assert sub.dropped == 5
            epoch = await seek
            assert sub.epoch == epoch
            again = await sub.pull(5)
            assert len(again) == 5 and {d.epoch for d in again} == {epoch}

    run(main())


def test_a_delivery_with_a_newer_epoch_raises_the_known_epoch(worker_url: str) -> None:
    async def main() -> None:
        async with await Client.connect(worker_url, client_id="m1") as a, \
                await Client.connect(worker_url, client_id="m2") as b:
            await a.mpublish("shared", [b"x", b"y"])
            sa = await a.subscribe("shared", group="g", mode="shared", start="earliest")
            sb = await b.subscribe("shared", group="g", mode="shared", start="earliest")
            newer = await sb.seek("earliest")  # a does not know yet
            assert sa.epoch < newer
            got = await sa.pull(5)
            assert got and sa.epoch == newer and sa.dropped == 0

    run(main())


def test_async_iterator_yields_and_acks(worker_url: str) -> None:
    async def main() -> None:
        async with await Client.connect(worker_url, client_id="iter") as c:
            sub = await c.subscribe("stream")
            consumed: list[bytes] = []

            async def consume() -> None:
                async for d in sub.iter(count=2, block_ms=200):
                    consumed.append(d.payload)
                    assert await sub.ack(d) == 1  # no PULL outstanding while the body runs
                    if len(consumed) == 5:
                        break

            async with Client(worker_url, client_id="iter-producer") as p:
                task = asyncio.ensure_future(consume())
                await asyncio.sleep(0.05)
                for i in range(5):
                    await p.publish("stream", b"%d" % i)
                await asyncio.wait_for(task, 10)
            assert consumed == [b"0", b"1", b"2", b"3", b"4"]

    run(main())


def test_preempted_owner_gets_a_pushed_notice(worker_url: str) -> None:
    async def main() -> None:
        async with await Client.connect(worker_url, client_id="first") as a, \
                await Client.connect(worker_url, client_id="second", protocol=2) as b:
            sa = await a.subscribe("lite", lmq="s-1")
            await b.subscribe("lite", lmq="s-1")  # exclusive: last subscriber wins
            notice = await asyncio.wait_for(a.notices().__anext__(), 5)
            assert notice["type"] == "unsubscribe" and notice["handle"] == sa.handle
            assert notice["lmq"] == "s-1" and notice["by"] == "second"
            # also queued for HEARTBEAT, under the same notice id: the client hands it out once
            queued = [_notice(n) for n in await a.execute("HEARTBEAT")]
            assert [(n["type"], n["nid"]) for n in queued] == [("unsubscribe", notice["nid"])]
            assert await sa.pull() == []  # evicted: no message

    run(main())


def test_a_notice_pushed_and_then_drained_by_heartbeat_is_handed_out_once(worker_url: str) -> None:
    async def main() -> None:
        async with await Client.connect(worker_url, client_id="once-a") as a, \
                await Client.connect(worker_url, client_id="once-b") as b:
            await a.subscribe("lite", lmq="once")
            await b.subscribe("lite", lmq="once")
            pushed = await asyncio.wait_for(a.notices().__anext__(), 5)
            assert pushed["type"] == "unsubscribe"
            assert await a.heartbeat() == []  # the same notice, drained: not handed out again
            await a.subscribe("lite", lmq="once")  # takes it back: b is told, once
            await asyncio.wait_for(b.notices().__anext__(), 5)
            assert await b.heartbeat() == []

    run(main())


def test_same_id_connecting_again_shares_the_session_until_it_takes_it_over(worker_url: str) -> None:
    async def main() -> None:
        old = await Client.connect(worker_url, client_id="twin")
        sub = await old.subscribe("twins")
        new = await Client.connect(worker_url, client_id="twin")
        try:
            assert await sub.pull(block_ms=100) == [] and not old.closed  # one session, two connections
            await new.execute("CLIENT", "TAKEOVER")
            with pytest.raises(ConnectionError):
                for _ in range(50):
                    await sub.pull(block_ms=100)
            assert old.closed
            assert await new.ping() == "PONG"
        finally:
            await old.close()
            await new.close()

    run(main())


def test_sync_facade_round_trip(worker_url: str) -> None:
    with SyncClient.connect(worker_url, client_id="blocking") as c:
        assert c.id == "blocking" and c.ping() == "PONG"
        ids = c.mpublish("sync", [b"a", b"b"])
        ids.append(c.publish("sync", b"c"))
        sub = c.subscribe("sync", start="earliest")
        got = sub.pull(2)
        assert [d.payload for d in got] == [b"a", b"b"]
        assert sub.ack(*got) == 2
        seen = []
        for d in sub.iter(block_ms=100):
            seen.append(d)
            sub.ack(d)
            break
        assert [d.id for d in seen] == [ids[2]]
        e = sub.seek("latest")
        assert sub.epoch == e
        with pytest.raises(BadArgument):
            c.execute("PULL", "not-a-handle")
        assert c.heartbeat() == []
    with pytest.raises(ConnectionError):
        c.ping()


@pytest.mark.parametrize("protocol", [2, 3])
def test_push_subscription_delivers_exactly_max_then_ends(worker_url: str, protocol: int) -> None:
    topic = f"pushed{protocol}"

    async def main() -> None:
        async with await Client.connect(worker_url, client_id=f"taker{protocol}", protocol=protocol) as c:
            await c.mpublish(topic, [b"%d" % i for i in range(5)])
            sub = await c.subscribe(topic, push=True, capacity=10, max=3, start="earliest")
            got = []
            async for d in sub.iter(block_ms=2000):
                got.append(d)
                assert await sub.ack(d) == 1
            assert [d.payload for d in got] == [b"0", b"1", b"2"]
            assert {d.epoch for d in got} == {sub.epoch}
            with pytest.raises(EndOfStream):
                await sub.take()

    run(main())


def test_take_times_out_and_unsub_max_ends_the_stream(worker_url: str) -> None:
    async def main() -> None:
        async with await Client.connect(worker_url, client_id="mailbox") as c:
            sub = await c.subscribe("mb", push=True)
            t0 = time.monotonic()
            assert await sub.take(block_ms=150) is None
            assert time.monotonic() - t0 >= 0.1
            await sub.unsubscribe(max=2)  # end after two deliveries in total
            await c.mpublish("mb", [b"a", b"b", b"c"])
            assert [d.payload async for d in sub.iter(block_ms=2000)] == [b"a", b"b"]
            assert sub.ended
            with pytest.raises(EndOfStream):
                await sub.take()

    run(main())


def test_heartbeat_sync_resends_the_notice_of_a_listed_lmq(worker_url: str) -> None:
    async def main() -> None:
        async with await Client.connect(worker_url, client_id="resync-a", protocol=2) as a, \
                await Client.connect(worker_url, client_id="resync-b", protocol=2) as b:
            sa = await a.subscribe("rooms", lmq="r1")
            await a.subscribe("rooms", lmq="r2")
            await b.subscribe("rooms", lmq="r1")  # preempts a
            assert [n["type"] for n in await a.heartbeat()] == ["unsubscribe"]
            again = await a.heartbeat(sync=("rooms", "default", ["r1", "r2"]))
            assert [(n["type"], n["handle"]) for n in again] == [("unsubscribe", sa.handle)]

    run(main())


def test_password_protected_worker(redis_server: Any) -> None:
    async def main(url: str) -> None:
        async with await Client.connect(url, client_id="authed", password="s3cret") as c:
            assert await c.ping() == "PONG"
            sub = await c.subscribe("private")
            assert await sub.pull() == []
        async with await Client.connect(url.replace("redis://", "redis://user:s3cret@"), protocol=2) as c:
            assert await c.ping() == "PONG"
        with pytest.raises(FenceMQError):
            await Client.connect(url, password="wrong")
        with pytest.raises(NoAuth):
            await Client.connect(url)  # HELLO without AUTH

    with WorkerThread(Config(redis_url=redis_server.url, port=0, password="s3cret")) as w:
        run(main(f"redis://127.0.0.1:{w.port}"))
