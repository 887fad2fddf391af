"""Put an lmq to rest, or wake it, by hand: what lua/lib/meta.lua's ``put_to_rest`` and
``wake_from_rest`` do, for tests that hold a reader to the same answer wherever the meta lies.

``rest_by_hand`` moves the meta hash into its field of the slot's rest hash only when the fence would
(a compact hash, no TTL, nothing else of the lmq holds anything), packing it as the fence does
(a number as a msgpack integer); ``wake_by_hand`` puts it back as a key. Both take a blocking
redis-py client (``tests.helpers.direct``) and the queue's keys, and say whether they moved it.
"""

from __future__ import annotations

import re
from typing import Any

import msgpack

from fencemq.model import meta
from fencemq.model.keys import Keyspace, QueueKeys

# lua/lib/meta.lua REST_EMPTY: what must hold nothing for an lmq to rest
_EMPTY = ("log", "checkouts", "deadlines", "owned", "held", "ready", "delayed", "dead", "journal", "scheduled",
          "waiters", "priority")
# lua/lib/meta.lua put_to_rest: a canonical decimal of up to 16 digits, at most 2^53 - 1, packs as an integer
_NUMBER = re.compile(rb"(?:[1-9]\d{0,15}|0)\Z")
_MAX_INT = 2**53 - 1


def restable(r: Any, k: QueueKeys) -> bool:
    """Whether the fence would put this lmq to rest now."""
    return (k.rest != k.meta and r.hexists(k.meta, meta.COMPACT_MARK) and r.pttl(k.meta) == -1
            and not any(r.exists(getattr(k, name)) for name in _EMPTY))


def rest_by_hand(r: Any, k: QueueKeys) -> bool:
    """Move a restable lmq's meta into its slot's rest hash; False (nothing done) otherwise."""
    if not restable(r, k):
        return False
    flat: list[Any] = []
    for field, value in r.hgetall(k.meta).items():
        flat += [field, int(value) if _NUMBER.match(value) and int(value) <= _MAX_INT else value]
    # strings as msgpack str, as Lua's cmsgpack packs them: it cannot read bin, msgpack-python's default for bytes
    r.hset(k.rest, k.rest_field, msgpack.packb(flat, use_bin_type=False))
    r.delete(k.meta)
    return True


def wake_by_hand(r: Any, k: QueueKeys) -> bool:
    """Put an lmq at rest back as a meta key; False when it is not at rest."""
    packed = r.hget(k.rest, k.rest_field)
    if packed is None:
        return False
    r.hset(k.meta, mapping=meta.from_rest(packed))
    r.hdel(k.rest, k.rest_field)
    return True


def rest_all(r: Any, keys: Keyspace, qids: list[str]) -> list[str]:
    """Rest every lmq of ``qids`` that may rest: those rested."""
    return [qid for qid in qids if rest_by_hand(r, keys.queue_by_id(qid))]


def wake_all(r: Any, keys: Keyspace, qids: list[str]) -> list[str]:
    """Wake every lmq of ``qids`` at rest: those woken."""
    return [qid for qid in qids if wake_by_hand(r, keys.queue_by_id(qid))]
