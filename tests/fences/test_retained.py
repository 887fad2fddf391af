"""Retained messages found by what a filter can match (issue #30): the index by topic level that
lua/retain.lua and lua/unretain.lua keep, walked by fences/retained.py, held to a brute-force
model (every retained topic tested against the filter), the index held to exactly the live
topics' levels (nothing leaks when messages are cleared), and a lookup that reads the bodies of
matching topics only."""

from __future__ import annotations

import itertools
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fencemq.config import Config
from fencemq.fences.core import Core
from fencemq.model.keys import Keyspace
from fencemq.model.topics import matches
from tests.helpers import direct_async

_prefixes = (f"rt{i}" for i in itertools.count())


def run(redis_url: str, body: Any) -> Any:
    async def main() -> Any:
        r = direct_async(redis_url)
        try:
            return await body(Core(r, Config(redis_url=redis_url, prefix=prefix)), r)
        finally:
            await r.aclose()
    prefix = next(_prefixes)
    return anyio.run(main), prefix


async def found(core: Core, filt: str) -> set[bytes]:
    return {b for bodies in [x async for x in core.shared.retained.matching(filt)] for b in bodies}


def test_exact_plus_and_hash_filters_find_their_matches_and_the_dollar_rule_holds(redis_url) -> None:
    topics = ["a", "a/b", "a/b/c", "a/x/c", "a/x/d", "/lead", "//", "a//c", "$SYS/up", "b/c"]

    async def body(core: Core, r: Any) -> dict[str, set[bytes]]:
        for t in topics:
            await core.shared.retained.keep(t, t.encode())
        return {f: await found(core, f) for f in ["a/b/c", "a/+/c", "a/#", "#", "+", "+/+", "/+", "+/#",
                                                  "$SYS/#", "a/+", "nothing/+", "a/+/+/+", "+/+/c"]}

    got, _ = run(redis_url, body)
    for filt, bodies in got.items():
        assert bodies == {t.encode() for t in topics if matches(filt, t)}, filt


def test_clearing_every_retained_message_leaves_no_index_behind(redis_url) -> None:
    async def body(core: Core, r: Any) -> tuple[int, int]:
        retained = core.shared.retained
        for t in ["a/b/c", "a/b", "a/x/c", "z"]:
            await retained.keep(t, b"m")
        for t in ["a/b/c", "z", "a/x/c", "a/b"]:
            await retained.clear(t)
        keys = core.keys
        return await r.zcard(keys.retained_levels), await r.zcard(keys.retained_topics)

    assert run(redis_url, body)[0] == (0, 0)


def test_retained_messages_kept_before_the_index_existed_are_found(redis_url) -> None:
    async def body(core: Core, r: Any) -> set[bytes]:
        await r.hset(core.keys.retained, mapping={"old/a": b"1", "old/b/c": b"2"})  # an older version's data
        return await found(core, "old/#")

    assert run(redis_url, body)[0] == {b"1", b"2"}


@pytest.mark.standalone
def test_an_exact_subscribe_among_many_retained_reads_one_body(redis_url) -> None:
    """Redis sends the worker one body for an exact filter, the matches' for a/+/c: measured as
    Redis's own network output around the lookup, with 24 retained messages of 64 KiB elsewhere."""
    big = b"x" * 65536

    async def body(core: Core, r: Any) -> dict[str, int]:
        retained = core.shared.retained
        for i in range(24):
            await retained.keep(f"big/{i}/c", big)
        await retained.keep("small/x", b"tiny")
        await found(core, "small/x")  # the index checked once (a first lookup's cost)
        out = {}
        for filt in ["small/x", "small/+", "big/+/c", "big/3/c"]:
            before = int((await r.info("stats"))["total_net_output_bytes"])
            await found(core, filt)
            out[filt] = int((await r.info("stats"))["total_net_output_bytes"]) - before
        return out

    sent, _ = run(redis_url, body)
    assert sent["small/x"] < 4096 and sent["small/+"] < 4096
    assert 24 * 65536 <= sent["big/+/c"] < 25 * 65536
    assert 65536 <= sent["big/3/c"] < 2 * 65536


# -- the model: random keeps and clears, random filters -------------------------------------------

levels = st.sampled_from(["a", "b", "", "$s", "c"])
topic_names = st.lists(levels, min_size=1, max_size=4).map("/".join)
filters = st.lists(st.sampled_from(["a", "b", "", "$s", "+"]), min_size=1, max_size=4).flatmap(
    lambda ls: st.sampled_from(["/".join(ls), "/".join(ls + ["#"]), "#"]))
moves = st.lists(st.tuples(st.booleans(), topic_names), min_size=1, max_size=25)


def edges(topic: str) -> set[bytes]:
    out, parent = set(), ""
    for level in topic.split("/"):
        out.add((parent + "\0" + level).encode())
        parent += level + "/"
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(moves=moves, queries=st.lists(filters, min_size=1, max_size=6))
def test_lookups_match_a_brute_force_model_and_the_index_holds_the_live_topics_only(redis_url, moves,
                                                                                   queries) -> None:
    async def body(core: Core, r: Any) -> None:
        retained, model = core.shared.retained, {}
        for keep, topic in moves:
            if keep:
                model[topic] = f"{topic}#{len(model)}".encode()
                await retained.keep(topic, model[topic])
            else:
                model.pop(topic, None)
                await retained.clear(topic)
        for filt in queries:
            assert await found(core, filt) == {b for t, b in model.items() if matches(filt, t)}, filt
        live = set().union(*map(edges, model)) if model else set()
        assert set(await r.zrange(core.keys.retained_levels, 0, -1)) == live
        assert {t.decode() for t in await r.zrange(core.keys.retained_topics, 0, -1)} == set(model)

    run(redis_url, body)


def test_the_index_keys_share_the_retained_hash_slot() -> None:
    from redis.crc import key_slot

    keys = Keyspace("fmq")
    slots = {key_slot(k.encode()) for k in (keys.retained, keys.retained_topics, keys.retained_levels,
                                             keys.retained_indexed)}
    assert len(slots) == 1

