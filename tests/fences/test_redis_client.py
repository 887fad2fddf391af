"""The worker's Redis client: a bounded pool whose commands wait for a connection rather than fail."""

from __future__ import annotations

import anyio
import pytest

from fencemq.fences.redis_client import connect

# The single-server client's pool (a Cluster gets redis-py's cluster client, which has its own per node).
pytestmark = pytest.mark.standalone


def test_more_concurrent_commands_than_pool_connections_all_run_and_the_pool_stays_bounded(redis_url):
    async def main() -> None:
        redis = connect(redis_url, max_connections=2)
        results: list[int] = []

        async def one(i: int) -> None:
            await redis.eval("return ARGV[1]", 0, i)
            results.append(int(await redis.incr("counted")))

        try:
            async with anyio.create_task_group() as tg:
                for i in range(200):
                    tg.start_soon(one, i)
            pool = redis.connection_pool
            assert len(pool._available_connections) + len(pool._in_use_connections) <= 2
        finally:
            await redis.aclose()
        assert sorted(results) == list(range(1, 201))

    anyio.run(main)


def test_a_command_waiting_past_wait_s_for_a_connection_fails_with_a_connection_error_and_frees_its_place(redis_url):
    from redis.exceptions import ConnectionError as RedisConnectionError

    async def main() -> None:
        redis = connect(redis_url, max_connections=1)
        pool = redis.connection_pool
        pool.wait_s = 0.2
        try:
            held = await pool.get_connection()
            with pytest.raises(RedisConnectionError, match="no connection to Redis came free"):
                await redis.ping()
            assert not pool._waiting
            await pool.release(held)
            assert await redis.ping()
        finally:
            await redis.aclose()

    anyio.run(main)
