"""Redis Cluster slots: which slot a key is in, and a short hash tag that names each slot.

Pure arithmetic (CRC16, as Redis computes it); the key names themselves are built in keys.py.
"""

from __future__ import annotations

import binascii
from functools import cache

SLOTS = 16384
_TAG_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
_slot_tags: dict[int, str] = {}


def key_slot(key: str) -> int:
    """The Cluster slot of a key (its hash tag's, when it has one), as Redis computes it."""
    data = key.encode()
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return binascii.crc_hqx(data, 0) % SLOTS


def slot_tag(slot: int) -> str:
    """A four-character hash tag of that slot: names a key of the slot's own, as the totals of a
    Cluster's slot (lua/lib/totals.lua). CRC16 is linear (no initial value): the tag ``h + t`` hashes to
    crc(h + NUL NUL) XOR crc(t), so a tail ``t`` is looked up for each head ``h`` in turn (a dozen
    lookups per slot, the first match in a fixed order: every process finds the same tag)."""
    tag = _slot_tags.get(slot)
    if tag is None:
        heads, tails = _tag_halves()
        for head, value in heads:
            tail = tails.get(slot ^ value)
            if tail is not None:
                tag = _slot_tags[slot] = head + tail
                break
        else:  # pragma: no cover - 1,296 heads cover every slot
            raise AssertionError(f"no hash tag found for slot {slot}")
    return tag


@cache
def _tag_halves() -> tuple[list[tuple[str, int]], dict[int, str]]:
    pairs = [a + b for a in _TAG_ALPHABET for b in _TAG_ALPHABET]
    heads = [(h, binascii.crc_hqx(h.encode() + b"\0\0", 0) % SLOTS) for h in pairs]
    tails: dict[int, str] = {}
    for t in pairs:
        tails.setdefault(binascii.crc_hqx(t.encode(), 0) % SLOTS, t)
    return heads, tails
