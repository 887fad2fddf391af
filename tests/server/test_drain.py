"""A worker draining for a deploy (SIGTERM; docs/operations.md, "Deploying"): it stops accepting,
tells its clients to move, answers what is in hand and exits within its bound; sessions live on."""

from __future__ import annotations

import threading
import time

import anyio
import paho.mqtt.client as mqtt
import pytest

from tests.helpers import Push, RespConn, as_map, deliveries, long_polls_parked, worker


def draining(w) -> None:
    """What SIGTERM does to a serving worker."""
    w.drain()


def test_a_resp3_client_is_told_to_move_served_a_moment_then_closed_and_its_session_lives_on(redis_url):
    with worker(redis_url, drain_timeout_ms=4000, server_reference="lb.example:7379") as w:
        c = RespConn(w.port)
        c.hello(3, "mover")
        h = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        started = time.monotonic()
        draining(w)
        notice = c.next_push()
        assert notice[0] == "notice" and notice[1]["type"] == "draining"
        assert notice[1]["worker"] == w.worker.id and notice[1]["within_ms"] == 4000
        assert notice[1]["server_reference"] == "lb.example:7379"
        # still served while the client moves
        assert c.call("PUB", "orders", "late") == "1"
        assert c.is_closed(timeout=3)
        assert time.monotonic() - started < 2.5  # closed at the end of the move window, not the bound
        w.stop()
    with worker(redis_url) as w2, RespConn(w2.port) as again:
        assert again.hello(3, "mover")["session"] == "resumed"  # the session outlived its worker
        assert [d["payload"] for d in deliveries(again.call("PULL", h, "COUNT", 10))] == ["late"]


def test_a_resp2_client_cannot_be_told_so_it_is_closed_once_idle(redis_url):
    with worker(redis_url) as w:
        c = RespConn(w.port)
        c.call("CLIENT", "SETNAME", "old-school")
        draining(w)
        assert c.is_closed(timeout=1)


@pytest.mark.parametrize("proto", [2, 3])
def test_a_long_poll_in_hand_answers_at_once_when_the_worker_drains(redis_url, proto):
    with worker(redis_url, drain_timeout_ms=10_000) as w:
        c = RespConn(w.port, timeout=10)
        c.hello(proto, "poller")
        h = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        c.send("PULL", h, "BLOCK", 8000)
        long_polls_parked(w)  # it waits
        started = time.monotonic()
        draining(w)
        # answered, not cut off with the connection (before, the drain closed it with no reply:
        # whatever a look had checked out for it waited out its lease)
        assert c.reply(timeout=5) == []
        assert time.monotonic() - started < 1.5
        assert c.is_closed(timeout=3)


def test_a_long_poll_sent_while_draining_does_not_wait(redis_url):
    with worker(redis_url, drain_timeout_ms=10_000) as w:
        c = RespConn(w.port, timeout=10)
        c.hello(3, "late-poller")
        h = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        draining(w)
        assert isinstance(c.next_push(), Push)
        started = time.monotonic()
        assert c.call("PULL", h, "BLOCK", 8000) == []
        assert time.monotonic() - started < 0.5


def test_the_worker_exits_within_its_bound_whatever_its_clients_do(redis_url):
    with worker(redis_url, drain_timeout_ms=1500) as w:
        stubborn = RespConn(w.port, timeout=10)
        stubborn.hello(3, "stubborn")
        stop = threading.Event()

        def chatter() -> None:  # never idle: a command always in hand
            while not stop.is_set():
                try:
                    stubborn.send_raw(b"*1\r\n$4\r\nPING\r\n" * 50)
                except OSError:
                    return
                time.sleep(0.001)

        t = threading.Thread(target=chatter, daemon=True)
        t.start()
        started = time.monotonic()
        draining(w)
        w._thread.join(10)
        stop.set()
        assert not w._thread.is_alive() and time.monotonic() - started < 3


def test_hello_says_whether_the_named_session_was_there(redis_url):
    with worker(redis_url) as w, RespConn(w.port) as a, RespConn(w.port) as b:
        assert a.hello(3, "s1")["session"] == "new"
        assert b.hello(3, "s1")["session"] == "resumed"  # a pool's second connection joins it
        assert as_map(b.call("HELLO", 3))["session"] == "resumed"


def test_an_mqtt5_client_has_its_deliveries_acknowledged_then_is_sent_elsewhere(redis_url):
    with worker(redis_url, mqtt_port=0, drain_timeout_ms=4000, server_reference="mqtt.example:1883") as w:
        got: list[bytes] = []
        gone: dict = {}
        done = threading.Event()
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="mq-drain", protocol=mqtt.MQTTv5)
        c.on_message = lambda _c, _u, msg: got.append(msg.payload)

        def on_disconnect(_c, _u, _flags, reason, props) -> None:
            gone.update(reason=reason.value, reference=getattr(props, "ServerReference", None))
            done.set()

        c.on_disconnect = on_disconnect
        subscribed = threading.Event()
        c.on_subscribe = lambda *_a: subscribed.set()
        c.connect("127.0.0.1", w.worker.mqtt_port, keepalive=30)
        c.loop_start()
        try:
            c.subscribe("deploy/#", qos=1)
            assert subscribed.wait(10)
            p = RespConn(w.port)
            for i in range(20):
                p.call("PUB", "deploy/x", f"m{i}")
            deadline = time.monotonic() + 10
            while len(got) < 20 and time.monotonic() < deadline:
                time.sleep(0.01)
            draining(w)
            assert done.wait(10)
            assert gone == {"reason": 0x8B, "reference": "mqtt.example:1883"}
        finally:
            c.loop_stop()
        assert len(got) == 20


def test_a_long_poll_whose_client_hangs_up_during_a_look_hands_back_what_the_look_checked_out(redis_url,
                                                                                               monkeypatch):
    with worker(redis_url) as w:
        leases = w.worker.core.leases
        looked = threading.Event()

        def slow_after_checkout(checkout):
            async def slowly(*args, **kwargs):
                result = await checkout(*args, **kwargs)
                if result.deliveries:
                    looked.set()
                    await anyio.sleep(0.4)  # Redis answered; meanwhile the client goes (a worker killed, a cut)
                return result
            return slowly

        # a look, or what a publish handed the waiting PULL: either checks the message out to it
        monkeypatch.setattr(leases, "pull", slow_after_checkout(leases.pull))
        monkeypatch.setattr(leases, "handed", slow_after_checkout(leases.handed))
        c = RespConn(w.port)
        c.hello(3, "hangs-up")
        h = as_map(c.call("SUB", "orders", "GROUP", "g", "LOCK", 60_000))["handle"]
        c.send("PULL", h, "BLOCK", 5000)
        time.sleep(0.1)
        with RespConn(w.port) as p:
            p.call("PUB", "orders", "in-flight")
            assert looked.wait(5)
            c.close()
            time.sleep(0.6)
        # back in the group at once (no failure counted), not after its 60 s lease
        with RespConn(w.port) as again:
            again.hello(3, "hangs-up")
            got = deliveries(again.call("PULL", h, "COUNT", 10))
            assert [(d["payload"], d["deliveries"]) for d in got] == [("in-flight", 2)]
