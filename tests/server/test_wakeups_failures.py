"""A pub/sub connection being replaced never fails the long poll that subscribes meanwhile.

redis-py's PubSub has one socket: after a Redis restart, a subscribe that finds it closed reconnects
and reads the handshake's reply while the worker's reader task waits on that socket, and asyncio
raises RuntimeError ("read() called while another coroutine is already waiting for incoming data").
Seen under load in tests/server/test_worker_failures.py (a Redis restart): the RuntimeError left the
long poll and the worker closed the client's connection. Here the subscribe's failure is made
deterministic by giving the real PubSub's ``ssubscribe`` that error once.
"""

from __future__ import annotations

import anyio

from fencemq.server.wakeups import Wakeups
from tests.server.test_per_call_path import _with_wakeups

ONE_READER = "read() called while another coroutine is already waiting for incoming data"


def test_a_subscribe_cut_by_the_one_reader_rule_leaves_the_long_poll_looking_again_then_subscribes_again(
        redis_url):
    async def body(wakeups: Wakeups) -> None:
        real = wakeups.shards.ssubscribe
        calls: list[str] = []

        async def replaced_once(*channels):
            calls.append(channels[0])
            if len(calls) == 1:
                raise RuntimeError(ONE_READER)
            return await real(*channels)

        wakeups.shards.ssubscribe = replaced_once
        async with wakeups.watching("{q}:wake") as waiter:
            assert wakeups.look_again_s() is not None, "a failed subscribe: the waiter looks again on its own"
            with anyio.fail_after(2):
                await waiter.wait()  # woken by the look-again pause, not left waiting for ever
        async with wakeups.watching("{q}:wake") as waiter:  # the next long poll subscribes again
            assert calls == ["{q}:wake", "{q}:wake"] and wakeups.confirmed["{q}:wake"].is_set()
            await wakeups.redis.spublish("{q}:wake", "1")
            with anyio.fail_after(2):
                await waiter.wait()

    _with_wakeups(redis_url, body)
