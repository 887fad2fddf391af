"""The SDK reconnecting by itself (docs/sdk.md, "Reconnecting"), against real workers.

Workers are stopped the way a deploy stops them (a drain: the SDK is told and moves), or cut
off abruptly by a proxy in front of them (as a ``kill -9`` or a network blip does: replies on
the wire are lost). The application code never sees an exception; its session, subscriptions,
epochs and checkouts carry on; nothing it published is stored twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from fencemq import Client, ConnectionLost, LiteSubscriptions, Reconnect, SessionExpired, SyncClient
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.sdk.reconnect import Addresses
from fencemq.server.embedded import free_port
from fencemq.server.runner import WorkerThread
from tests.helpers import worker

FAST = Reconnect(first_delay_s=0.02, max_delay_s=0.2, give_up_after_s=20)


def run(coro: Any, timeout: float = 60) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def url(w: WorkerThread | Proxy) -> str:
    return f"redis://127.0.0.1:{w.port}"


class Proxy:
    """A TCP proxy in front of a worker: ``cut()`` drops every connection at once, replies on the wire
    lost (a worker killed, a network blip); ``hold_replies`` keeps what the worker answers from
    reaching the client until the cut."""

    def __init__(self, target_port: int, port: int | None = None) -> None:
        self.target_port = target_port
        self.port = port or free_port()
        self.hold_replies = False
        self.refusing = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refusing:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            while replies and self.hold_replies and not self._stop:
                time.sleep(0.005)
            try:
                dst.sendall(data)
            except OSError:
                return

    def cut(self) -> None:
        """Every connection through the proxy ends now (RST), whatever was on its way."""
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.shutdown(socket.SHUT_RDWR)  # wakes the pump blocked reading it; the close then resets
            with contextlib.suppress(OSError):
                s.close()
        self.hold_replies = False

    def close(self) -> None:
        self._stop = True
        self._listener.close()
        self.cut()


@contextlib.contextmanager
def behind_proxy(redis_url: str, **settings: Any) -> Iterator[tuple[WorkerThread, Proxy]]:
    """A worker, and a proxy in front of it that the client connects through."""
    with worker(redis_url, **settings) as w:
        proxy = Proxy(w.port)
        try:
            yield w, proxy
        finally:
            proxy.close()


@pytest.fixture
def workers(redis_url: str) -> Iterator[list[WorkerThread]]:
    started = [worker(redis_url, drain_timeout_ms=3000, session_lease_ms=3000).start() for _ in range(3)]
    yield started
    for w in started:
        w.stop()


def stored(redis_url: str, topic: str) -> int:
    """How many messages the topic's log was ever given (its last id: consumed ones may be gone)."""
    r = redis.Redis.from_url(redis_url)
    try:
        return int(r.hget(Keyspace().queue(QueueRef(topic)).meta, "seq") or 0)
    finally:
        r.close()


# -- moving off a draining worker --------------------------------------------------------------


def test_a_client_moves_off_a_draining_worker_with_no_error_and_its_session_whole(workers, redis_url) -> None:
    async def main() -> None:
        told: list[dict] = []
        urls = [url(w) for w in workers]
        async with Client(urls[:1] + urls[1:], client_id="mover", on_notice=told.append, reconnect=FAST) as c:
            sub = await c.subscribe("moving", group="g", lock_ms=60_000)
            await c.mpublish("moving", [b"a", b"b"])
            first = await sub.pull(1)
            home = next(w for w in workers if w.worker.id == c.worker)
            home.drain()
            # the application goes on calling while the worker drains and the client moves
            ids = [await c.publish("moving", b"m%d" % i) for i in range(20)]
            assert await sub.ack(*first) == 1  # its checkout is still its own: same session
            rest = []
            while len(rest) < 21:
                rest += await sub.pull(50, block_ms=500)
            assert [d.payload for d in rest] == [b"b"] + [b"m%d" % i for i in range(20)]
            assert len(set(ids)) == 20
            assert c.worker != home.worker.id
            kinds = [n["type"] for n in told]
            assert kinds[:3] == ["draining", "disconnected", "reconnected"]
            reconnected = told[2]
            assert reconnected["session"] == "resumed" and reconnected["worker"] == c.worker

    run(main())
    assert stored(redis_url, "moving") == 22


def test_the_client_opens_its_next_connection_before_the_draining_worker_closes_the_old(workers) -> None:
    async def main() -> None:
        told: list[tuple[float, dict]] = []
        loop = asyncio.get_running_loop()
        async with Client([url(w) for w in workers], client_id="early", reconnect=FAST,
                          on_notice=lambda n: told.append((loop.time(), n))) as c:
            sub = await c.subscribe("early", group="g")
            home = next(w for w in workers if w.worker.id == c.worker)
            polling = asyncio.ensure_future(sub.pull(10, block_ms=10_000))  # a long poll in hand
            await asyncio.sleep(0.1)
            started = loop.time()
            home.drain()
            assert await asyncio.wait_for(polling, 5) == []  # answered by the old worker, at once
            await c.ping()
            (when, reconnected), = [(t, n) for t, n in told if n["type"] == "reconnected"]
            # well inside the second the worker serves a client it told to move
            assert when - started < 0.8 and reconnected["worker"] != home.worker.id

    run(main())


# -- a worker gone at once: replies lost ---------------------------------------------------------


def test_a_publish_whose_reply_was_lost_is_sent_again_and_stored_once(redis_url) -> None:
    with behind_proxy(redis_url) as (w, proxy):
        async def main() -> list[str]:
            async with Client([url(proxy)], client_id="resender", reconnect=FAST) as c:
                proxy.hold_replies = True  # the worker runs them; their replies never come back
                sent = asyncio.gather(c.publish("once", b"single"), c.mpublish("once", [b"x", b"y"]),
                                      *(c.publish("once", b"p%d" % i) for i in range(10)))
                await asyncio.sleep(0.3)
                assert stored(redis_url, "once") == 13  # all of it is stored already
                proxy.cut()
                return await sent

        got = run(main())
    assert stored(redis_url, "once") == 13  # and not again: the resend carried the same dedup ids
    assert got[1] == [str(int(got[0]) + 1), str(int(got[0]) + 2)]


def test_an_ack_of_a_delivery_settled_while_the_connection_was_down_is_sent_on_the_next(redis_url) -> None:
    with behind_proxy(redis_url) as (w, proxy):
        async def main() -> None:
            async with Client([url(proxy)], client_id="acker", reconnect=FAST) as c:
                sub = await c.subscribe("acked", group="g", lock_ms=60_000)
                await c.mpublish("acked", [b"1", b"2", b"3"])
                batch = await sub.pull(3)
                proxy.refusing = True
                proxy.cut()
                acking = asyncio.ensure_future(sub.ack(*batch))  # waits for the next connection
                await asyncio.sleep(0.3)
                assert not acking.done()
                proxy.refusing = False
                assert await acking == 3
                assert await sub.pull(3) == []  # settled: nothing comes back

        run(main())


def test_iteration_simply_continues_across_a_cut(redis_url) -> None:
    with behind_proxy(redis_url) as (w, proxy):
        async def main() -> list[bytes]:
            async with Client([url(proxy)], client_id="iter", reconnect=FAST) as c, \
                    Client([url(w)], client_id="iter-p") as p:
                # a PULL reply lost in a cut leaves its batch to come back when its lease ends: a short one
                sub = await c.subscribe("flow", group="g", lock_ms=1000)
                got: list[bytes] = []

                async def consume() -> None:
                    async for d in sub.iter(count=5, block_ms=200):
                        got.append(d.payload)
                        await sub.ack(d)
                        if len(got) == 40:
                            return

                task = asyncio.ensure_future(consume())
                for i in range(40):
                    await p.publish("flow", b"%d" % i)
                    if i in (10, 25):
                        proxy.cut()
                    await asyncio.sleep(0.01)
                await asyncio.wait_for(task, 20)
                return got

        got = run(main())
    # no exception, and everything once: what a lost reply carried was never seen, so its return after
    # the lease is no duplicate; ACKs lost in a cut went out again and settled
    assert sorted(got, key=int) == [b"%d" % i for i in range(40)]


def test_a_blocking_client_iterates_on_across_a_cut(redis_url) -> None:
    with behind_proxy(redis_url) as (w, proxy):
        with SyncClient.connect([url(proxy)], client_id="sync-iter", reconnect=FAST) as c, \
                SyncClient.connect(url(w), client_id="sync-iter-p") as p:
            sub = c.subscribe("sflow", group="g", lock_ms=60_000)
            p.mpublish("sflow", [b"%d" % i for i in range(10)])
            got = []
            for d in sub.iter(count=2, block_ms=200):
                got.append(d.payload)
                sub.ack(d)
                if len(got) == 3:
                    proxy.cut()
                if len(got) == 10:
                    break
            assert got == [b"%d" % i for i in range(10)]
            assert c.aio.reconnects >= 1


# -- the session ---------------------------------------------------------------------------------


def test_a_session_that_expired_while_away_is_said_plainly(redis_url) -> None:
    with behind_proxy(redis_url, session_lease_ms=500) as (w, proxy):
        async def main() -> None:
            told: list[dict] = []
            async with Client([url(proxy)], client_id="sleeper", reconnect=FAST, on_notice=told.append) as c:
                sub = await c.subscribe("napping", group="g")
                proxy.refusing = True
                proxy.cut()
                await asyncio.sleep(2)  # longer than the session's lease
                proxy.refusing = False
                with pytest.raises(SessionExpired, match="subscribe again"):
                    await sub.pull(1)
                assert "session_expired" in [n["type"] for n in told]
                assert isinstance(await c.publish("napping", b"still"), str)  # publishing goes on
                again = await c.subscribe("napping", group="g")
                assert [d.payload for d in await again.pull(5)] == [b"still"]

        run(main())


def test_subscriptions_keep_their_handles_and_epochs(redis_url) -> None:
    with behind_proxy(redis_url) as (w, proxy):
        async def main() -> None:
            async with Client([url(proxy)], client_id="epochs", reconnect=FAST) as c:
                sub = await c.subscribe("epo", group="g")
                await c.mpublish("epo", [b"a", b"b"])
                assert await sub.seek("earliest") == 1
                proxy.cut()
                assert sub.epoch == 1 and [d.epoch for d in await sub.pull(5)] == [1, 1]
                assert await sub.seek("earliest") == 2  # the same handle, its epoch moved on

        run(main())


def test_an_lmq_evicted_while_the_client_was_away_stays_evicted(redis_url) -> None:
    with behind_proxy(redis_url) as (w, proxy):
        async def main() -> None:
            evicted: list[dict] = []
            async with Client([url(proxy)], client_id="lite-away", reconnect=FAST) as a, \
                    Client([url(w)], client_id="lite-thief") as b, \
                    LiteSubscriptions(a, "chat", interval=60, on_unsubscribe=evicted.append) as lite:
                await lite.add("room-1")
                await lite.add("room-2")
                proxy.refusing = True
                proxy.cut()
                await b.subscribe("chat", lmq="room-1")  # preempted while a is away: its push is lost
                proxy.refusing = False
                deadline = time.monotonic() + 5
                while not evicted and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert [(n["lmq"], n.get("by")) for n in evicted] == [("room-1", "lite-thief")]
                assert lite.lmqs == ["room-2"]
                await b.publish("chat", b"for the thief", lmq="room-1")
                assert await lite.pull(5) == []  # never subscribed again behind its back

        run(main())


# -- giving up, retrying -------------------------------------------------------------------------


def test_it_gives_up_when_no_worker_answers_for_give_up_after_s(redis_url) -> None:
    with behind_proxy(redis_url) as (w, proxy):
        async def main() -> None:
            told: list[dict] = []
            policy = Reconnect(first_delay_s=0.02, max_delay_s=0.1, give_up_after_s=0.5)
            async with Client([url(proxy)], client_id="quitter", reconnect=policy, on_notice=told.append) as c:
                proxy.refusing = True
                proxy.cut()
                started = time.monotonic()
                with pytest.raises(ConnectionLost, match="gave up reconnecting"):
                    await c.ping()
                assert 0.4 < time.monotonic() - started < 3
                assert c.closed and told[-1]["type"] == "connection_lost"
                with pytest.raises(ConnectionLost):
                    await c.publish("t", b"x")

        run(main())


def test_a_name_with_several_dns_records_is_several_addresses(monkeypatch) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def getaddrinfo(host: str, port: int, **_: Any) -> list[Any]:
            assert host == "workers.internal"
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("10.0.0.1", "10.0.0.2")]

        monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
        addresses = Addresses(["redis://workers.internal:7379", "redis://127.0.0.1:7380"])
        names = {t.name for t in await addresses.targets()}
        assert names == {"workers.internal (10.0.0.1):7379", "workers.internal (10.0.0.2):7379", "127.0.0.1:7380"}
        for _ in range(10):  # the one just left is tried last
            assert (await addresses.targets(avoid="127.0.0.1:7380"))[-1].name == "127.0.0.1:7380"

    run(main())


def test_a_reply_saying_try_again_is_waited_out_and_the_command_sent_again() -> None:
    from fencemq.errors import TryAgain
    from fencemq.protocol.resp import ErrorReply
    from tests.sdk.test_client import FakeWorker

    answers = iter([ErrorReply("TRYAGAIN the broker's Redis is failing over"), ErrorReply("TRYAGAIN still"), "42"])
    fake = FakeWorker(lambda cmd: next(answers) if cmd[0] == b"PUB" else ErrorReply("TRYAGAIN always"))

    async def main() -> None:
        async with fake.running() as address, Client(address, client_id="patient", reconnect=FAST) as c:
            assert await c.publish("t", b"x") == "42"
            c.reconnect = Reconnect(first_delay_s=0.01, max_delay_s=0.02, give_up_after_s=0.1)
            with pytest.raises(TryAgain):  # past the policy's give-up, the refusal is the caller's
                await c.ping()

    run(main())
    pubs = [cmd for cmd in fake.commands if cmd[0] == b"PUB"]
    assert len(pubs) == 3 and len({tuple(p) for p in pubs}) == 1  # the same PUB, its dedup id and all


def test_execute_sends_again_only_what_is_safe_to_send_again() -> None:
    from fencemq.sdk.connection import resendable

    assert resendable(["PUB", "t", "x", "ID", "d"]) and resendable(["MPUB", "t", 1, "x", "ID", "d"])
    assert not resendable(["PUB", "t", "x"]) and not resendable(["PUB", "t", "ID"])  # "ID" is its payload there
    assert resendable(["ACK", "h", "t"]) and resendable(["pull", "h"])
    assert not resendable(["EXEC"]) and not resendable(["INCR", "k"])


def test_a_blocking_for_loop_ends_quietly_when_its_client_is_closed_from_another_thread(redis_url) -> None:
    with worker(redis_url) as w:
        c = SyncClient.connect(url(w), client_id="closed-under")
        sub = c.subscribe("quiet", group="g")
        ended: list[Any] = []

        def consume() -> None:
            try:
                for _ in sub.iter(block_ms=5000):  # a long poll in hand when the close comes
                    pass
                ended.append("ended")
            except Exception as exc:  # noqa: BLE001
                ended.append(exc)

        t = threading.Thread(target=consume)
        t.start()
        time.sleep(0.3)
        c.close()
        t.join(10)
        assert not t.is_alive() and ended == ["ended"]
