"""Pipelined runs (PUBs to one queue, lmq SUBs of one topic, ACK + PULL of one handle) are an
optimisation, never a semantic: every command is checked as it would be alone, only those that
pass are merged, a merged call that committed never runs again, and the replies and what is stored
are those of sending the commands one by one (issue #30).
"""

from __future__ import annotations

import itertools
import os
import re

import anyio
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fencemq.model.keys import Keyspace, QueueRef
from fencemq.ops.users import UserStore
from tests.helpers import Err, RespConn, as_map, checkout_records, direct_async, pipeline, worker


def stored(redis_url: str, topic: str, prefix: str = "fmq") -> int:
    """Messages in a plain topic's log."""
    return redis.Redis.from_url(redis_url).hlen(f"{prefix}:{{t:{topic}}}:log")


def codes(replies: list) -> list:
    return [r.code if isinstance(r, Err) else r for r in replies]


def test_four_pubs_and_an_oversized_one_pipelined_are_ids_1_to_4_and_limit_with_4_stored(redis_url):
    with worker(redis_url, max_batch=4, max_payload=1024) as w, RespConn(w.port) as c:
        c.send_raw(pipeline(*[["PUB", "orders", f"m{i}"] for i in range(4)], ["PUB", "orders", b"x" * 2000]))
        assert codes(c.replies(5)) == ["1", "2", "3", "4", "LIMIT"]
        assert stored(redis_url, "orders") == 4


def test_an_mpub_over_max_batch_pipelined_with_a_pub_is_limit_as_alone(redis_url):
    with worker(redis_url, max_batch=4) as w, RespConn(w.port) as c:
        c.send_raw(pipeline(["MPUB", "orders", 5, *"abcde"], ["PUB", "orders", "f"]))
        assert codes(c.replies(2)) == ["LIMIT", "1"]
        assert stored(redis_url, "orders") == 1


def test_a_run_of_pubs_larger_than_max_batch_never_splits_an_mpub_across_fence_calls(redis_url):
    with worker(redis_url, max_batch=4) as w, RespConn(w.port) as c:
        c.send_raw(pipeline(["PUB", "orders", "a"], ["MPUB", "orders", 4, *"bcde"], ["PUB", "orders", "f"]))
        assert c.replies(3) == ["1", ["2", "3", "4", "5"], "6"]
        assert stored(redis_url, "orders") == 6


def test_a_pub_with_a_bad_argument_in_a_run_fails_alone_and_its_neighbours_are_stored_once(redis_url):
    with worker(redis_url, max_batch=4, max_payload=1024) as w, RespConn(w.port) as c:
        c.send_raw(pipeline(["PUB", "orders", "a"], ["PUB", "orders", "b"], ["MPUB", "orders", 2, "c", b"x" * 2000],
                            ["PUB", "orders", "d"], ["PUB", "orders", "e"], ["PUB", "orders", "f"]))
        assert codes(c.replies(6)) == ["1", "2", "LIMIT", "3", "4", "5"]
        assert stored(redis_url, "orders") == 5
        h = as_map(c.call("SUB", "orders", "GROUP", "g", "FROM", "EARLIEST"))["handle"]
        got = c.call("PULL", h, "COUNT", 4) + c.call("PULL", h, "COUNT", 4)
        assert [as_map(d)["payload"] for d in got] == list("abdef")


# -- the property: a pipelined run answers and stores what one-by-one does -----------------------
#
# Two brokers on one Redis (key prefixes pa and pb, the same handle secret, the same user): each
# example sends rounds of commands, pipelined in one write to the first and one at a time to the
# second, and holds the replies and what each stored to be the same. Commands mix valid ones with
# refusals of every kind a run meets: syntax, LIMIT (payload, batch, argument size, COUNT), NOPERM,
# a lite topic used as plain, bogus tags; ACK + PULL pairs of one handle; lmq SUBs of one topic.

EXAMPLES = int(os.environ.get("FENCEMQ_PIPELINE_EXAMPLES", "25"))
PASSWORD = "pipelined runs"
MAX_BATCH, MAX_PAYLOAD, MAX_ARG, MAX_ID = 4, 64, 128, 16


@pytest.fixture(scope="module")
def brokers(redis_server):
    url = redis_server.url
    r = redis.Redis.from_url(url)
    secret = os.urandom(32).hex()
    grants = [("publish", "ok/#"), ("publish", "lite/#"), ("subscribe", "ok/#"), ("subscribe", "lite/#")]

    async def add_user(prefix: str) -> None:
        conn = direct_async(url)
        try:
            await UserStore(conn, Keyspace(prefix).users).add("app", PASSWORD, grants)
        finally:
            await conn.aclose()

    workers = []
    for prefix in ("pa", "pb"):
        r.set(Keyspace(prefix).handle_secret, secret)
        anyio.run(add_user, prefix)
        workers.append(worker(url, prefix=prefix, users=True, max_batch=MAX_BATCH, max_payload=MAX_PAYLOAD,
                              max_arg_bytes=MAX_ARG, max_id_bytes=MAX_ID).start())
    yield workers, r
    for w in workers:
        w.stop()


_examples = itertools.count()


def _payload(big: bool, k: int) -> bytes:
    return b"x" * (MAX_PAYLOAD + 1) if big else b"p%d" % k


@st.composite
def commands(draw: st.DrawFn, n: int) -> list[tuple]:
    """A segment of a round: a run of PUB/MPUB to one queue (the batched path), of lmq SUBs of one
    topic, an ACK + PULL pair, or one other command; words ('TAGS', k…) stand for tags seen earlier."""
    topic = draw(st.sampled_from([f"ok/{n}/a", f"ok/{n}/a", f"ok/{n}/b", f"no/{n}", f"lite/{n}"]))
    qos = draw(st.sampled_from([(), (), ("QOS", "0"), ("QOS", "7")]))
    lmqs = st.sampled_from(["l1", "l2", "l3", "l1", "l|bad", "L" * (MAX_ARG + 1)])
    payloads = st.builds(_payload, st.integers(0, 5).map(lambda x: x == 0), st.integers(0, 999))
    kind = draw(st.sampled_from(["pubs", "pubs", "pubs", "lite", "subs", "ack", "pull", "consume", "ping",
                                 "syntax"]))
    handle = ("HANDLE",)
    tags = ("TAGS", *draw(st.lists(st.integers(-1, 30), min_size=1, max_size=MAX_BATCH + 1)))
    count = str(draw(st.integers(1, MAX_BATCH + 1)))
    dedup = st.sampled_from([(), (), (), ("ID", "d1"), ("ID", "d2"), ("ID", "D" * (MAX_ID + 1))])
    if kind == "pubs":
        run = []
        for _ in range(draw(st.integers(1, 6))):
            if draw(st.integers(0, 3)) == 0:
                size = draw(st.integers(1, MAX_BATCH + 1))
                run.append(("MPUB", topic, str(size), *[draw(payloads) for _ in range(size)], *draw(dedup)))
            else:
                run.append(("PUB", topic, draw(payloads), *qos, *draw(dedup)))
        return run
    if kind == "lite":
        lmq = draw(lmqs)
        return [("PUB", f"lite/{n}", draw(payloads), "LMQ", lmq) for _ in range(draw(st.integers(1, 6)))]
    if kind == "subs":
        target = draw(st.sampled_from([f"lite/{n}", f"lite/{n}", f"no/{n}"]))
        return [("SUB", target, "LMQ", draw(lmqs)) for _ in range(draw(st.integers(1, 6)))]
    if kind == "ack":
        return [("ACK", handle, tags)]
    if kind == "pull":
        return [("PULL", handle, "COUNT", count)]
    if kind == "consume":
        return [("ACK", handle, tags), ("PULL", handle, "COUNT", count)]
    if kind == "ping":
        return [("PING",)]
    return [draw(st.sampled_from([("PUB", f"ok/{n}/a"), ("MPUB", f"ok/{n}/a", "3", "a", "b"),
                                  ("SUB", f"lite/{n}", "LMQ"), ("ACK", handle)]))]


class Side:
    """One broker's connection in an example, and the delivery tags it has seen (in order)."""

    def __init__(self, port: int, proto: int, n: int) -> None:
        self.c = RespConn(port)
        assert self.c.call("AUTH", "app", PASSWORD) == "OK"
        self.c.hello(proto, f"c{n}")
        self.tags: list[str] = []
        self.handle = as_map(self.c.call("SUB", f"ok/{n}/a", "GROUP", "g", "FROM", "EARLIEST"))["handle"]

    def words(self, command: tuple) -> list:
        out: list = []
        for word in command:
            if word == ("HANDLE",):
                out.append(self.handle)
            elif isinstance(word, tuple):  # ('TAGS', k…): the k-th tag seen, or one never issued
                out += [self.tags[k] if 0 <= k < len(self.tags) else f"9{k}" for k in word[1:]]
            else:
                out.append(word)
        return out

    def normal(self, reply):
        """Tags by the order they were first seen, publish times out: the rest compared as it is."""
        if isinstance(reply, dict):
            reply = [x for kv in reply.items() for x in kv]
        if not isinstance(reply, list):
            return clockless(reply)
        out = [x if i % 2 and reply[i - 1] in ("tag", "ts") else self.normal(x) for i, x in enumerate(reply)]
        for i in range(0, len(out) - 1, 2):
            if out[i] == "tag":
                if out[i + 1] not in self.tags:
                    self.tags.append(out[i + 1])
                out[i + 1] = f"tag#{self.tags.index(out[i + 1])}"
            elif out[i] == "ts":
                out[i + 1] = 0
        return out


def clockless(value):
    """An lmq's ids start at the clock (lib/meta.lua, start_ids), so the two brokers' differ by the ms
    each lmq got its first message in: compared as the offset from that start (under 1,000 here)."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        return value
    return f"id+{n % 1000}" if n >= 10**15 else value


def stored_state(r: redis.Redis, prefix: str, n: int) -> dict:
    keys = Keyspace(prefix)
    state: dict = {}
    refs = [QueueRef(f"ok/{n}/a"), QueueRef(f"ok/{n}/b"), QueueRef(f"no/{n}"),
            *[QueueRef(f"lite/{n}", lmq) for lmq in ("l1", "l2", "l3")]]
    for ref in refs:
        k = keys.queue(ref)
        state[str(ref)] = (
            sorted((clockless(i), body.split(b":", 1)[1]) for i, body in r.hgetall(k.log).items()),
            # a lease batch's key names its first tag, from the clock: its span is what must agree
            sorted(re.sub(rb"\x00b\d+\+", b"\x00b+", rec) for rec in checkout_records(r, k).values()),
            r.zrange(k.ready, 0, -1), clockless(r.hget(k.meta, "seq")),
            {d: clockless(i) for d, i in r.hgetall(k.dedup_ids).items()})
    client = f"c{n}"
    state["session"] = (r.hgetall(keys.session_lite_counts(client)), sorted(r.smembers(keys.session_handles(client))),
                        [r.hgetall(keys.session_lmqs(client, b)) for b in range(16)])
    return state


@pytest.mark.timeout(max(120, EXAMPLES))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_pipelined_run_answers_and_stores_exactly_what_one_by_one_does(brokers, data) -> None:
    (pipelined, one_by_one), r = brokers
    n = next(_examples)
    proto = data.draw(st.sampled_from([2, 3]), label="proto")
    rounds = data.draw(st.lists(st.lists(commands(n), min_size=1, max_size=6), min_size=1, max_size=3),
                       label="rounds")
    a, b = Side(pipelined.port, proto, n), Side(one_by_one.port, proto, n)
    try:
        assert a.handle == b.handle
        for segments in rounds:
            cmds = [c for segment in segments for c in segment]
            # the words of a round are known before it is sent (a pipelining client knows no reply yet)
            a_words, b_words = [a.words(c) for c in cmds], [b.words(c) for c in cmds]
            a.c.send_raw(pipeline(*a_words))
            got = [a.normal(x) for x in a.c.replies(len(cmds))]
            want = [b.normal(b.c.call(*words)) for words in b_words]
            assert got == want, "\n".join(f"{' '.join(map(str, c))[:60]} -> {g!r} / {w!r}"
                                          for c, g, w in zip(cmds, got, want) if g != w)
        assert stored_state(r, "pa", n) == stored_state(r, "pb", n)
    finally:
        a.c.close()
        b.c.close()
