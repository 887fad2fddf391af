"""The compact form of a queue's meta hash, read from Python.

An lmq at rest (one group, whose only member is its owner) keeps only the
meta fields that differ from their defaults; ``z`` = ``<group>|<owner>``
stands for the group, its member list and its owner, and the few fields left
take one-letter names, times in seconds (lua/_compact_meta.lua, ``compact_meta``;
docs/data-model.md, "Lmqs at rest"). The fences read through it; code that
reads meta hashes directly (the operator views) calls :func:`expand` to see
every field spelled out. The names and defaults here must match
``compact_names`` / ``compact_defaults`` / ``SHORT_NAMES`` in lua/_compact_meta.lua:
tests/test_lmq_at_rest.py holds the two to each other.
"""

from __future__ import annotations

from fencemq.model.values import text

COMPACT_MARK = "z"
TIMES = ("C", "W")  # kept in seconds


AT_REST = {"seq": "S", "tag": "T"}  # queue-level counters: their names in a compact hash


def _short_names(group: str, owner: str) -> dict[str, str]:
    return {AT_REST["seq"]: "seq", AT_REST["tag"]: "tag", "N": f"m|{group}|{owner}|n", "C": "ct", "W": "wt"}


def _defaults(group: str, owner: str, seq: int) -> dict[str, str]:
    g, m = f"g|{group}|", f"m|{group}|{owner}|"
    return {
        "first": str(seq + 1), "seq": "0", g + "mode": "exclusive", g + "pol": "preempt", g + "ep": "0",
        g + "onpre": "keep", "groups": group, g + "mem": owner, m + "n": "0", m + "qos": "1", m + "on": "1",
        "jcap": "0", g + "cur": str(seq + 1),
    }


def expand(raw: dict[bytes, bytes] | dict[str, str]) -> dict[str, str]:
    """Every field of a meta hash as text, a compact one spelled out."""
    fields = {text(k): text(v) for k, v in raw.items()}
    mark = fields.pop(COMPACT_MARK, None)
    if mark is None:
        return fields
    group, owner = mark.split("|", 1)
    fields[f"g|{group}|own"] = owner
    for short, name in _short_names(group, owner).items():
        if short in fields:
            value = fields.pop(short)
            fields[name] = str(int(value) * 1000) if short in TIMES else value
    for name, value in _defaults(group, owner, int(fields.get("seq", "0"))).items():
        fields.setdefault(name, value)
    return fields
