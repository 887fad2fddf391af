"""``fencemq queues`` and ``fencemq lmqs``: queue listings, a page at a time (SCAN).

What they read is broker/ops/operations.py (``list_queues``); this module parses
the options and presents the page.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.text import Text

from fencemq.cli.common import CliError, fail
from fencemq.cli.opskit import (
    EXIT_USAGE,
    Cluster,
    Ctx,
    Json,
    Prefix,
    RedisUrl,
    _count,
    _emit_json,
    _opt,
    _out,
    _progress,
    _row,
    _secs,
    _table,
)
from fencemq.errors import BadArgument
from fencemq.model.keys import check_topic
from fencemq.ops import operations as ops


def _list(command: str, redis_url: str | None, prefix: str | None, cluster: bool, as_json: bool,
          flt_args: dict[str, Any], limit: int, cursor: str | None) -> None:
    ctx = Ctx(command, redis_url, prefix, cluster)
    try:
        flt = ops.QueueFilter(**flt_args)
        if flt.topic is not None:
            check_topic(flt.topic)
            ctx.topic = flt.topic
    except BadArgument as exc:
        ctx.fail(exc.message, EXIT_USAGE)
    with _progress(f"{command}: queues found", enabled=not as_json) as progress:
        page = ctx.run(lambda r, k: ops.list_queues(r, k, flt, limit=limit, cursor=cursor, progress=progress))
    if as_json:
        _emit_json({"queues": page.rows, "count": len(page.rows), "cursor": page.cursor, "scanned": page.scanned,
                    "nodes": page.nodes, "pattern": page.pattern})
        return
    console = _out()
    if page.rows:
        lite = command == "lmqs"
        t = _table("Lite queues" if lite else "Queues",
                   drop=("ready", "delayed", "groups", "last\nid", "idle", "kind", "members", "suspects"))
        if lite:
            t.add_column("topic", overflow="fold")
            t.add_column("lmq", overflow="fold", style="bold")
        else:
            t.add_column("queue", overflow="fold", style="bold")
            t.add_column("kind")
        for col in ("last\nid", "backlog", "checked\nout", "ready", "delayed", "dead", "groups", "members"):
            t.add_column(col, justify="right")
        t.add_column("owner", overflow="fold")
        t.add_column("suspects", justify="right")
        t.add_column("idle", justify="right")
        for r in page.rows:
            lead = [r["topic"], r["lmq"]] if lite else [r["name"], r["kind"]]
            _row(t, *lead, str(r["seq"]), _opt(r["backlog"]), str(r["checkouts"]), str(r["ready"]),
                      str(r["delayed"]), Text(str(r["dead_letters"]), style="red" if r["dead_letters"] else ""),
                      str(r["groups"]), str(r["members"]), ", ".join(r["owners"]) or "–",
                      Text(str(r["suspected"]), style="yellow" if r["suspected"] else ""), _secs(r["idle_s"]))
        console.print(t)
    else:
        console.print(Text("No queues match." if page.cursor is None else "No queues on this page.", style="dim"))
    where = f"{page.nodes} masters" if page.nodes > 1 else "1 server"
    console.print(Text(f"{len(page.rows)} shown, {_count(page.scanned, 'key')} scanned on {where}.", style="dim"))
    if page.cursor is not None:
        console.print(Text(f"More: --cursor {page.cursor}"))
    else:
        console.print(Text("End of listing.", style="dim"))


Limit = Annotated[int, typer.Option("--limit", min=1, max=100_000, help="At most this many queues on this page.")]
Cursor = Annotated[str | None, typer.Option(
    "--cursor", show_default=False, help="Continue a listing from the cursor it printed (a SCAN cursor; "
                                         "<host:port>/<n> on a Cluster).")]
Kind = Annotated[str | None, typer.Option("--kind", metavar="plain|lite|filter", show_default=False,
                                             help="Only queues of this kind.")]


def queues(
    topic: Annotated[str | None, typer.Option("--topic", show_default=False,
                                                 help="Only this topic's queues (its lmqs, for a lite topic).")] = None,
    match: Annotated[str | None, typer.Option("--match", metavar="GLOB", show_default=False,
                                                 help="Only queues whose topic (or filter) matches this glob.")] = None,
    kind: Kind = None,
    limit: Limit = 100,
    cursor: Cursor = None,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """List queues (plain topics, lmqs, filter subscriptions), a page at a time (SCAN).

    Per queue: last id, backlog (the laggiest group's unread + returned),
    checkouts, ready and delayed redeliveries, dead letters, groups,
    members, owners, suspects, idle time. A page ends after --limit queues
    and prints the --cursor of the next one.
    """
    if kind is not None and kind not in ops.KINDS:
        fail("queues", CliError(f"--kind must be one of {', '.join(ops.KINDS)}", EXIT_USAGE))
        raise typer.Exit(EXIT_USAGE)
    _list("queues", redis_url, prefix, cluster, as_json, {"kind": kind, "topic": topic, "match": match},
          limit, cursor)


def lmqs(
    topic: Annotated[str | None, typer.Option("--topic", show_default=False,
                                                 help="Only this lite topic's lmqs.")] = None,
    match: Annotated[str | None, typer.Option("--match", metavar="GLOB", show_default=False,
                                                 help="Only lmqs whose name matches this glob.")] = None,
    limit: Limit = 100,
    cursor: Cursor = None,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """List lite queues (lmqs), a page at a time (SCAN; --topic narrows the SCAN itself)."""
    _list("lmqs", redis_url, prefix, cluster, as_json, {"kind": "lite", "topic": topic, "match": match,
                                                        "match_lmq": True}, limit, cursor)
