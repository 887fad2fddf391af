"""``fencemq retention list|set|clear``: what a topic keeps once its groups have read it.

Without a policy a message every group has settled leaves Redis; a topic's
policy keeps its messages, read or not, until a count, an age or a size in
bytes trims them from the oldest (broker/fences/retention.py; docs/operations.md,
"Retention"). Workers read a change within a second. Options, exit codes and
output conventions as in cli/ops.py.
"""

from __future__ import annotations

import re
from typing import Annotated

import typer
from rich.text import Text

from fencemq.cli.opskit import EXIT_NOT_FOUND, EXIT_USAGE, Cluster, Ctx, Json, Prefix, RedisUrl, Topic, Yes, _confirm, \
    _emit_json, _out, _queue, _row, _table
from fencemq.errors import BadArgument
from fencemq.fences.retention import Policy, clear_policy, read_policies, set_policy

retention_app = typer.Typer(help="What a topic keeps after its groups read it (by default: nothing).",
                            no_args_is_help=True)

_DURATION = re.compile(r"^(\d+)(ms|s|m|h|d)?$")
_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_SIZE = re.compile(r"^(\d+)(B|KB|MB|GB|KiB|MiB|GiB)?$")
_BYTES = {"B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_duration_ms(text: str) -> int:
    """``500ms``, ``90s``, ``15m``, ``2h``, ``7d`` (a bare number is milliseconds)."""
    m = _DURATION.match(text.strip())
    if not m:
        raise BadArgument(f"--age {text!r}: a number with ms, s, m, h or d (e.g. 7d)")
    return int(m.group(1)) * _MS[m.group(2) or "ms"]


def parse_bytes(text: str) -> int:
    """``512KiB``, ``100MB``, ``2GiB`` (a bare number is bytes)."""
    m = _SIZE.match(text.strip())
    if not m:
        raise BadArgument(f"--bytes {text!r}: a number with B, KB, MB, GB, KiB, MiB or GiB (e.g. 100MiB)")
    return int(m.group(1)) * _BYTES[m.group(2) or "B"]


def describe(policy: Policy) -> str:
    parts = []
    if policy.count:
        parts.append(f"{policy.count:,} messages")
    if policy.age_ms:
        parts.append(_age(policy.age_ms))
    if policy.bytes:
        parts.append(f"{policy.bytes / (1 << 20):,.1f} MiB per queue")
    return ", ".join(parts)


def _age(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms >= size and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


@retention_app.command("list")
def retention_list(redis_url: RedisUrl = None, prefix: Prefix = None, cluster: Cluster = False,
                   as_json: Json = False) -> None:
    """Every topic with a retention policy (the others keep only what some group has yet to settle)."""
    ctx = Ctx("retention list", redis_url, prefix, cluster)
    policies = ctx.run(lambda r, k: read_policies(r, k))
    if as_json:
        _emit_json({topic: p.as_dict() for topic, p in sorted(policies.items())})
        return
    if not policies:
        _out().print(Text("No topic has a retention policy: every topic keeps only what some group has yet to "
                          "settle.", style="dim"))
        return
    t = _table(f"Retention policies ({len(policies)})")
    for col, kw in (("topic", {"overflow": "fold"}), ("count", {"justify": "right"}), ("age", {"justify": "right"}),
                    ("bytes per queue", {"justify": "right"})):
        t.add_column(col, **kw)
    for topic, p in sorted(policies.items()):
        _row(t, topic, f"{p.count:,}" if p.count else None, _age(p.age_ms) if p.age_ms else None,
             f"{p.bytes:,}" if p.bytes else None)
    _out().print(t)


@retention_app.command("set")
def retention_set(
    topic: Topic,
    count: Annotated[int | None, typer.Option("--count", min=0, show_default=False,
                                              help="Keep at most this many messages per queue.")] = None,
    age: Annotated[str | None, typer.Option("--age", metavar="DURATION", show_default=False,
                                            help="Keep messages this long: 500ms, 90s, 15m, 2h, 7d.")] = None,
    size: Annotated[str | None, typer.Option("--bytes", metavar="SIZE", show_default=False,
                                             help="Keep at most this much log per queue (Redis's estimate): "
                                                  "512KiB, 100MB, 2GiB.")] = None,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """Keep TOPIC's messages, read or not, until the oldest pass a count, an age or a size (any of them).

    A lite topic's policy holds for each of its lmqs. Replaces the topic's policy.
    """
    ctx = Ctx("retention", redis_url, prefix, cluster)
    _queue(ctx, topic, None)  # a topic's name, checked (and the permission's topic)
    try:
        policy = Policy(count or 0, parse_duration_ms(age) if age else 0, parse_bytes(size) if size else 0)
    except BadArgument as exc:
        ctx.fail(exc.message, EXIT_USAGE)
    ctx.run(lambda r, k: set_policy(r, k, topic, policy), writes=True)
    if as_json:
        _emit_json({"topic": topic, **policy.as_dict()})
        return
    _out().print(Text.assemble((topic, "bold"), f" keeps {describe(policy)} (workers apply it within a second)"))


@retention_app.command("clear")
def retention_clear(topic: Topic, yes: Yes = False, redis_url: RedisUrl = None, prefix: Prefix = None,
                    cluster: Cluster = False) -> None:
    """Drop TOPIC's policy: what every group has settled is deleted from then on. Asks first unless --yes."""
    ctx = Ctx("retention", redis_url, prefix, cluster)
    _queue(ctx, topic, None)
    _confirm(ctx, yes, f"Clear the retention policy of {topic} (what its groups settled will be deleted)?",
             f"clear the retention policy of {topic}")
    if not ctx.run(lambda r, k: clear_policy(r, k, topic), writes=True):
        ctx.fail(f"{topic} has no retention policy", EXIT_NOT_FOUND)
    _out().print(Text.assemble((topic, "bold"), " keeps only what some group has yet to settle"))
