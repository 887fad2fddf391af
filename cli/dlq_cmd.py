"""``fencemq dlq list|replay``: a queue's dead letters, and putting them back in line.

Options, exit codes and output conventions as in cli/ops.py.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.text import Text

from fencemq.ops import maintenance
from fencemq.ops import operations as ops
from fencemq.cli.common import CliError, fail
from fencemq.cli.opskit import (
    EXIT_NOT_FOUND,
    Cluster,
    Ctx,
    Json,
    Lmq,
    Owner,
    Prefix,
    RedisUrl,
    Topic,
    Yes,
    _confirm,
    _emit_json,
    _opt,
    _out,
    _queue,
    _row,
    _table,
    _when,
)

dlq_app = typer.Typer(help="Dead letters: list them, or replay them into their group.", no_args_is_help=True)


@dlq_app.command("list")
def dlq_list(
    topic: Topic,
    lmq: Lmq = None,
    owner: Owner = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=100_000, help="Show at most this many.")] = 20,
    start: Annotated[int, typer.Option("--start", min=0, help="From this position (0 = the oldest).")] = 0,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """A queue's dead letters, oldest first: id, group, member, failures, when, payload preview."""
    ctx = Ctx("dlq", redis_url, prefix, cluster)
    ref = _queue(ctx, topic, lmq, owner)
    res = ctx.run(lambda r, k: maintenance.dead_letters(r, k, ref, limit=limit, start=start))
    if as_json:
        _emit_json(res)
        return
    console = _out()
    if not res["dead_letters"]:
        console.print(Text(f"No dead letters{' from here' if res['total'] else ''} ({res['total']} in all).",
                           style="dim"))
        return
    t = _table(f"Dead letters of {res['queue']} ({len(res['dead_letters'])} of {res['total']})",
               drop=("size", "deliveries", "#", "member"))
    for col, kw in (("#", {"justify": "right"}), ("id", {"justify": "right"}), ("group", {"overflow": "fold"}),
                    ("member", {"overflow": "fold"}), ("failures", {"justify": "right"}),
                    ("deliveries", {"justify": "right"}), ("dead since", {}), ("size", {"justify": "right"}),
                    ("payload", {"overflow": "fold"})):
        t.add_column(col, **kw)
    for d in res["dead_letters"]:
        if "group" not in d:
            _row(t, str(d["position"]), "?", "?", "?", "?", "?", "?", "?", Text(d["error"], style="red"))
            continue
        _row(t, str(d["position"]), str(d["id"]), d["group"], d["member"], str(d["failures"]),
                  str(d["acquisitions"]), _when(d["dead_ms"]), _opt(d.get("size")),
                  Text(d.get("preview", d.get("error", "")), style="red" if "error" in d else ""))
    console.print(t)


@dlq_app.command("replay")
def dlq_replay(
    topic: Topic,
    lmq: Lmq = None,
    owner: Owner = None,
    count: Annotated[int, typer.Option("--count", min=1, max=1_000_000,
                                       help="Replay at most this many, oldest first.")] = 1,
    yes: Yes = False,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """Put dead letters back into their group's ready set (one atomic fence), failures reset to 0.

    A dead letter carries its message: one the log has let go (every group had
    settled it, or retention trimmed it) is put back. One whose group is gone
    stays where it is and is reported. Exit 1 when there was
    nothing to replay. Asks first unless --yes.
    """
    ctx = Ctx("dlq", redis_url, prefix, cluster)
    ref = _queue(ctx, topic, lmq, owner)
    waiting = ctx.run(lambda r, k: maintenance.dead_letters(r, k, ref, limit=1))["total"]
    if waiting:  # with none, nothing to ask: it says so and exits 1
        _confirm(ctx, yes, f"Replay {min(count, waiting)} of the {waiting} dead letter(s) of "
                 f"{ops.display_name(ref)} into their groups?", f"replay dead letters of {ops.display_name(ref)}")
    res = ctx.run(lambda r, k: maintenance.replay_dead(r, k, ref, count=count), writes=True)
    if as_json:
        _emit_json(res)
    else:
        console = _out()
        if res["replayed"]:
            t = _table(f"Replayed into {res['queue']}")
            for col in ("id", "group", "member", "deliveries"):
                t.add_column(col, justify="right" if col in ("id", "deliveries") else "left")
            t.add_column("how")
            for r in res["replayed"]:
                how = "ready set" if r["via"] == "ready" else "group's cursor reads it again"
                _row(t, str(r["id"]), r["group"], r["member"], str(r["acquisitions"]), how)
            console.print(t)
        if res["skipped"]:
            t = _table("Kept as dead letters")
            for col in ("#", "id", "group", "why"):
                t.add_column(col)
            why = {"trimmed": "its message is gone and the dead letter holds no copy", "no-group": "the group is gone",
                   "undecodable": "not a dead letter this version can read"}
            for s in res["skipped"]:
                _row(t, str(s["position"]), _opt(s["id"]), _opt(s["group"]), why.get(s["reason"], s["reason"]))
            console.print(t)
        console.print(Text(f"{len(res['replayed'])} replayed, {len(res['skipped'])} kept, "
                           f"{res['dead_letters_left']} dead letter(s) left."))
    if not res["replayed"]:
        if not as_json:
            fail("dlq", CliError("nothing replayed" + (" (no dead letters)" if not res["examined"] else ""),
                                 EXIT_NOT_FOUND))
        raise typer.Exit(EXIT_NOT_FOUND)
