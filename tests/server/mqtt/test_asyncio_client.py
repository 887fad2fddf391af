"""An asyncio MQTT client (aiomqtt) against the listener: TCP and WebSocket, both protocol versions."""

from __future__ import annotations

import asyncio

import aiomqtt
import pytest

from tests.helpers import worker

VERSIONS = {"3.1.1": aiomqtt.ProtocolVersion.V311, "5.0": aiomqtt.ProtocolVersion.V5}


@pytest.fixture
def w(redis_url):
    with worker(redis_url, mqtt_port=0, mqtt_ws_port=0) as started:
        yield started


async def first_messages(sub: aiomqtt.Client, n: int) -> list[tuple[str, bytes, int]]:
    got = []
    async for message in sub.messages:
        got.append((str(message.topic), bytes(message.payload), message.qos))
        if len(got) == n:
            return got
    return got


@pytest.mark.parametrize("transport", ["tcp", "websockets"])
@pytest.mark.parametrize("version", VERSIONS)
def test_an_aiomqtt_client_publishes_and_subscribes_at_qos_1_and_2(w, version, transport) -> None:
    port = w.worker.mqtt_port if transport == "tcp" else w.worker.mqtt_ws_port

    async def main() -> list[tuple[str, bytes, int]]:
        kwargs = dict(protocol=VERSIONS[version], transport=transport, timeout=10)
        async with aiomqtt.Client("127.0.0.1", port, identifier=f"aio-sub-{version}-{transport}", **kwargs) as sub, \
                aiomqtt.Client("127.0.0.1", port, identifier=f"aio-pub-{version}-{transport}", **kwargs) as pub:
            await sub.subscribe("aio/#", qos=2)
            await pub.publish("aio/one", b"1", qos=1)
            await pub.publish("aio/two", b"2", qos=2)
            return await asyncio.wait_for(first_messages(sub, 2), 10)

    assert asyncio.run(main()) == [("aio/one", b"1", 1), ("aio/two", b"2", 2)]


def test_MQTT_4_8_2_aiomqtt_members_of_a_shared_group_split_the_messages(w) -> None:
    async def main() -> tuple[list[bytes], list[bytes]]:
        port, kwargs = w.worker.mqtt_port, dict(protocol=aiomqtt.ProtocolVersion.V5, timeout=10)
        async with aiomqtt.Client("127.0.0.1", port, identifier="aio-a", **kwargs) as a, \
                aiomqtt.Client("127.0.0.1", port, identifier="aio-b", **kwargs) as b, \
                aiomqtt.Client("127.0.0.1", port, identifier="aio-p", **kwargs) as p:
            await a.subscribe("$share/aio/work", qos=1)
            await b.subscribe("$share/aio/work", qos=1)
            for i in range(10):
                await p.publish("work", f"{i}".encode(), qos=1)
            got_a: list[bytes] = []
            got_b: list[bytes] = []

            async def drain(c: aiomqtt.Client, into: list[bytes]) -> None:
                async for m in c.messages:
                    into.append(bytes(m.payload))

            async with asyncio.timeout(10):
                ta, tb = asyncio.create_task(drain(a, got_a)), asyncio.create_task(drain(b, got_b))
                while len(got_a) + len(got_b) < 10:
                    await asyncio.sleep(0.05)
                ta.cancel(), tb.cancel()
            return got_a, got_b

    got_a, got_b = asyncio.run(main())
    assert sorted(got_a + got_b) == sorted(f"{i}".encode() for i in range(10)), "each message once in the group"
    assert got_a and got_b
