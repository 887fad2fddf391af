"""`fencemq top`'s rates count what happened between two refreshes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fencemq.model.keys import Keyspace
from fencemq.ops.maintenance import TopState, top_sample
from tests.helpers import client, deliveries, direct_async, worker

pytestmark = pytest.mark.standalone


def test_the_deliver_rate_counts_deliveries_not_the_clock_of_their_tags(redis_url: str) -> None:
    async def sample(state: TopState) -> dict[str, Any]:
        r = direct_async(redis_url)
        try:
            return await top_sample(r, Keyspace(), state)
        finally:
            await r.aclose()

    with worker(redis_url) as w:
        producer, consumer = client(w.port, name="top-p"), client(w.port, name="top-c")
        handle = consumer.execute_command("SUB", "top-rates", "GROUP", "g")[1]
        for i in range(20):
            producer.execute_command("PUB", "top-rates", f"m{i}")
        state = TopState()
        asyncio.run(sample(state))
        got = deliveries(consumer.execute_command("PULL", handle, "COUNT", 7))
        assert len(got) == 7
        producer.execute_command("PUB", "top-rates", "one more")
        second = asyncio.run(sample(state))
        (row,) = [q for q in second["queues"] if q["topic"] == "top-rates"]
        elapsed = second["interval_s"]
        # 7 deliveries and 1 publish in the interval, whatever the tags' clock did meanwhile
        assert row["rates"]["deliver"] * elapsed == pytest.approx(7, rel=0.02)
        assert row["rates"]["publish"] * elapsed == pytest.approx(1, rel=0.02)
        assert second["totals"]["deliver"] * elapsed == pytest.approx(7, rel=0.02)
        for c in (producer, consumer):
            c.close()
