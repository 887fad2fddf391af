"""The worker over the wire: every verb's success and error path, RESP2 and RESP3.

Each test starts a worker (``fencemq.server.runner.WorkerThread``) on the flushed
private server of ``redis_url`` and talks to it as any client would: redis-py
with its reply callbacks removed (``helpers.client``) or a raw socket
(``helpers.RespConn``) where redis-py would hide what is under test — push
frames, exact error lines, inline commands, one-write pipelines, EOF.
"""

from __future__ import annotations

import base64
import threading
import time

import msgpack
import pytest
import redis

from fencemq.model.keys import Keyspace
from tests.helpers import (
    Err,
    Push,
    RespConn,
    as_map,
    client,
    deliveries,
    error_code,
    long_polls_parked,
    pipeline,
    text,
    wait_for,
    worker,
)


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def proto(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture
def w(redis_url):
    with worker(redis_url) as started:
        yield started


def sub(c, *args) -> str:
    """SUB …; returns the handle."""
    return as_map(c.execute_command("SUB", *args))["handle"]


def pull(c, handle: str, *opts) -> list[dict]:
    return deliveries(c.execute_command("PULL", handle, *opts))


def expect_error(code: str, fn, *args):
    with pytest.raises(redis.ResponseError) as info:
        fn(*args)
    assert error_code(info.value) == code, f"expected {code}, got {info.value!r} ({error_code(info.value)})"
    return info.value


# -- HELLO, PING, CLIENT ---------------------------------------------------------------


def test_hello_answers_a_map_naming_the_server_its_version_protocol_client_and_worker(w, proto):
    c = client(w.port, proto)
    reply = c.execute_command("HELLO", proto)
    assert isinstance(reply, dict) if proto == 3 else isinstance(reply, list)
    hello = as_map(reply)
    assert hello["server"] == "fencemq"
    assert hello["version"]
    assert hello["proto"] == proto
    assert hello["worker"] == w.worker.id
    # no name given: the id is the anonymous session's, the one SUB makes the owner
    assert hello["id"]
    assert as_map(c.execute_command("HELLO", proto))["id"] == hello["id"]
    assert as_map(c.execute_command("SUB", "orders"))["owner"] == hello["id"]


def test_hello_setname_binds_the_client_id_to_the_connection(w, proto):
    c = client(w.port, proto)
    hello = as_map(c.execute_command("HELLO", proto, "SETNAME", "alice"))
    assert hello["id"] == "alice"
    assert text(c.execute_command("CLIENT", "GETNAME")) == "alice"
    # the handles SUB hands out speak for that client id
    handle = sub(c, "orders")
    assert as_map(c.execute_command("SUB", "orders"))["owner"] == "alice"
    assert pull(c, handle) == []


def test_client_setname_names_the_session_like_hello_setname(w, proto):
    c = client(w.port, proto)
    assert text(c.execute_command("CLIENT", "SETNAME", "bob")) == "OK"
    assert as_map(c.execute_command("HELLO"))["id"] == "bob"


def test_a_connection_cannot_change_its_client_id(w, proto):
    c = client(w.port, proto, "carol")
    expect_error("BADARG", c.execute_command, "HELLO", proto, "SETNAME", "dave")
    assert as_map(c.execute_command("HELLO"))["id"] == "carol"


def test_hello_4_is_an_error_and_the_protocol_stays_as_it_was(w, proto):
    with RespConn(w.port) as c:
        if proto == 3:
            c.hello(3)
        reply = c.call("HELLO", 4)
        assert isinstance(reply, Err) and reply.code in ("BADARG", "NOPROTO", "ERR")
        reply = c.call("HELLO")
        assert isinstance(reply, dict) if proto == 3 else isinstance(reply, list)
        assert as_map(reply)["proto"] == proto


def test_ping_answers_pong_and_echoes_a_message(w, proto):
    with RespConn(w.port) as c:
        if proto == 3:
            c.hello(3)
        assert c.call("PING") == "PONG"
        assert c.call("PING", "hello there") == "hello there"
        assert c.call("PING", "a", "b").code == "ERR"
        assert c.call("PING") == "PONG"


# -- AUTH -------------------------------------------------------------------------------


@pytest.fixture
def locked(redis_url):
    with worker(redis_url, password="s3cret") as started:
        yield started


@pytest.mark.parametrize("command", [["PUB", "orders", "x"], ["SUB", "orders"], ["HEARTBEAT"], ["MPUB", "o", 1, "x"]])
def test_commands_before_auth_get_noauth_and_change_nothing(locked, proto, command):
    with RespConn(locked.port) as c:
        reply = c.call(*command)
        assert isinstance(reply, Err) and reply.code == "NOAUTH"
        assert c.call("PING") == "PONG"  # PING works unauthenticated, as in Redis
        assert c.call("AUTH", "s3cret") == "OK"
        h = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        assert c.call("PULL", h, "COUNT", 10) == []  # the refused PUB stored nothing


def test_a_wrong_password_is_refused_and_the_connection_stays_locked(locked):
    with RespConn(locked.port) as c:
        reply = c.call("AUTH", "guess")
        assert isinstance(reply, Err) and "WRONGPASS" in reply
        assert c.call("PUB", "orders", "x").code == "NOAUTH"
        reply = c.call("HELLO", 3, "AUTH", "default", "guess")
        assert isinstance(reply, Err) and "WRONGPASS" in reply
        assert c.call("PUB", "orders", "x").code == "NOAUTH"


def test_a_wrong_password_is_a_wrongpass_error_as_in_redis(locked):
    with RespConn(locked.port) as c:
        assert c.call("AUTH", "guess").code == "WRONGPASS"
    with pytest.raises(redis.AuthenticationError):
        client(locked.port, 2, password="guess").execute_command("PING")


def test_auth_with_the_password_unlocks_the_connection(locked, proto):
    c = client(locked.port, proto, password="s3cret")  # redis-py sends AUTH (RESP2) or HELLO 3 AUTH (RESP3)
    assert text(c.execute_command("PUB", "orders", "x")) == "1"
    with RespConn(locked.port) as raw:
        assert raw.call("AUTH", "default", "s3cret") == "OK"  # AUTH user pass
        assert raw.call("PUB", "orders", "y") == "2"


def test_hello_3_auth_user_pass_authenticates_switches_protocol_and_names_the_session(locked):
    with RespConn(locked.port) as c:
        reply = c.call("HELLO", 3, "AUTH", "default", "s3cret", "SETNAME", "eve")
        assert isinstance(reply, dict)
        assert reply["proto"] == 3 and reply["id"] == "eve"
        assert c.call("PUB", "orders", "x") == "1"


def test_hello_without_auth_on_a_locked_worker_is_noauth(locked):
    with RespConn(locked.port) as c:
        assert c.call("HELLO", 3).code == "NOAUTH"


def test_auth_on_a_worker_without_password_is_an_error(w):
    with RespConn(w.port) as c:
        assert c.call("AUTH", "whatever").code == "ERR"
        assert c.call("PING") == "PONG"


# -- QUIT -------------------------------------------------------------------------------


def test_quit_answers_ok_and_closes_the_connection_ignoring_what_follows(w, proto):
    with RespConn(w.port) as c:
        if proto == 3:
            c.hello(3)
        c.send_raw(pipeline(["QUIT"], ["PUB", "orders", "after-quit"]))
        assert c.reply() == "OK"
        assert c.is_closed(2.0)
    reader = client(w.port, proto)
    h = sub(reader, "orders", "GROUP", "g")
    assert pull(reader, h, "COUNT", 10) == []


# -- PUB, MPUB --------------------------------------------------------------------------


def test_pub_returns_a_message_id(w, proto):
    c = client(w.port, proto)
    first = c.execute_command("PUB", "orders", "hello")
    second = c.execute_command("PUB", "orders", "world")
    assert isinstance(first, bytes) and int(second) == int(first) + 1


def test_pub_with_the_same_dedup_id_returns_the_same_id_and_stores_it_once(w, proto):
    c = client(w.port, proto)
    a = c.execute_command("PUB", "orders", "charge", "ID", "order-7")
    b = c.execute_command("PUB", "orders", "charge again", "ID", "order-7")
    other = c.execute_command("PUB", "orders", "refund", "ID", "order-8")
    assert a == b != other
    got = pull(c, sub(c, "orders", "GROUP", "g"), "COUNT", 10)
    assert [d["payload"] for d in got] == ["charge", "refund"]


def test_mpub_returns_n_ids_in_order_and_delivers_in_that_order(w, proto):
    c = client(w.port, proto)
    ids = [int(i) for i in c.execute_command("MPUB", "orders", 4, "a", "b", "c", "d")]
    assert ids == list(range(ids[0], ids[0] + 4))
    got = pull(c, sub(c, "orders", "GROUP", "g"), "COUNT", 10)
    assert [(int(d["id"]), d["payload"]) for d in got] == list(zip(ids, "abcd"))


def test_mpub_whose_count_does_not_match_its_payloads_is_badarg(w, proto):
    c = client(w.port, proto)
    expect_error("BADARG", c.execute_command, "MPUB", "orders", 3, "a", "b")
    expect_error("BADARG", c.execute_command, "MPUB", "orders", 0, "a")


def test_pub_headers_arrive_with_the_delivery(w, proto):
    c = client(w.port, proto)
    c.execute_command("PUB", "orders", "x", "HDR", "trace", "abc", "HDR", "kind", "test")
    (d,) = pull(c, sub(c, "orders", "GROUP", "g"))
    headers = as_map(d["headers"]) if isinstance(d["headers"], list) else d["headers"]
    assert headers == {"trace": "abc", "kind": "test"}


# -- SUB, PULL, ACK ---------------------------------------------------------------------


def test_sub_pull_ack_round_trip(w, proto):
    c = client(w.port, proto, "consumer")
    msg_id = text(c.execute_command("PUB", "orders", "hello"))
    reply = c.execute_command("SUB", "orders", "GROUP", "g")
    assert isinstance(reply, dict) if proto == 3 else isinstance(reply, list)
    subscription = as_map(reply)
    assert subscription["mode"] == "shared" and subscription["epoch"] == 0
    handle = subscription["handle"]

    raw = c.execute_command("PULL", handle, "COUNT", 10)
    assert isinstance(raw, list) and len(raw) == 1
    assert isinstance(raw[0], dict) if proto == 3 else isinstance(raw[0], list)
    (d,) = deliveries(raw)
    assert d["id"] == msg_id
    assert d["topic"] == "orders"
    assert d["payload"] == "hello"
    assert d["epoch"] == 0
    assert d["deliveries"] == 1
    assert d["tag"]
    assert "lmq" not in d

    assert c.execute_command("ACK", handle, d["tag"]) == 1
    assert c.execute_command("ACK", handle, d["tag"]) == 0
    assert pull(c, handle, "COUNT", 10) == []


def test_pull_gives_each_message_of_a_shared_group_to_one_member(w, proto):
    a, b = client(w.port, proto, "a"), client(w.port, proto, "b")
    a.execute_command("MPUB", "orders", 4, "1", "2", "3", "4")
    ha, hb = sub(a, "orders", "GROUP", "g"), sub(b, "orders", "GROUP", "g")
    got_a = pull(a, ha, "COUNT", 2)
    got_b = pull(b, hb, "COUNT", 10)
    assert sorted(d["payload"] for d in got_a + got_b) == ["1", "2", "3", "4"]
    assert len(got_a) == 2 and len(got_b) == 2


def test_ack_settles_several_tags_at_once_and_ignores_unknown_ones(w, proto):
    c = client(w.port, proto)
    c.execute_command("MPUB", "orders", 3, "a", "b", "c")
    h = sub(c, "orders", "GROUP", "g")
    tags = [d["tag"] for d in pull(c, h, "COUNT", 3)]
    assert c.execute_command("ACK", h, *tags, "999999") == 3


def test_nack_returns_a_message_for_redelivery_with_deliveries_2(w, proto):
    c = client(w.port, proto)
    c.execute_command("PUB", "orders", "retry me")
    h = sub(c, "orders", "GROUP", "g")
    (first,) = pull(c, h)
    assert c.execute_command("NACK", h, first["tag"]) == 1
    (again,) = pull(c, h)
    assert again["id"] == first["id"] and again["payload"] == "retry me"
    assert again["deliveries"] == 2
    assert again["tag"] != first["tag"]
    assert c.execute_command("ACK", h, first["tag"]) == 0  # the old tag settles nothing
    assert c.execute_command("ACK", h, again["tag"]) == 1


def test_nack_discard_drops_the_message(w, proto):
    c = client(w.port, proto)
    c.execute_command("MPUB", "orders", 2, "poison", "fine")
    h = sub(c, "orders", "GROUP", "g")
    poison, fine = pull(c, h, "COUNT", 2)
    assert c.execute_command("NACK", h, poison["tag"], "DISCARD") == 1
    assert c.execute_command("NACK", h, fine["tag"]) == 1
    assert [d["payload"] for d in pull(c, h, "COUNT", 10)] == ["fine"]


def test_nack_delay_hides_the_message_until_the_delay_has_passed(w, proto):
    c = client(w.port, proto)
    c.execute_command("PUB", "orders", "later")
    h = sub(c, "orders", "GROUP", "g")
    (d,) = pull(c, h)
    nacked_at = time.monotonic()
    assert c.execute_command("NACK", h, d["tag"], "DELAY", 400) == 1
    assert pull(c, h, "COUNT", 10) == []
    (again,) = wait_for(lambda: pull(c, h, "COUNT", 10), timeout=3, what="the delayed message")
    assert time.monotonic() - nacked_at >= 0.39
    assert again["id"] == d["id"] and again["deliveries"] == 2


def test_a_blocked_pull_wakes_when_a_delayed_nack_becomes_due(w):
    c = client(w.port, 2)
    c.execute_command("PUB", "orders", "later")
    h = sub(c, "orders", "GROUP", "g")
    (d,) = pull(c, h)
    c.execute_command("NACK", h, d["tag"], "DELAY", 300)
    start = time.monotonic()
    got = pull(c, h, "BLOCK", 3000)
    assert [x["id"] for x in got] == [d["id"]]
    assert 0.25 <= time.monotonic() - start < 2.0


def test_renew_extends_a_lease_beyond_its_first_lock(w, proto):
    owner, other = client(w.port, proto, "owner"), client(w.port, proto, "other")
    owner.execute_command("PUB", "orders", "slow job")
    h = sub(owner, "orders", "GROUP", "g", "LOCK", 300)
    ho = sub(other, "orders", "GROUP", "g")
    (d,) = pull(owner, h)
    assert owner.execute_command("RENEW", h, d["tag"], "LOCK", 2000) == 1
    time.sleep(0.6)
    assert pull(other, ho, "COUNT", 10) == []  # not redelivered: the lease still runs
    assert owner.execute_command("HEARTBEAT") == []  # no message_timeout
    assert owner.execute_command("ACK", h, d["tag"]) == 1


def test_renew_of_a_tag_not_held_renews_nothing(w, proto):
    c = client(w.port, proto)
    c.execute_command("PUB", "orders", "x")
    h = sub(c, "orders", "GROUP", "g")
    (d,) = pull(c, h)
    c.execute_command("ACK", h, d["tag"])
    assert c.execute_command("RENEW", h, d["tag"]) == 0
    assert c.execute_command("RENEW", h, "123456", "LOCK", 1000) == 0


def test_a_late_ack_of_an_expired_tag_settles_nothing(w, proto):
    slow, fast = client(w.port, proto, "slow"), client(w.port, proto, "fast")
    slow.execute_command("PUB", "orders", "x")
    hs = sub(slow, "orders", "GROUP", "g", "LOCK", 200)
    hf = sub(fast, "orders", "GROUP", "g")
    (late,) = pull(slow, hs)
    (redelivered,) = wait_for(lambda: pull(fast, hf), timeout=3, what="the expired lease to come back")
    assert redelivered["id"] == late["id"] and redelivered["deliveries"] == 2
    assert slow.execute_command("ACK", hs, late["tag"]) == 0
    assert fast.execute_command("ACK", hf, redelivered["tag"]) == 1


def test_a_consumer_whose_lease_expired_is_suspected_until_it_subscribes_again(w, proto):
    c = client(w.port, proto, "sleepy")
    c.execute_command("PUB", "orders", "x")
    h = sub(c, "orders", "GROUP", "g", "LOCK", 200)
    (d,) = pull(c, h)
    time.sleep(0.6)
    assert pull(c, h) == []  # suspected: no new checkouts
    assert c.execute_command("ACK", h, d["tag"]) == 0  # too late to settle
    assert sub(c, "orders", "GROUP", "g", "LOCK", 200) == h  # subscribing again clears the suspicion
    (again,) = pull(c, h)
    assert again["id"] == d["id"] and again["deliveries"] == 2


def test_seek_earliest_redelivers_from_the_start_under_a_higher_epoch(w, proto):
    c = client(w.port, proto)
    c.execute_command("MPUB", "orders", 3, "a", "b", "c")
    h = sub(c, "orders", "GROUP", "g")
    before = pull(c, h, "COUNT", 10)
    assert [d["epoch"] for d in before] == [0, 0, 0]
    c.execute_command("ACK", h, before[0]["tag"])  # settled by the only group: gone (the topic keeps nothing)
    epoch = c.execute_command("SEEK", h, "EARLIEST")
    assert epoch == 1
    after = pull(c, h, "COUNT", 10)
    assert [d["payload"] for d in after] == ["b", "c"]
    assert all(d["epoch"] == epoch for d in after)
    assert c.execute_command("ACK", h, before[1]["tag"], before[2]["tag"]) == 0  # old epoch: stale
    assert c.execute_command("RENEW", h, before[1]["tag"]) == 0
    assert c.execute_command("ACK", h, *[d["tag"] for d in after]) == 2
    assert c.execute_command("SEEK", h, "EARLIEST") == 2  # the epoch only grows


def test_seek_latest_skips_everything_published_so_far(w, proto):
    c = client(w.port, proto)
    c.execute_command("MPUB", "orders", 2, "old1", "old2")
    h = sub(c, "orders", "GROUP", "g")
    assert c.execute_command("SEEK", h, "LATEST") == 1
    assert pull(c, h, "COUNT", 10) == []
    c.execute_command("PUB", "orders", "new")
    assert [d["payload"] for d in pull(c, h, "COUNT", 10)] == ["new"]


def test_seek_id_moves_the_cursor_to_that_message(w, proto):
    c = client(w.port, proto)
    ids = [text(i) for i in c.execute_command("MPUB", "orders", 3, "a", "b", "c")]
    h = sub(c, "orders", "GROUP", "g")
    c.execute_command("SEEK", h, "ID", ids[1])
    assert [d["payload"] for d in pull(c, h, "COUNT", 10)] == ["b", "c"]


@pytest.mark.parametrize("args", [["NOWHERE"], ["ID"], ["ID", "x"], ["TIME", "-5"], ["EARLIEST", "extra"]])
def test_seek_with_a_bad_target_is_badarg_and_keeps_the_epoch(w, args):
    c = client(w.port, 2)
    h = sub(c, "orders", "GROUP", "g")
    expect_error("BADARG", c.execute_command, "SEEK", h, *args)
    assert c.execute_command("SEEK", h, "LATEST") == 1


def test_unsub_returns_pending_checkouts_at_once_and_is_idempotent(w, proto):
    leaving, staying = client(w.port, proto, "leaving"), client(w.port, proto, "staying")
    leaving.execute_command("PUB", "orders", "pending")
    hl = sub(leaving, "orders", "GROUP", "g")
    hs = sub(staying, "orders", "GROUP", "g")
    (d,) = pull(leaving, hl)
    assert text(leaving.execute_command("UNSUB", hl)) == "OK"
    assert text(leaving.execute_command("UNSUB", hl)) == "OK"
    (back,) = pull(staying, hs)
    assert back["id"] == d["id"] and back["deliveries"] == 2
    assert leaving.execute_command("ACK", hl, d["tag"]) == 0
    expect_error("NOTFOUND", leaving.execute_command, "PULL", hl)


def test_commands_on_a_handle_never_subscribed_are_notfound_or_settle_nothing(w):
    from fencemq.model.keys import QueueRef
    from fencemq.model.handles import Handle

    c = client(w.port, 2, "nobody")
    h = w.worker.services.handles.sign(Handle(QueueRef("orders"), "g", "nobody").encode())
    expect_error("NOTFOUND", c.execute_command, "PULL", h)
    expect_error("NOTFOUND", c.execute_command, "SEEK", h, "EARLIEST")
    assert c.execute_command("ACK", h, "1") == 0
    assert text(c.execute_command("UNSUB", h)) == "OK"


def test_a_handle_made_up_by_a_client_is_noperm_before_any_fence_runs(w):
    from fencemq.model.keys import QueueRef
    from fencemq.model.handles import Handle

    c = client(w.port, 2, "forger")
    forged = Handle(QueueRef("orders"), "g", "forger").encode()
    # (a fence would answer NOTFOUND: it never joined; NOPERM is the worker's, before any fence)
    for verb, *args in (["PULL"], ["SEEK", "EARLIEST"], ["ACK", "1"], ["UNSUB"], ["TAKE"]):
        with pytest.raises(redis.ResponseError, match="not issued by this broker"):
            c.execute_command(verb, forged, *args)


# -- HEARTBEAT and notices ------------------------------------------------------------------


def test_heartbeat_lists_a_message_timeout_notice_after_a_lease_expired(w, proto):
    c = client(w.port, proto, "hb")
    c.execute_command("PUB", "orders", "x")
    h = sub(c, "orders", "LOCK", 200)
    (d,) = pull(c, h)
    assert c.execute_command("HEARTBEAT") == []
    time.sleep(0.6)
    notices = [as_map(n) for n in c.execute_command("HEARTBEAT")]
    assert len(notices) == 1
    (n,) = notices
    assert n["type"] == "message_timeout"
    assert n["handle"] == h and n["topic"] == "orders" and n["tags"] == [d["tag"]]
    assert c.execute_command("HEARTBEAT") == []  # drained


@pytest.mark.parametrize("verb", ["PULL", "TAKE"])
def test_a_suspected_member_whose_timeout_notice_was_lost_is_told_again_when_it_polls_and_can_show_life(
        w, redis_url, proto, verb):
    # A failover lost the notice (or the sweep's reply, or the worker that swept): without it a plain
    # client never knows to RENEW, and its PULLs came back empty for ever (CI: the Cluster failover)
    def poll(h: str, n: int) -> list[dict]:
        if verb == "PULL":
            return pull(c, h, "COUNT", n)
        return [as_map(r) for r in (c.execute_command("TAKE", h) for _ in range(n)) if r is not None]

    c = client(w.port, proto, "forgotten")
    c.execute_command("MPUB", "orders", 2, "a", "b")
    h = sub(c, "orders", "LOCK", 200, *(["PUSH"] if verb == "TAKE" else []))
    taken = poll(h, 2)
    r = redis.Redis.from_url(redis_url)
    wait_for(lambda: r.exists(Keyspace().session_notices("forgotten")), what="the sweep's notice")
    r.delete(Keyspace().session_notices("forgotten"))  # lost
    assert c.execute_command("HEARTBEAT") == []
    assert poll(h, 1) == []  # suspected: nothing, but told again
    (n,) = [as_map(n) for n in c.execute_command("HEARTBEAT")]
    assert n["type"] == "message_timeout" and n["handle"] == h and n["tags"] == [d["tag"] for d in taken]
    assert poll(h, 1) == [] and c.execute_command("HEARTBEAT") == []  # at most once a second a handle
    assert c.execute_command("RENEW", h, *n["tags"]) == 0  # settles nothing, shows life
    assert [d["payload"] for d in poll(h, 2)] == ["a", "b"]


@pytest.mark.parametrize("verb", ["PULL", "TAKE"])
def test_a_preempted_member_whose_unsubscribe_notice_was_lost_is_told_again_when_it_polls_on(
        w, redis_url, proto, verb):
    # Its polls are fenced, not refused: without the notice a plain client polls empty for ever and
    # never learns why. Its first poll after the preemption tells it nothing more (it may have had
    # that poll in flight when the notice came); polling on, it has missed it.
    def poll(h: str) -> list:
        if verb == "PULL":
            return pull(a, h, "COUNT", 1)
        taken = a.execute_command("TAKE", h)
        return [] if taken is None else [taken]

    def told() -> list[dict]:
        return [as_map(n) for n in a.execute_command("HEARTBEAT")]

    push = ["PUSH"] if verb == "TAKE" else []
    a, b = client(w.port, proto, "ousted"), client(w.port, proto, "usurper")
    h = sub(a, "ledger", "GROUP", "g", "MODE", "exclusive", *push)
    sub(b, "ledger", "GROUP", "g", "MODE", "exclusive", *push)
    r = redis.Redis.from_url(redis_url)
    wait_for(lambda: r.exists(Keyspace().session_notices("ousted")), what="the preemption's notice")
    r.delete(Keyspace().session_notices("ousted"))  # lost
    b.execute_command("PUB", "ledger", "for the usurper")
    assert poll(h) == [] and told() == []
    assert poll(h) == []
    (n,) = told()
    assert n["type"] == "unsubscribe" and n["reason"] == "preempted"
    assert n["handle"] == h and n["topic"] == "ledger" and n["by"] == "usurper" and n["resent"] in (True, 1)
    assert poll(h) == [] and told() == []  # at most once a second a handle
    time.sleep(1.1)
    assert poll(h) == [] and [n["by"] for n in told()] == ["usurper"]


def test_a_preempted_member_that_heard_its_notice_is_not_told_twice_by_its_last_poll(w, proto):
    a, b = client(w.port, proto, "heard"), client(w.port, proto, "taker")
    h = sub(a, "ledger", "GROUP", "g", "MODE", "exclusive")
    sub(b, "ledger", "GROUP", "g", "MODE", "exclusive")
    assert pull(a, h) == []  # a poll in flight as the notice came
    assert [as_map(n)["by"] for n in a.execute_command("HEARTBEAT")] == ["taker"]


def test_a_resp3_client_also_gets_the_timeout_notice_pushed(w):
    with RespConn(w.port) as c:
        c.hello(3, "pushed")
        c.call("PUB", "orders", "x")
        h = as_map(c.call("SUB", "orders", "LOCK", 200))["handle"]
        (d,) = deliveries(c.call("PULL", h))
        push = c.next_push(timeout=3)
        assert isinstance(push, Push) and push[0] == "notice"
        notice = push[1]
        assert notice["type"] == "message_timeout" and notice["handle"] == h and notice["tags"] == [d["tag"]]
        # the same notice is still listed by HEARTBEAT (pushes are fire-and-forget)
        assert [n["type"] for n in c.call("HEARTBEAT")] == ["message_timeout"]
        assert c.call("PING") == "PONG"


def test_a_resp3_push_arriving_during_a_pipeline_does_not_disturb_the_replies(w):
    with RespConn(w.port) as c:
        c.hello(3, "busy")
        h = as_map(c.call("SUB", "orders", "LOCK", 100))["handle"]
        c.call("PUB", "orders", "x")
        c.call("PULL", h)
        ids: list[str] = []
        deadline = time.monotonic() + 3
        while not c.pushes and time.monotonic() < deadline:  # keep talking while the notice arrives
            c.send_raw(pipeline(["PUB", "other", "y"], ["PUB", "other", "z"]))
            ids += c.replies(2)
            time.sleep(0.01)
        assert c.pushes and c.pushes[0][1]["type"] == "message_timeout"
        assert [int(i) for i in ids] == list(range(1, len(ids) + 1))


def test_a_resp2_client_gets_no_unsolicited_frames(w):
    with RespConn(w.port) as c:
        c.hello(2, "quiet")
        c.call("PUB", "orders", "x")
        h = as_map(c.call("SUB", "orders", "LOCK", 200))
        c.call("PULL", h["handle"])
        with pytest.raises(TimeoutError):
            c.read(timeout=0.7)
        (n,) = c.call("HEARTBEAT")
        assert as_map(n)["type"] == "message_timeout"


# -- lite topics: exclusive preemption --------------------------------------------------------


def test_a_second_exclusive_subscriber_preempts_the_first(w, proto):
    a, b = client(w.port, proto, "A"), client(w.port, proto, "B")
    first = as_map(a.execute_command("SUB", "chat", "LMQ", "s1"))
    assert first["mode"] == "exclusive" and first["owner"] == "A"
    second = as_map(b.execute_command("SUB", "chat", "LMQ", "s1"))
    assert second["owner"] == "B"
    b.execute_command("PUB", "chat", "hi", "LMQ", "s1")
    assert pull(a, first["handle"], "COUNT", 10) == []  # fenced: an empty array, no error
    (d,) = pull(b, second["handle"], "COUNT", 10)
    assert d["payload"] == "hi" and d["lmq"] == "s1" and d["topic"] == "chat"
    (notice,) = [as_map(n) for n in a.execute_command("HEARTBEAT")]
    assert notice["type"] == "unsubscribe"
    assert notice["handle"] == first["handle"]
    assert notice["topic"] == "chat" and notice["lmq"] == "s1"
    assert notice["reason"] == "preempted" and notice["by"] == "B"


def test_preemption_returns_the_old_owners_checkouts_to_the_new_owner(w, proto):
    a, b = client(w.port, proto, "A"), client(w.port, proto, "B")
    a.execute_command("PUB", "chat", "m1", "LMQ", "s1")
    ha = sub(a, "chat", "LMQ", "s1")
    (held,) = pull(a, ha)
    hb = sub(b, "chat", "LMQ", "s1")
    (d,) = pull(b, hb)
    assert d["id"] == held["id"] and d["deliveries"] == 2
    assert a.execute_command("ACK", ha, held["tag"]) == 0


def test_the_evicted_client_subscribing_again_preempts_back(w, proto):
    a, b = client(w.port, proto, "A"), client(w.port, proto, "B")
    ha = sub(a, "chat", "LMQ", "s1")
    hb = sub(b, "chat", "LMQ", "s1")
    assert sub(a, "chat", "LMQ", "s1") == ha
    a.execute_command("PUB", "chat", "mine again", "LMQ", "s1")
    assert [d["payload"] for d in pull(a, ha)] == ["mine again"]
    assert pull(b, hb) == []


def test_a_preempted_resp3_client_gets_the_unsubscribe_notice_pushed(w):
    with RespConn(w.port) as a, RespConn(w.port) as b:
        a.hello(3, "A")
        b.hello(3, "B")
        ha = as_map(a.call("SUB", "chat", "LMQ", "s9"))["handle"]
        b.call("SUB", "chat", "LMQ", "s9")
        push = a.next_push(timeout=3)
        assert push[0] == "notice"
        assert push[1]["type"] == "unsubscribe" and push[1]["handle"] == ha and push[1]["by"] == "B"


def test_policy_reject_gives_busy_to_a_second_subscriber(w, proto):
    a, b = client(w.port, proto, "A"), client(w.port, proto, "B")
    ha = sub(a, "chat", "LMQ", "s2", "POLICY", "reject")
    expect_error("BUSY", b.execute_command, "SUB", "chat", "LMQ", "s2", "POLICY", "reject")
    expect_error("BUSY", b.execute_command, "SUB", "chat", "LMQ", "s2")  # the group's policy holds
    a.execute_command("PUB", "chat", "still mine", "LMQ", "s2")
    assert [d["payload"] for d in pull(a, ha)] == ["still mine"]
    assert a.execute_command("HEARTBEAT") == []


def test_pub_to_a_lite_topic_without_lmq_is_badarg_and_vice_versa(w, proto):
    c = client(w.port, proto)
    c.execute_command("PUB", "chat", "x", "LMQ", "s1")
    expect_error("BADARG", c.execute_command, "PUB", "chat", "x")
    expect_error("BADARG", c.execute_command, "SUB", "chat")
    c.execute_command("PUB", "plain", "x")
    expect_error("BADARG", c.execute_command, "PUB", "plain", "x", "LMQ", "s1")
    expect_error("BADARG", c.execute_command, "SUB", "plain", "LMQ", "s1")


@pytest.mark.parametrize("verb", ["PULL", "ACK", "NACK", "RENEW", "SEEK", "UNSUB"])
def test_a_handle_of_another_client_gives_noperm_and_changes_nothing(w, proto, verb):
    owner, thief = client(w.port, proto, "owner"), client(w.port, proto, "thief")
    owner.execute_command("MPUB", "orders", 2, "a", "b")
    h = sub(owner, "orders", "GROUP", "g")
    (d,) = pull(owner, h)
    args = {"PULL": [], "ACK": [d["tag"]], "NACK": [d["tag"]], "RENEW": [d["tag"]], "SEEK": ["LATEST"], "UNSUB": []}
    err = expect_error("NOPERM", thief.execute_command, verb, h, *args[verb])
    assert "handle" in str(err)
    assert owner.execute_command("ACK", h, d["tag"]) == 1
    assert [x["payload"] for x in pull(owner, h, "COUNT", 10)] == ["b"]


def test_a_handle_on_an_anonymous_connection_is_refused_to_other_connections(w, proto):
    anon, other = client(w.port, proto), client(w.port, proto)
    h = sub(anon, "orders", "GROUP", "g")
    expect_error("NOPERM", other.execute_command, "PULL", h)


# -- bad input ------------------------------------------------------------------------------


def test_an_unknown_command_is_err_and_the_connection_stays_usable(w, proto):
    c = client(w.port, proto)
    err = expect_error("ERR", c.execute_command, "FLY", "away")
    assert "unknown command" in str(err)
    assert text(c.execute_command("PING")) == "PONG"


@pytest.mark.parametrize("command", [["PUB", "orders"], ["SUB"], ["PULL"], ["ACK", "h"], ["NACK", "h"],
                                     ["RENEW", "h"], ["SEEK", "h"], ["UNSUB"], ["QUIT", "now"], ["MPUB", "o", 1]])
def test_wrong_arity_is_an_error_and_the_connection_stays_usable(w, proto, command):
    with RespConn(w.port) as c:
        if proto == 3:
            c.hello(3)
        reply = c.call(*command)
        assert isinstance(reply, Err) and reply.code in ("ERR", "BADARG"), reply
        assert c.call("PING") == "PONG"


def test_an_oversize_payload_is_limit_and_the_connection_still_answers_ping(redis_url, proto):
    with worker(redis_url, max_payload=1024) as small, RespConn(small.port) as c:
        if proto == 3:
            c.hello(3)
        reply = c.call("PUB", "orders", b"x" * 2000)
        assert isinstance(reply, Err) and reply.code == "LIMIT"
        assert c.call("PING") == "PONG"
        assert c.call("MPUB", "orders", 2, b"ok", b"y" * 2000).code == "LIMIT"
        assert c.call("PUB", "orders", b"z" * 1024) == "1"  # at the limit is fine
        h = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        assert [len(d["payload"]) for d in deliveries(c.call("PULL", h, "COUNT", 10))] == [1024]


def test_batches_over_the_limit_are_limit_errors_and_the_connection_stays_usable(w, proto):
    with RespConn(w.port) as c:
        if proto == 3:
            c.hello(3)
        h = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        assert c.call("MPUB", "orders", 1001, *range(1001)).code == "LIMIT"
        assert c.call("ACK", h, *range(1001)).code == "LIMIT"
        assert c.call("PULL", h, "COUNT", 1001).code in ("LIMIT", "BADARG")
        assert c.call("PING") == "PONG"
        assert c.call("PULL", h, "COUNT", 1000) == []  # nothing of the refused MPUB was stored


def test_a_command_with_more_arguments_than_max_args_is_limit(redis_url):
    headers = [x for i in range(10) for x in ("HDR", f"k{i}", "v")]
    with worker(redis_url, max_args=16) as small, RespConn(small.port) as c:
        reply = c.call("PUB", "orders", "x", *headers)
        assert isinstance(reply, Err) and reply.code == "LIMIT", reply
        assert c.call("PING") == "PONG"


@pytest.mark.parametrize("frame", [b"*3\r\n$3\r\nPUB\r\n$6\r\norders\r\n$100000000\r\n", b"*2000000\r\n"],
                         ids=["bulk-over-64MiB", "two-million-arguments"])
def test_a_frame_over_the_hard_limits_is_refused_before_it_is_read_and_closes_the_connection(w, frame):
    with RespConn(w.port) as c:
        c.send_raw(frame)
        reply = c.reply()
        assert isinstance(reply, Err) and reply.code in ("ERR", "LIMIT"), reply
        assert c.is_closed()
    with RespConn(w.port) as other:
        assert other.call("PING") == "PONG"


def test_one_oversize_pub_in_a_pipeline_fails_alone(redis_url):
    with worker(redis_url, max_payload=1024) as small, RespConn(small.port) as c:
        c.send_raw(pipeline(["PUB", "orders", "a"], ["PUB", "orders", b"x" * 2000], ["PUB", "orders", "b"]))
        first, big, last = c.replies(3)
        assert big.code == "LIMIT"
        assert not isinstance(first, Err) and not isinstance(last, Err)


def test_pipelined_pubs_with_retain_behave_as_when_sent_one_by_one(w):
    with RespConn(w.port) as c:
        c.send_raw(pipeline(["PUB", "chat", "x", "LMQ", "s1", "RETAIN"], ["PUB", "chat", "y", "LMQ", "s1", "RETAIN"]))
        assert [isinstance(r, Err) and r.code for r in c.replies(2)] == ["BADARG", "BADARG"]
        c.send_raw(pipeline(["PUB", "sensors/b", "r1", "RETAIN"], ["PUB", "sensors/b", "r2", "RETAIN"]))
        c.replies(2)
        h = as_map(c.call("SUB", "sensors/+"))["handle"]
        got = as_map(c.call("TAKE", h, "BLOCK", 500) or [])
        assert got.get("payload") == "r2"  # the retained one, sent to a new filter subscription


@pytest.mark.parametrize(
    "command",
    [
        ["SUB", "orders", "GROUP", "a b"],
        ["SUB", "orders", "GROUP", "a|b"],
        ["SUB", "orders", "GROUP", ""],
        ["SUB", ""],
        ["PUB", "", "x"],
        ["PUB", "chat", "x", "LMQ", "s|1"],
        ["PUB", "chat", "x", "LMQ", "s 1"],
        ["SUB", "orders", "MODE", "broadcast"],
        ["SUB", "orders", "POLICY", "maybe"],
        ["SUB", "orders", "FROM", "yesterday"],
        ["SUB", "orders", "LOCK", "0"],
        ["SUB", "orders", "LOCK", "999999999"],
        ["SUB", "orders", "QOS", "2"],
        ["SUB", "orders", "COLOUR", "blue"],
        ["PUB", "orders", "x", "QOS", "7"],
        ["HELLO", 3, "SETNAME", "has space"],
        ["HELLO", 3, "SETNAME", "a|b"],
        ["CLIENT", "SETNAME", ""],
    ],
    ids=lambda c: " ".join(map(str, c)) or "empty",
)
def test_invalid_names_and_options_are_badarg_and_change_nothing(w, proto, command):
    with RespConn(w.port) as c:
        if proto == 3:
            c.hello(3)
        reply = c.call(*command)
        assert isinstance(reply, Err) and reply.code == "BADARG", reply
        h = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        assert c.call("PULL", h, "COUNT", 10) == []  # nothing was published


@pytest.mark.parametrize("opts", [["COUNT", "x"], ["COUNT", "0"], ["COUNT", "-1"], ["COUNT", "1.5"], ["COUNT"],
                                  ["BLOCK", "soon"], ["BLOCK", "-1"], ["WAIT", "1"]])
def test_a_bad_pull_option_is_badarg(w, proto, opts):
    c = client(w.port, proto)
    c.execute_command("PUB", "orders", "x")
    h = sub(c, "orders", "GROUP", "g")
    err = expect_error("BADARG", c.execute_command, "PULL", h, *opts)
    assert str(err)
    assert len(pull(c, h, "COUNT", 10)) == 1


@pytest.mark.parametrize("handle", ["not-a-handle", "h", "h!!!", "h" + base64.urlsafe_b64encode(b"junk").decode()])
def test_a_malformed_handle_is_badarg(w, proto, handle):
    c = client(w.port, proto)
    expect_error("BADARG", c.execute_command, "PULL", handle)
    expect_error("BADARG", c.execute_command, "ACK", handle, "1")


def test_a_forged_handle_with_the_wrong_types_is_badarg_and_the_worker_survives(w):
    forged = "h" + base64.urlsafe_b64encode(msgpack.packb([1, 123, None, "g", "mallory"])).rstrip(b"=").decode()
    with RespConn(w.port, timeout=2) as c:
        c.hello(2, "mallory")
        try:
            reply = c.call("PULL", forged)
        except Exception as exc:  # noqa: BLE001 — closed or silent: the worker died
            reply = exc
        assert isinstance(reply, Err) and reply.code == "BADARG", reply
    with RespConn(w.port, timeout=2) as other:
        assert other.call("PING") == "PONG"


def test_inline_commands_work_over_a_raw_socket(w):
    with RespConn(w.port) as c:
        c.send_raw(b"PING\r\n")
        assert c.reply() == "PONG"
        c.send_raw(b'PUB orders "hello world"\r\n')
        msg_id = c.reply()
        c.send_raw(b"SUB orders GROUP g\r\n")
        h = as_map(c.reply())["handle"]
        c.send_raw(f"PULL {h} COUNT 10\n".encode())  # a bare LF ends an inline command too
        (d,) = deliveries(c.reply())
        assert d["payload"] == "hello world" and d["id"] == msg_id
        c.send_raw(b'PUB orders "unbalanced\r\n')
        assert c.reply().startswith("ERR Protocol error")
        assert c.is_closed()


def test_a_malformed_multibulk_closes_only_that_connection(w):
    bystander = client(w.port, 2, "bystander")
    h = sub(bystander, "orders", "GROUP", "g")
    with RespConn(w.port) as bad:
        bad.send_raw(b"*1\r\n$4\r\nPING\r\n*2\r\n$abc\r\n")
        assert bad.reply() == "PONG"  # what came before the damage is answered
        err = bad.reply()
        assert isinstance(err, Err) and err.startswith("ERR Protocol error")
        assert bad.is_closed()
    with RespConn(w.port) as bad:
        bad.send_raw(b"*3\r\n$3\r\nPUB\r\n$6\r\norders\r\n$3\r\nabcdef\r\n")  # bulk longer than declared
        assert bad.reply().startswith("ERR Protocol error")
        assert bad.is_closed()
    assert text(bystander.execute_command("PING")) == "PONG"
    bystander.execute_command("PUB", "orders", "still here")
    assert [d["payload"] for d in pull(bystander, h, "COUNT", 10)] == ["still here"]


# -- pipelining --------------------------------------------------------------------------------


def test_500_pipelined_pubs_get_500_consecutive_ids_in_order(w, proto):
    with RespConn(w.port) as c:
        if proto == 3:
            c.hello(3)
        c.send_raw(pipeline(*[["PUB", "orders", f"m{i}"] for i in range(500)]))
        ids = [int(r) for r in c.replies(500)]
        assert ids == list(range(ids[0], ids[0] + 500))
        h = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        got = deliveries(c.call("PULL", h, "COUNT", 1000))
        assert [d["payload"] for d in got] == [f"m{i}" for i in range(500)]
        assert [int(d["id"]) for d in got] == ids


def test_a_pipeline_of_mixed_commands_is_answered_in_order(w, proto):
    with RespConn(w.port) as c:
        if proto == 3:
            c.hello(3)
        c.send_raw(pipeline(["PUB", "orders", "a"], ["MPUB", "orders", 2, "b", "c"], ["PING"], ["FLY"],
                            ["PUB", "orders", "d"], ["PUB", "other", "e"], ["PUB", "orders", "f", "ID", "x"]))
        a, bc, pong, err, d, e, f = c.replies(7)
        assert (a, bc, pong, d, e, f) == ("1", ["2", "3"], "PONG", "4", "1", "5")
        assert err.code == "ERR"


def test_a_client_pipelining_far_past_the_read_ahead_behind_a_long_poll_gets_every_reply_in_order(redis_url):
    # a read-ahead of 1 KiB, so 2,000 PINGs overflow it
    with worker(redis_url, max_read_ahead=1024) as w, RespConn(w.port) as c:
        h = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        c.send_raw(pipeline(["PULL", h, "BLOCK", 300], *[["PING", f"p{i}"] for i in range(2000)]))
        first, *pongs = c.replies(2001)
        assert first == [] and pongs == [f"p{i}" for i in range(2000)]
        assert c.call("PING") == "PONG"


# -- long-polls -----------------------------------------------------------------------------------


def test_a_blocked_pull_wakes_within_milliseconds_of_a_publish_from_another_connection(w, proto):
    consumer, producer = client(w.port, proto, "waiter"), client(w.port, proto)
    h = sub(consumer, "orders", "GROUP", "g")
    result: dict = {}

    def wait() -> None:
        result["reply"] = consumer.execute_command("PULL", h, "BLOCK", 5000)
        result["at"] = time.monotonic()

    t = threading.Thread(target=wait)
    t.start()
    long_polls_parked(w)
    published = time.monotonic()
    producer.execute_command("PUB", "orders", "wake up")
    t.join(6)
    latency = result["at"] - published
    print(f"long-poll wake-up latency ({'RESP' + str(proto)}): {latency * 1000:.1f} ms")
    assert [d["payload"] for d in deliveries(result["reply"])] == ["wake up"]
    assert latency < 0.2


def test_a_blocked_pull_on_an_empty_queue_returns_an_empty_array_after_its_timeout(w, proto):
    with RespConn(w.port) as c:
        if proto == 3:
            c.hello(3)
        h = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        start = time.monotonic()
        assert c.call("PULL", h, "BLOCK", 300) == []
        elapsed = time.monotonic() - start
        assert 0.3 <= elapsed < 1.5
        assert c.call("PING") == "PONG"


def test_a_blocked_pull_of_a_preempted_member_gets_nothing_and_waits_out_its_block_without_spinning(w):
    a, b = client(w.port, 2, "A"), client(w.port, 2, "B")
    ha = sub(a, "chat", "LMQ", "s1")
    result: dict = {}

    def wait() -> None:
        started = time.monotonic()
        result["reply"] = a.execute_command("PULL", ha, "BLOCK", 1500)
        result["took"] = time.monotonic() - started

    t = threading.Thread(target=wait)
    t.start()
    long_polls_parked(w)  # preempted while it waits, not before it asks
    sub(b, "chat", "LMQ", "s1")
    b.execute_command("PUB", "chat", "for B", "LMQ", "s1")
    t.join(6)
    assert result["reply"] == []  # the new owner's message never reaches the evicted member
    assert 1.3 <= result["took"] < 3.0  # fenced: it waits like any long poll, it does not answer at once


# -- Valkey --------------------------------------------------------------------------------------


def test_a_worker_on_valkey_serves_the_round_trip_preemption_and_long_polls(valkey_url):
    with worker(valkey_url) as v:
        a, b = client(v.port, 3, "A"), client(v.port, 2, "B")
        h = sub(a, "orders", "GROUP", "g")
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(reply=a.execute_command("PULL", h, "BLOCK", 3000)))
        t.start()
        long_polls_parked(v)
        b.execute_command("PUB", "orders", "on valkey")  # SPUBLISH wake-up on Valkey 8
        t.join(4)
        (d,) = deliveries(result["reply"])
        assert d["payload"] == "on valkey"
        assert a.execute_command("ACK", h, d["tag"]) == 1
        ha = sub(a, "chat", "LMQ", "s1")
        sub(b, "chat", "LMQ", "s1")
        b.execute_command("PUB", "chat", "x", "LMQ", "s1")
        assert pull(a, ha) == []
        assert [as_map(n)["type"] for n in a.execute_command("HEARTBEAT")] == ["unsubscribe"]
