"""``fencemq evict|sweep|seek|purge``: the operator's writes, each through a fence.

What they do is broker/ops/maintenance.py; this module parses the options,
asks before a purge, and presents the result.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.text import Text

from fencemq.cli.common import CliError, fail
from fencemq.cli.inspect_cmd import _groups_table
from fencemq.cli.opskit import (
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    Cluster,
    Ctx,
    Json,
    Lmq,
    Owner,
    Prefix,
    Yes,
    RedisUrl,
    Topic,
    _deadline,
    _emit_json,
    _err,
    _name,
    _opt,
    _out,
    _confirm,
    _progress,
    _queue,
    _row,
    _table,
)
from fencemq.ops import inspection, maintenance
from fencemq.ops import operations as ops


def evict(
    topic: Topic,
    group: Annotated[str, typer.Argument(metavar="GROUP", show_default=False)],
    client: Annotated[str, typer.Argument(metavar="CLIENT", help="The member to evict.", show_default=False)],
    lmq: Lmq = None,
    owner: Owner = None,
    yes: Yes = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """Fence a client off a subscription: eviction marker, ownership dropped, checkouts back to the queue.

    Its PULLs return empty until it subscribes again; it is told with an
    `unsubscribe` notice (by=operator). Asks first unless --yes.
    """
    ctx = Ctx("evict", redis_url, prefix, cluster)
    ref = _queue(ctx, topic, lmq, owner)
    _name(ctx, group, "group")
    _name(ctx, client, "client")
    ctx.run(lambda r, k: r.ping())  # an unreachable Redis is said before any question
    _confirm(ctx, yes, f"Evict {client} from group {group} of {ops.display_name(ref)} (its checkouts go back)?",
             f"evict {client} from {ops.display_name(ref)}")
    res = ctx.run(lambda r, k: maintenance.evict(r, k, ref, group, client), writes=True)
    if as_json:
        _emit_json(res)
        return
    _out().print(Text.assemble("evicted ", (client, "bold"), " from group ", (group, "bold"), " of ",
                               (res["queue"], "bold"), f": {res['returned']} checkout(s) back to the queue; "
                               "unsubscribe notice queued (by=operator)"))


def sweep(
    queue: Annotated[str | None, typer.Option("--queue", metavar="QID", show_default=False,
                                                 help="Sweep this queue (its id, as `fencemq queues --json` "
                                                      "prints it: t:<topic>, l:<topic>:<lmq>, f:<owner>:<filter>).")] = None,
    all_due: Annotated[bool, typer.Option("--all-due", help="Sweep every queue whose lease deadline has passed.")] = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """Return expired leases now (what the workers' sweepers do every 100 ms), and show what came back.

    Members that lost a lease become suspected and get a `message_timeout` notice.
    """
    if (queue is None) == (not all_due):
        fail("sweep", CliError("give --queue QID or --all-due (one of them)", EXIT_USAGE))
        raise typer.Exit(EXIT_USAGE)
    ctx = Ctx("sweep", redis_url, prefix, cluster)
    if queue is not None and queue[:2] not in ("t:", "l:", "f:"):
        ctx.fail(f"{queue!r} is not a queue id (t:<topic>, l:<topic>:<lmq> or f:<owner>:<filter>)", EXIT_USAGE)
    with _progress("sweep: queues swept", enabled=all_due and not as_json) as progress:
        res = ctx.run(lambda r, k: maintenance.sweep(r, k, [queue] if queue else None, progress=progress),
                      writes=True)
    if as_json:
        _emit_json(res)
        return
    console = _out()
    if not res["queues"]:
        console.print(Text("No queue was due.", style="dim"))
        return
    t = _table("Swept")
    t.add_column("queue", overflow="fold", style="bold")
    t.add_column("returned", justify="right")
    t.add_column("timed out (now suspected)", overflow="fold")
    t.add_column("next due", justify="right")
    for q in res["queues"]:
        lost = ", ".join(f"{x['group']}/{x['member']} ({len(x['tags'])})"
                         + (f" → {x['replaced_by']} active" if x["replaced_by"] else "") for x in q["timeouts"])
        nxt = "–" if q["next_due_ms"] is None else _deadline((q["next_due_ms"] - res["now_ms"]) / 1000)
        _row(t, q["name"], str(q["returned"]), lost or "–", nxt)
    console.print(t)
    console.print(Text(f"{res['swept']} queue(s) swept, {res['returned']} lease(s) returned."))


def seek(
    topic: Topic,
    group: Annotated[str, typer.Argument(metavar="GROUP", show_default=False)],
    to_id: Annotated[int | None, typer.Option("--id", metavar="N", min=1, show_default=False,
                                                 help="Read from message id N.")] = None,
    to_time: Annotated[int | None, typer.Option("--time", metavar="MS", min=0, show_default=False,
                                                   help="Read from the first message published at or after MS "
                                                        "(epoch ms, Redis clock).")] = None,
    earliest: Annotated[bool, typer.Option("--earliest", help="Read from the oldest retained message.")] = False,
    latest: Annotated[bool, typer.Option("--latest", help="Read only messages published from now on.")] = False,
    lmq: Lmq = None,
    owner: Owner = None,
    yes: Yes = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """Move a subscription group's cursor (operator seek) and raise its epoch.

    Every checkout of the group is released (its tags go stale: ACK/RENEW
    settle nothing), its returned and delayed messages are dropped; the group
    then reads from the new cursor. Prints the new epoch and cursor, and
    whether the target was below retention (clamped). Asks first unless --yes.
    """
    chosen = [k for k, v in (("id", to_id), ("time", to_time), ("earliest", earliest or None),
                             ("latest", latest or None)) if v is not None]
    if len(chosen) != 1:
        fail("seek", CliError("give exactly one of --id N, --time MS, --earliest, --latest", EXIT_USAGE))
        raise typer.Exit(EXIT_USAGE)
    kind = chosen[0]
    arg = to_id if kind == "id" else to_time if kind == "time" else None
    ctx = Ctx("seek", redis_url, prefix, cluster)
    ref = _queue(ctx, topic, lmq, owner)
    _name(ctx, group, "group")
    ctx.run(lambda r, k: r.ping())  # an unreachable Redis is said before any question
    target = kind if arg is None else f"{kind} {arg}"
    _confirm(ctx, yes, f"Seek group {group} of {ops.display_name(ref)} to {target} (its checkouts go stale)?",
             f"seek group {group} of {ops.display_name(ref)}")
    res = ctx.run(lambda r, k: maintenance.seek(r, k, ref, group, kind, arg), writes=True)
    if as_json:
        _emit_json(res)
        return
    clamped = " (clamped to the oldest retained message)" if res["clamped"] else ""
    _out().print(Text.assemble("seek group ", (group, "bold"), " of ", (res["queue"], "bold"),
                               f" to {target}: epoch {res['before']['epoch']} → {res['epoch']}, cursor "
                               f"{_opt(res['before']['cursor'])} → {res['cursor']}{clamped}"))


def _interactive() -> bool:
    return sys.stdin.isatty()


def purge(
    topic: Topic,
    lmq: Lmq = None,
    owner: Owner = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """Drop every message not yet delivered, and every returned or delayed redelivery, of every group.

    Each group's cursor moves past the last message (seq + 1). Checkouts are
    left alone: messages held by consumers (leased or in a push mailbox) can
    still be ACKed, and a NACK or an expired lease still returns them. The log
    is left to retention (a SEEK back reads the messages again; dead letters
    stay replayable). Asks first unless --yes; without a terminal, --yes is
    required (exit 2).
    """
    ctx = Ctx("purge", redis_url, prefix, cluster)
    ref = _queue(ctx, topic, lmq, owner)
    if not yes:
        if not _interactive():
            ctx.fail(f"refusing to purge {ops.display_name(ref)} without --yes: no terminal to confirm on", EXIT_USAGE)
        q = ctx.run(lambda r, k: inspection.inspect_queue(r, k, ref, limit=0))
        err = _err()
        err.print(_groups_table(q["groups"]))
        drop = sum(g["backlog"] + (g["delayed"] or 0) for g in q["groups"])
        if not typer.confirm(f"Purge {q['name']}: drop {drop} message(s) from {len(q['groups'])} group(s)?",
                             default=False, err=True):
            ctx.fail("not purged", EXIT_NOT_FOUND)
    res = ctx.run(lambda r, k: maintenance.purge(r, k, ref), writes=True)
    if as_json:
        _emit_json(res)
        return
    console = _out()
    if res["groups"]:
        t = _table(f"Purged {res['queue']}")
        t.add_column("group", style="bold", overflow="fold")
        for col in ("cursor", "unread\ndropped", "returned\ndropped", "delayed\ndropped", "checkouts\nleft"):
            t.add_column(col, justify="right")
        for g in res["groups"]:
            _row(t, g["group"], f"{g['cursor_before']} → {g['cursor']}", str(g["unread"]), str(g["returned"]),
                      str(g["delayed"]), str(g["checkouts_left"]))
        console.print(t)
    console.print(Text(f"{res['dropped']} message(s) dropped from {len(res['groups'])} group(s); "
                       f"{res['checkouts_left']} checkout(s) left alone."))
    if not res["groups"]:
        console.print(Text("The queue has no subscription group: nothing was queued for anyone.", style="dim"))
