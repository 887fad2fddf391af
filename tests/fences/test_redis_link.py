"""The worker's pipelined connection for fence calls (fencemq.fences.redis_link), against a real Redis.

Many tasks share one connection and its replies come back in order, so what
must hold is that every caller gets its own reply — whatever its neighbours
sent, whether one of them failed or gave up waiting — and that a lost or
restarted Redis is met the way redis-py meets it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from fencemq.fences.redis_client import connect
from fencemq.fences.redis_link import RedisLink
from fencemq.server.embedded import EmbeddedRedis


def _link(server: EmbeddedRedis, **options: Any) -> RedisLink:
    link = RedisLink.for_client(connect(server.url, **options))
    assert link is not None
    return link


def test_a_thousand_calls_from_concurrent_tasks_each_get_their_own_reply(fresh_redis: EmbeddedRedis) -> None:
    async def main() -> None:
        link = _link(fresh_redis)
        try:
            async def one(i: int) -> tuple[Any, Any]:
                await link.execute("SET", f"k{i}", f"v{i}")
                return await link.execute("GET", f"k{i}"), await link.execute_many([("INCR", "n"), ("GET", f"k{i}")])

            got = await asyncio.gather(*(one(i) for i in range(1000)))
            assert [g[0] for g in got] == [f"v{i}".encode() for i in range(1000)]
            assert [g[1][1] for g in got] == [f"v{i}".encode() for i in range(1000)]
            assert sorted(g[1][0] for g in got) == list(range(1, 1001))
        finally:
            await link.aclose()

    asyncio.run(main())


def test_an_error_reply_is_its_callers_alone_and_pipelined_errors_come_back_in_place(
        fresh_redis: EmbeddedRedis) -> None:
    async def main() -> None:
        link = _link(fresh_redis)
        try:
            await link.execute("SET", "s", "text")
            outcomes = await asyncio.gather(link.execute("INCR", "s"), link.execute("GET", "s"),
                                            link.execute_many([("INCR", "s"), ("GET", "s")]), return_exceptions=True)
            assert isinstance(outcomes[0], ResponseError) and "not an integer" in str(outcomes[0])
            assert outcomes[1] == b"text"
            assert isinstance(outcomes[2][0], ResponseError) and outcomes[2][1] == b"text"
            with pytest.raises(NoScriptError):  # redis-py's error classes, which the fences rely on
                await link.execute("EVALSHA", "0" * 40, 0)
        finally:
            await link.aclose()

    asyncio.run(main())


def test_a_caller_that_gives_up_waiting_does_not_shift_the_replies_of_the_calls_after_it(
        fresh_redis: EmbeddedRedis) -> None:
    async def main() -> None:
        link = _link(fresh_redis)
        try:
            await link.execute("SET", "a", "A")
            # a Lua busy-wait holds Redis for ~50 ms: the caller times out before its reply comes
            slow = asyncio.ensure_future(link.execute(
                "EVAL", "local t = redis.call('TIME'); local s = t[1] * 1e6 + t[2]; "
                "repeat t = redis.call('TIME') until t[1] * 1e6 + t[2] > s + 50000; return 'slow'", 0))
            await asyncio.sleep(0.01)
            later = asyncio.ensure_future(link.execute("GET", "a"))
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(slow, 0.02)
            assert await later == b"A"
            assert await link.execute("ECHO", "next") == b"next"
        finally:
            await link.aclose()

    asyncio.run(main())


def test_a_restarted_redis_is_reconnected_to_and_a_dead_one_is_a_connection_error(
        fresh_redis: EmbeddedRedis) -> None:
    async def main() -> None:
        fast = Retry(ExponentialBackoff(cap=0.05, base=0.01), retries=2)
        link = _link(fresh_redis, retry=fast)
        try:
            await link.execute("SET", "kept", "1")
            fresh_redis.restart()
            assert await link.execute("GET", "kept") == b"1"  # (AOF) on a new connection
            fresh_redis.kill()
            with pytest.raises(RedisConnectionError):
                await link.execute("GET", "kept")
        finally:
            await link.aclose()

    asyncio.run(main())


def test_a_link_stands_in_only_for_a_plain_connection(fresh_redis: EmbeddedRedis) -> None:
    assert RedisLink.for_client(connect(fresh_redis.url)) is not None
    assert RedisLink.for_client(connect(fresh_redis.url.replace("redis://", "rediss://"))) is None
    assert RedisLink.for_client(redis.asyncio.Redis.from_url(fresh_redis.url, decode_responses=True)) is None
    assert RedisLink.for_client(redis.asyncio.Redis.from_url(fresh_redis.url, protocol=3)) is None


class _Holder:
    def __init__(self, link: RedisLink | None) -> None:
        self.link = link


def test_plain_commands_on_the_link_write_and_answer_exactly_as_redis_py_does(fresh_redis: EmbeddedRedis) -> None:
    """Linked (the connect path's plain commands) against the redis-py client itself: the same
    sequence, once on each, leaves the same keys and gets the same replies, errors included."""
    from fencemq.fences.redis_link import Linked

    async def sequence(r: Any, p: str) -> list[Any]:
        out: list[Any] = []
        for call in (lambda: r.hgetall(f"{p}h"), lambda: r.hset(f"{p}h", "a", 1),
                     lambda: r.hset(f"{p}h", mapping={"b": "2", "c": b"\x00\xff"}), lambda: r.hsetnx(f"{p}h", "a", 9),
                     lambda: r.hsetnx(f"{p}h", "d", 4), lambda: r.hget(f"{p}h", "c"), lambda: r.hget(f"{p}h", "zz"),
                     lambda: r.hdel(f"{p}h", "b", "nope"), lambda: r.hgetall(f"{p}h"),
                     lambda: r.smembers(f"{p}s"), lambda: r.sadd(f"{p}s", "x", "y"), lambda: r.smembers(f"{p}s"),
                     lambda: r.scard(f"{p}s"), lambda: r.zadd(f"{p}z", {"a\0b": 0, "a\0c": 0, "b\0a": 0}),
                     lambda: r.zrangebylex(f"{p}z", b"[a\0", b"(a\1"), lambda: r.hgetall(f"{p}s"),
                     lambda: r.many([("SMEMBERS", f"{p}s"), ("HGETALL", f"{p}h"), ("SCARD", f"{p}nothing")])):
            try:
                out.append(await call())
            except ResponseError as exc:
                out.append((type(exc), str(exc).split()[0]))
        try:
            await r.many([("SCARD", f"{p}s"), ("HGET", f"{p}s", "x")])
        except ResponseError as exc:  # (a redis-py pipeline says which command failed: the code is the same)
            out.append((type(exc), "WRONGTYPE" if "WRONGTYPE" in str(exc) else str(exc)))
        return out

    async def main() -> None:
        redis = connect(fresh_redis.url)
        link = RedisLink.for_client(redis)
        try:
            on_link = await sequence(Linked(redis, _Holder(link)), "L:")
            on_pool = await sequence(Linked(redis, _Holder(None)), "P:")
            assert on_link == on_pool
            assert on_link[-1] == (ResponseError, "WRONGTYPE") == on_link[15]  # the errors came, both ways
            for key in ("h", "s", "z"):
                assert await redis.dump(f"L:{key}") == await redis.dump(f"P:{key}")
        finally:
            if link is not None:
                await link.aclose()
            await redis.aclose()

    asyncio.run(main())
