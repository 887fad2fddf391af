"""``fencemq scheduled list|cancel``: messages published for later (PUB … DELAY | AT).

A scheduled message waits outside its queue's log until it is due, then is published
(broker/fences/schedule.py; docs/protocol.md, "Scheduled messages"). Operators list what
waits and cancel by schedule id, through the fence a publisher's UNPUB runs. Options, exit
codes and output conventions as in cli/ops.py.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated

import typer
from rich.text import Text

from fencemq.cli.opskit import EXIT_NOT_FOUND, EXIT_USAGE, Cluster, Ctx, Json, Lmq, Prefix, RedisUrl, Topic, \
    _emit_json, _out, _queue, _row, _table
from fencemq.errors import FenceMQError
from fencemq.ops.scheduled import cancel_scheduled, list_scheduled

scheduled_app = typer.Typer(help="Messages published for later (PUB … DELAY | AT): list them, cancel them.",
                            no_args_is_help=True)


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


@scheduled_app.command("list")
def scheduled_list(
    topic: Topic,
    lmq: Lmq = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=10_000, help="List at most this many, soonest first.")]
    = 100,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """How many messages of TOPIC (or one lmq) wait for their time, and the soonest of them."""
    ctx = Ctx("scheduled list", redis_url, prefix, cluster)
    ref = _queue(ctx, topic, lmq)
    res = ctx.run(lambda r, k: list_scheduled(r, k, ref, limit))
    if as_json:
        _emit_json(res)
        return
    if not res["scheduled"]:
        _out().print(Text(f"{res['queue']} has no scheduled message.", style="dim"))
        return
    t = _table(f"Scheduled in {res['queue']} ({res['scheduled']:,})")
    for col, kw in (("id", {"style": "bold"}), ("due (UTC)", {}), ("published (UTC)", {}),
                    ("bytes", {"justify": "right"})):
        t.add_column(col, **kw)
    for m in res["messages"]:
        _row(t, m["id"], _when(m["due_ms"]), _when(m["published_ms"]), f"{m['size']:,}")
    _out().print(t)


@scheduled_app.command("cancel")
def scheduled_cancel(
    topic: Topic,
    ids: Annotated[list[str], typer.Argument(metavar="ID...", help="Schedule ids, as the publish answered them.",
                                             show_default=False)],
    lmq: Lmq = None,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """Cancel scheduled messages of TOPIC by schedule id (exit 1 when none still waited)."""
    ctx = Ctx("scheduled cancel", redis_url, prefix, cluster)
    ref = _queue(ctx, topic, lmq)
    try:
        res = ctx.run(lambda r, k: cancel_scheduled(r, k, ref, ids), writes=True)
    except FenceMQError as exc:
        ctx.fail(exc.message, EXIT_USAGE)
    if as_json:
        _emit_json(res)
    else:
        _out().print(Text(f"{res['cancelled']} of {res['asked']} scheduled message(s) of {res['queue']} cancelled"))
    if not res["cancelled"]:
        raise typer.Exit(EXIT_NOT_FOUND)
