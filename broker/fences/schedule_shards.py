"""Where a queue's lease schedule entry lives: beside the queue, so a shard failing over stalls only its own.

The lease schedule (which queues a sweeper visits, and the lease intents
beside it: lua/lease_intent.lua, docs/data-model.md "Leases") cannot live in
the queue's slot — sweepers must find every due queue in a few reads — but
it need not live in one slot either. It is split into ``SHARDS`` sorted sets,
each with a hash tag of its own (``fmq:{schedule}``, ``fmq:{schedule:1}`` …
``fmq:{schedule:15}``). On one server every queue uses the first (the one it
always used). On a Cluster a queue's entry goes to a shard whose slot is on
the master that holds the queue, so a PULL needs no master but its queue's:
when a master fails over, only its own queues wait. Sweepers read every shard;
an entry written before a topology change stays where it was and is swept and
unlisted there (the sweep is told which shard it came from).
"""

from __future__ import annotations

import time
import zlib
from typing import Any

from redis.asyncio import RedisCluster

from fencemq.model.keys import Keyspace

SHARDS = 16
REMAP_S = 1.0  # how often the shards' owners are looked up again (a failover moves them)


class ScheduleShards:
    def __init__(self, redis: Any, keys: Keyspace) -> None:
        self.redis, self.keys = redis, keys
        self.cluster = isinstance(redis, RedisCluster)
        self._by_node: dict[str, list[int]] = {}
        self._mapped_at = -REMAP_S

    def all(self) -> list[int]:
        """The shards a sweeper reads: one on a single server, every one on a Cluster."""
        return list(range(SHARDS)) if self.cluster else [0]

    def keys_of(self, shard: int) -> tuple[str, str]:
        """(schedule, intents) of one shard."""
        return self.keys.schedule_shard(shard)

    def shard_of(self, qid: str) -> int:
        """The shard a queue's entry is written to now."""
        if not self.cluster:
            return 0
        choices = self._choices(qid)
        return choices[zlib.crc32(qid.encode()) % len(choices)]

    def first_shard_of(self, qid: str) -> int:
        """The first shard on the master that holds the queue now: one per master, for what is
        kept once per master (the filter registry's version copies, fences/shared.py)."""
        return self._choices(qid)[0] if self.cluster else 0

    def _choices(self, qid: str) -> list[int]:
        """The shards on the master that holds the queue (every shard when it holds none)."""
        now = time.monotonic()
        if now - self._mapped_at > REMAP_S:
            by_node: dict[str, list[int]] = {}
            for shard in range(SHARDS):
                by_node.setdefault(self.redis.get_node_from_key(self.keys_of(shard)[0]).name, []).append(shard)
            self._by_node, self._mapped_at = by_node, now
        node = self.redis.get_node_from_key(self.keys.queue_by_id(qid).meta).name
        return self._by_node.get(node) or list(range(SHARDS))
