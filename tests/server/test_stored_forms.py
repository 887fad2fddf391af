"""Messages stored before the RESP form (msgpack bodies) still deliver through a worker, beside new ones."""

from __future__ import annotations

import msgpack
import pytest

import fencemq.fences.publish
import fencemq.fences.shared
from tests.helpers import as_map, client, deliveries, worker


def msgpack_body(payload, headers, qos, producer, topic=None) -> bytes:
    """The body an older worker stored (fencemq.model.messages before the RESP form)."""
    packed = msgpack.packb([payload, headers or None, qos, producer, topic], use_bin_type=True)
    return b"%d:%d:%s" % (qos, 0, packed)


@pytest.fixture
def older_worker_publishes(monkeypatch):
    """Publishing writes the older form while set (what an older worker on the same Redis does)."""
    def older() -> None:
        monkeypatch.setattr(fencemq.fences.publish, "pack_body", msgpack_body)
        monkeypatch.setattr(fencemq.fences.shared, "pack_body", msgpack_body)
    return older


@pytest.mark.parametrize("proto", [2, 3])
def test_messages_of_both_forms_are_pulled_and_taken_alike(redis_url, proto, older_worker_publishes, monkeypatch):
    with worker(redis_url) as w:
        c = client(w.port, proto, "consumer")
        pulled = as_map(c.execute_command("SUB", "orders", "GROUP", "g"))["handle"]
        pushed = as_map(c.execute_command("SUB", "orders", "GROUP", "p", "PUSH"))["handle"]
        filtered = as_map(c.execute_command("SUB", "orders/+", "PUSH"))["handle"]
        older_worker_publishes()
        c.execute_command("PUB", "orders", "old", "HDR", "k", "v")
        c.execute_command("PUB", "orders/eu", "old-eu")
        monkeypatch.undo()
        c.execute_command("PUB", "orders", "new", "HDR", "k", "v")
        c.execute_command("PUB", "orders/eu", "new-eu")

        got = deliveries(c.execute_command("PULL", pulled, "COUNT", 10))
        assert [(d["payload"], d["topic"], as_map(d["headers"])) for d in got] == [
            ("old", "orders", {"k": "v"}), ("new", "orders", {"k": "v"})]
        assert c.execute_command("ACK", pulled, *[d["tag"] for d in got]) == 2
        taken = [as_map(c.execute_command("TAKE", pushed)) for _ in range(2)]
        assert [(d["payload"], d["id"]) for d in taken] == [("old", got[0]["id"]), ("new", got[1]["id"])]
        copies = [as_map(c.execute_command("TAKE", filtered)) for _ in range(2)]
        assert [(d["payload"], d["topic"]) for d in copies] == [("old-eu", "orders/eu"), ("new-eu", "orders/eu")]
