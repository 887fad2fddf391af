"""Session binds and presence changes of concurrent connects, gathered into batches, leave Redis
exactly as the same calls made one by one do (the slow path the batches replace)."""

from __future__ import annotations

import random

import anyio
import msgpack
import pytest

from fencemq.config import Config
from fencemq.fences.core import Core
from fencemq.fences.redis_client import connect
from fencemq.model.meta import ONLINE
from fencemq.model.values import text

# Reads the state with a single-server client and one pattern subscription (the worker on a Cluster is
# tests/server/test_cluster_worker.py's).
pytestmark = pytest.mark.standalone


def _state(redis, core: Core, clients: list[str]) -> dict[str, object]:
    keys = core.keys
    out: dict[str, object] = {}
    for client in clients:
        session = {k: v for k, v in redis.hgetall(keys.session(client)).items() if k in (b"conn", b"worker", b"gen")}
        out[client] = (session, sorted(redis.smembers(keys.session_conns(client))),
                       redis.zscore(keys.sessions, client) is not None)
    return out


def _meta_online(redis, core: Core, topics: list[str]) -> dict[str, dict[bytes, bytes]]:
    """Each member's online flag (the meta fields ``g|member|on``)."""
    return {t: {k: v for k, v in redis.hgetall(core.keys.queue(core.ctx.queue(t, None)).meta).items()
                if k.endswith(b"|" + ONLINE.encode())} for t in topics}


def test_gathered_binds_and_presence_changes_end_as_the_same_calls_one_by_one(redis_url):
    import redis as sync_redis

    rng = random.Random(28)
    clients = [f"c{i}" for i in range(25)]
    # binds in arrival order: some clients twice or more (a pool joining, a takeover), then presence changes
    binds = [(rng.choice(clients), f"w:{n}", rng.random() < 0.3, rng.random() < 0.5) for n in range(150)]
    presence = [(rng.choice(clients), rng.random() < 0.5) for _ in range(80)]
    # the last connection's leave may start the session's own lease (0: left as it is)
    leaves = [(client, conn, rng.choice([0, 5000, 60000])) for client, conn, _, _ in rng.sample(binds, 60)]
    lingers = [(rng.choice(clients), rng.choice([1, 5000, 60000])) for _ in range(30)]
    answers: dict[str, list[object]] = {}
    topics = [f"t{i}" for i in range(5)]
    told: dict[str, list[object]] = {}

    async def scenario(prefix: str, gathered: bool) -> None:
        redis = connect(redis_url)
        core = Core(redis, Config(redis_url=redis_url, prefix=prefix))
        pubsub = redis.pubsub()
        await pubsub.psubscribe(f"{prefix}:sess:*")
        try:
            for client in clients[:10]:  # memberships for the presence changes to mark
                await core.sessions.bind(client, "setup", "w")
                for topic in topics[: 1 + int(client[1:]) % len(topics)]:
                    await core.subscriptions.subscribe(client, topic, group="g")
            async with anyio.create_task_group() as tg:
                if gathered:
                    core.ctx.spawn = tg.start_soon
                    async with anyio.create_task_group() as calls:
                        for client, conn, takeover, fresh in binds:
                            calls.start_soon(lambda c=client, t=conn, k=takeover, f=fresh:
                                             core.sessions.bind(c, t, "w", takeover=k, fresh=f))
                            await anyio.lowlevel.checkpoint() if rng.random() < 0.1 else None
                    async with anyio.create_task_group() as calls:
                        for client, online in presence:
                            calls.start_soon(lambda c=client, o=online: core.sessions.set_presence(c, online=o))
                    got: dict[int, object] = {}

                    async def into(i: int, call) -> None:
                        got[i] = await call

                    async with anyio.create_task_group() as calls:
                        for i, (client, conn, ms) in enumerate(leaves):
                            calls.start_soon(into, i, core.sessions.leave(client, conn, ms))
                    async with anyio.create_task_group() as calls:
                        for i, (client, ms) in enumerate(lingers):
                            calls.start_soon(into, len(leaves) + i, core.sessions.linger(client, ms))
                    answers[prefix] = [got[i] for i in range(len(got))]
                    assert core.sessions._binds.batches < len(binds) / 3, "binds were gathered"
                else:
                    for client, conn, takeover, fresh in binds:
                        await core.sessions.bind(client, conn, "w", takeover=takeover, fresh=fresh)
                    for client, online in presence:
                        await core.sessions.set_presence(client, online=online)
                    answers[prefix] = [await core.sessions.leave(c, conn, ms) for c, conn, ms in leaves]
                    answers[prefix] += [await core.sessions.linger(c, ms) for c, ms in lingers]
            notices = []
            while (msg := await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)) is not None:
                notices.append((text(msg["channel"]).split(":", 1)[1], msgpack.unpackb(msg["data"])))
            told[prefix] = notices
        finally:
            await pubsub.aclose()
            await redis.aclose()

    anyio.run(scenario, "slow", False)
    anyio.run(scenario, "fast", True)
    r = sync_redis.Redis.from_url(redis_url)
    slow_core, fast_core = (Core(r, Config(redis_url=redis_url, prefix=p)) for p in ("slow", "fast"))
    assert _state(r, fast_core, clients) == _state(r, slow_core, clients)
    online = _meta_online(r, fast_core, topics)
    assert {v for flags in online.values() for v in flags.values()} == {b"0", b"1"}, "presence changed both ways"
    assert online == _meta_online(r, slow_core, topics)
    assert told["fast"] == told["slow"], "the same takeover notices, in the same order"
    assert answers["fast"] == answers["slow"], "leave and linger answered the same"
    assert True in answers["fast"] and False in answers["fast"]


def test_gathered_filter_registrations_of_concurrent_subscribes_end_as_the_same_subscribes_one_by_one(redis_url):
    """A crowd's SUBSCRIBEs register their filters in gathered batches: the same registry, the same
    version, the same announcements as one registration each, and each subscriber gets its own answer."""
    import redis as sync_redis

    rng = random.Random(2828)
    # private filters, some subscribed twice (a resubscribe), and shared groups
    targets = [(f"d{rng.randrange(40)}", rng.choice([f"dev/{rng.randrange(30)}/+", "dev/#", "$share/g/dev/1"]))
               for _ in range(120)]
    answers: dict[str, list[object]] = {}
    announced: dict[str, list[bytes]] = {}

    async def scenario(prefix: str, gathered: bool) -> None:
        redis = connect(redis_url)
        core = Core(redis, Config(redis_url=redis_url, prefix=prefix))
        pubsub = redis.pubsub()
        await pubsub.subscribe(core.keys.filters_channel)
        assert (await pubsub.get_message(timeout=2))["type"] == "subscribe"  # listening before the first SUBSCRIBE
        try:
            got: dict[int, object] = {}

            async def one(i: int, client: str, target: str) -> None:
                sub = await core.shared.subscribe(client, target)
                got[i] = (sub.handle, sub.new_member)

            if gathered:
                async with anyio.create_task_group() as tg:
                    core.ctx.spawn = tg.start_soon
                    async with anyio.create_task_group() as calls:
                        for i, (client, target) in enumerate(targets):
                            calls.start_soon(one, i, client, target)
                    core.ctx.spawn = None
                assert core.shared.registry._registrations.batches < len(targets) / 3, "registrations were gathered"
            else:
                for i, (client, target) in enumerate(targets):
                    await one(i, client, target)
            answers[prefix] = [got[i] for i in range(len(targets))]
            messages = []
            while (msg := await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)) is not None:
                messages.append(msg["data"])
            announced[prefix] = sorted(messages)
        finally:
            await pubsub.aclose()
            await redis.aclose()

    anyio.run(scenario, "slowf", False)
    anyio.run(scenario, "fastf", True)
    r = sync_redis.Redis.from_url(redis_url)
    slow, fast = (Core(r, Config(redis_url=redis_url, prefix=p)).keys for p in ("slowf", "fastf"))
    assert r.hgetall(fast.filters) == r.hgetall(slow.filters) and r.hlen(fast.filters) > 10
    assert r.get(fast.filters_version) == r.get(slow.filters_version) == str(len(targets)).encode()
    assert announced["fastf"] == announced["slowf"] and len(announced["fastf"]) == len(targets)
    # the same handles, each new to exactly as many subscribers (which of two concurrent subscribes of
    # one client to one filter is the new one is the race's, not the gathering's)
    assert sorted(answers["fastf"]) == sorted(answers["slowf"])


def test_gathered_looks_of_many_subscriptions_get_what_the_same_pulls_one_by_one_get(redis_url):
    """A storm's resumed subscriptions look at their queues together (one round trip of lease intents,
    one of PULLs): each gets the deliveries, status and error it would have got pulling alone, and the
    queues are left the same (what each member holds, what is still ready)."""
    import redis as sync_redis

    from fencemq.model.handles import Handle

    rng = random.Random(2829)
    topics = [f"dev/{i}" for i in range(40)]
    # two members on some queues (a shared group's), messages on most, a queue gone, a COUNT out of range
    members = [(t, f"m{j}") for t in topics for j in range(1 + (int(t[4:]) % 3 == 0))]
    published = {t: rng.randrange(0, 6) for t in topics}
    looks = [(t, m, rng.choice([1, 2, 64])) for t, m in members]
    looks += [(t, m, 1) for t, m in rng.sample(members, 15)]  # some look twice (a second look, at once)
    looks += [(topics[0], "m0", 0)]  # refused: COUNT out of range
    rng.shuffle(looks)
    answers: dict[str, list[object]] = {}

    def outcome(result: object) -> object:
        if isinstance(result, Exception):
            return type(result).__name__
        return (result.status, [(d.id, d.payload, d.deliveries) for d in result.deliveries])

    async def scenario(prefix: str, gathered: bool) -> None:
        redis = connect(redis_url)
        core = Core(redis, Config(redis_url=redis_url, prefix=prefix))
        try:
            handles: dict[tuple[str, str], Handle] = {}
            for topic, member in members:
                sub = await core.subscriptions.subscribe(member, topic, group="g")
                handles[topic, member] = Handle.decode(sub.handle)
            for topic, n in published.items():
                if n:
                    await core.publishing.publish(topic, [f"{topic}:{k}".encode() for k in range(n)])
            gone = ("dev/39", "m0")
            await core.subscriptions.unsubscribe(handles[gone])  # its queue dropped with its only member
            got: dict[int, object] = {}
            if gathered:
                async def one(i: int, handle: Handle, count: int) -> None:
                    try:
                        got[i] = outcome(await core.leases.pull_gathered(handle, count))
                    except Exception as exc:
                        got[i] = outcome(exc)

                async with anyio.create_task_group() as tg:
                    core.ctx.spawn = tg.start_soon
                    async with anyio.create_task_group() as calls:
                        for i, (topic, member, count) in enumerate(looks):
                            calls.start_soon(one, i, handles[topic, member], count)
                    core.ctx.spawn = None
                assert core.leases._looks.batches < len(looks) / 5, "the looks were gathered"
            else:
                for i, (topic, member, count) in enumerate(looks):
                    try:
                        got[i] = outcome(await core.leases.pull(handles[topic, member], count))
                    except Exception as exc:
                        got[i] = outcome(exc)
            answers[prefix] = [got[i] for i in range(len(looks))]
        finally:
            await redis.aclose()

    anyio.run(scenario, "slowp", False)
    anyio.run(scenario, "fastp", True)
    r = sync_redis.Redis.from_url(redis_url)
    slow, fast = answers["slowp"], answers["fastp"]
    assert fast == slow
    assert "BadArgument" in fast and "NotFound" in fast, "the refusals are each call's own"
    assert sum(len(a[1]) for a in fast if isinstance(a, tuple)) > 40, "messages were delivered"

    def left(prefix: str) -> dict[str, object]:
        core = Core(r, Config(redis_url=redis_url, prefix=prefix))
        out = {}
        for topic in topics:
            k = core.keys.queue(core.ctx.queue(topic, None))
            out[topic] = (sorted(m.split(b"\0")[:2] == [b"g", b"m0"] for m in r.zrange(k.owned, 0, -1)),
                          r.zcard(k.deadlines), r.exists(k.meta))
        return out

    assert left("fastp") == left("slowp")
