"""The operator's fences: purge a queue, replay or discard dead letters, snapshot a queue.

Their callers are in the operator layer (broker/ops/): this module only
declares how they are called, beside every other fence's spec.
"""

from __future__ import annotations

from fencemq.fences.registry import fence

PURGE = fence("purge", "meta log checkouts owned ready delayed dedup dedup_ids journal dead totals backlogs priority rest",
              "idle_ttl_ms")
REPLAY_DEAD = fence("replay_dead", "meta log checkouts ready delayed dead dedup dedup_ids wake journal totals backlogs priority rest",
                    "count scan_limit idle_ttl_ms")
DISCARD_DEAD = fence("discard_dead", "meta dead totals backlogs rest", "position entry")
SNAPSHOT = fence("snapshot", "meta log checkouts deadlines owned ready delayed dead journal scheduled priority rest",
                 "max_log max_journal digest",
                 keys_rest="mailboxes")
