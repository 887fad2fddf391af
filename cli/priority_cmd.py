"""``fencemq priority set|show``: a topic's queue that honours PUB … PRIORITY (levels 0–9).

A plain topic's queue honours priority once set, and is switched only while its log is empty
(broker/ops/priority.py, lua/prioritize.lua; docs/protocol.md, "Priority"). ``show`` gives the
messages held per level and each group's unread per level. Options, exit codes and output
conventions as in cli/ops.py.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.text import Text

from fencemq.cli.opskit import EXIT_USAGE, Cluster, Ctx, Json, Prefix, RedisUrl, Topic, _emit_json, _out, _queue, \
    _row, _table
from fencemq.errors import FenceMQError
from fencemq.ops.priority import priority_counts, set_priority

priority_app = typer.Typer(help="Priority queues (PUB … PRIORITY 0-9): switch a topic's queue, see its levels.",
                           no_args_is_help=True)


@priority_app.command("set")
def priority_set(
    topic: Topic,
    state: Annotated[str, typer.Argument(metavar="on|off", help="on: honour PUB … PRIORITY; off: refuse it.")],
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """Make TOPIC's queue honour PUB … PRIORITY (on) or not (off); only while its log is empty."""
    ctx = Ctx("priority set", redis_url, prefix, cluster)
    if state not in ("on", "off"):
        ctx.fail("give on or off", EXIT_USAGE)
    ref = _queue(ctx, topic, None)
    try:
        res = ctx.run(lambda r, k: set_priority(r, k, ref, state == "on"), writes=True)
    except FenceMQError as exc:
        ctx.fail(exc.message, EXIT_USAGE)
    if as_json:
        _emit_json(res)
        return
    verb = "now honours" if state == "on" else "no longer honours"
    same = "" if res["changed"] else " (it was so already)"
    _out().print(Text.assemble((topic, "bold"), f" {verb} PUB … PRIORITY{same}"))


@priority_app.command("show")
def priority_show(topic: Topic, redis_url: RedisUrl = None, prefix: Prefix = None, cluster: Cluster = False,
                  as_json: Json = False) -> None:
    """TOPIC's messages per priority level, and each group's unread per level."""
    ctx = Ctx("priority show", redis_url, prefix, cluster)
    ref = _queue(ctx, topic, None)
    res = ctx.run(lambda r, k: priority_counts(r, k, ref))
    if as_json:
        _emit_json(res)
        return
    if not res["priority"]:
        _out().print(Text(f"{topic} does not honour priority (fencemq priority set {topic} on)", style="dim"))
        return
    groups = sorted(res["unread"])
    t = _table(f"Priority levels of {topic}")
    t.add_column("level", justify="right")
    t.add_column("held", justify="right")
    for g in groups:
        t.add_column(f"unread\n{g}", justify="right")
    for level in range(9, -1, -1):
        if level in res["levels"] or any(level in res["unread"][g] for g in groups):
            _row(t, str(level), f"{res['levels'].get(level, 0):,}",
                 *(f"{res['unread'][g].get(level, 0):,}" for g in groups))
    _out().print(t)
