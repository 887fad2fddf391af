"""The worker's per-call path for a client that does not pipeline (issue #32): each shortcut taken
there gives what the longer way it replaced gives.

A plain client (redis-py awaiting each call) pays the worker's fixed cost per command on every
command, so the steps every command takes were made cheaper; none of them may change what the
command does or what the worker counts.
"""

from __future__ import annotations

import anyio
import pytest
import redis.asyncio

from fencemq.fences.registry import SPECS
from fencemq.server import metrics
from fencemq.server.wakeups import Wakeups


# -- metrics: a command is counted under its verb, as labels() counted it -----------------------------


def test_a_command_is_counted_under_its_verb_as_labels_counts_it():
    before = metrics.COMMANDS.labels("PULL")._value.get()
    metrics.count_command("PULL")
    metrics.count_command("PULL")
    assert metrics.COMMANDS.labels("PULL")._value.get() == before + 2


def test_the_counted_child_is_the_one_labels_returns():
    metrics.count_command("ACK")
    metrics.observe_fence("ack", 0.001)
    assert metrics._command_counts["ACK"] is metrics.COMMANDS.labels("ACK")
    assert metrics._fence_times["ack"] is metrics.FENCE_SECONDS.labels("ack")


def test_a_fence_time_is_observed_in_its_fences_histogram():
    child = metrics.FENCE_SECONDS.labels("pull")
    count = sum(b.get() for b in child._buckets)
    metrics.observe_fence("pull", 0.0003)
    assert sum(b.get() for b in child._buckets) == count + 1


# -- a fence's ARGV: one set comparison instead of two scans, the same list or the same refusal ---------


def _spelled_out(spec, named, rest):
    """The arguments as arg_list built them before: every name checked both ways, then listed."""
    missing = [n for n in spec.argv if n not in named]
    unknown = [n for n in named if n not in spec.argv]
    if missing or unknown:
        raise TypeError(f"fence {spec.name}: missing ARGV {missing}, unknown {unknown}")
    if rest and spec.argv_rest is None:
        raise TypeError(f"fence {spec.name} takes no variadic arguments")
    return [*(named[n] for n in spec.argv), *rest]


def _outcome(fn, *args):
    try:
        return fn(*args)
    except TypeError as exc:
        return ("TypeError", str(exc))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_fence_lists_its_arguments_as_the_spelled_out_check_did(name):
    spec = SPECS[name]
    # in header order, whatever order the caller named them in
    named = {n: f"v-{n}" for n in reversed(spec.argv)}
    rest = ["r1", "r2"] if spec.argv_rest else []
    cases = [(named, rest), (named, []), (named, ["x"])]
    if spec.argv:
        cases.append(({n: v for n, v in named.items() if n != spec.argv[0]}, rest))  # one missing
    cases.append(({**named, "nonsense": 1}, rest))  # one unknown
    for args, tail in cases:
        assert _outcome(spec.arg_list, args, tail) == _outcome(_spelled_out, spec, args, tail)


# -- a long poll on a channel already confirmed: no needless task switch, cancellation as before ---------


def _with_wakeups(redis_url: str, body) -> None:
    async def main() -> None:
        r = redis.asyncio.Redis.from_url(redis_url)
        wakeups = Wakeups(r, "test-control")
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(wakeups.run)
                await wakeups.ready.wait()
                await body(wakeups)
                tg.cancel_scope.cancel()
        finally:
            await r.aclose()

    anyio.run(main)


def test_a_long_poll_on_a_confirmed_channel_starts_without_letting_another_task_run_first(redis_url):
    async def body(wakeups: Wakeups) -> None:
        async with wakeups.watching("{q}:wake"):
            pass  # the first long poll of the queue subscribes and waits for the confirmation
        ran: list[str] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _note(ran, "other task"))
            async with wakeups.watching("{q}:wake") as waiter:
                ran.append("long poll")  # before: each of two set events was a checkpoint
                assert waiter.wid
        assert ran == ["long poll", "other task"]

    _with_wakeups(redis_url, body)


def test_a_cancelled_long_poll_still_stops_before_it_looks(redis_url):
    async def body(wakeups: Wakeups) -> None:
        async with wakeups.watching("{q}:wake"):
            pass
        entered = False
        with anyio.CancelScope() as scope:
            scope.cancel()
            async with wakeups.watching("{q}:wake"):
                entered = True
        assert not entered and scope.cancelled_caught
        assert not wakeups.waiters["{q}:wake"]  # its waiter is gone with it

    _with_wakeups(redis_url, body)


def test_the_first_long_poll_of_a_queue_still_waits_for_its_subscription(redis_url):
    async def body(wakeups: Wakeups) -> None:
        async with wakeups.watching("{fresh}:wake"):
            assert wakeups.confirmed["{fresh}:wake"].is_set()

    _with_wakeups(redis_url, body)


async def _note(ran: list[str], what: str) -> None:
    ran.append(what)
