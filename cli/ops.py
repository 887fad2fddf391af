"""Operator commands: queues, lmqs, inspect, evict, sweep, seek, purge, dlq, top, bench.

``register(app)`` adds them to a Typer app (cli/main.py calls it); inspect, dlq
and top are in cli/inspect_cmd.py, cli/dlq_cmd.py and cli/top_cmd.py. What they
read and write is in ``broker/operations.py``, ``broker/inspection.py`` and ``broker/maintenance.py``; this module only parses
options and presents results: rich tables by default, ``--json`` for
scripts (one JSON document on stdout; ``top --json`` prints one per refresh,
one per line).

Every command that talks to Redis takes ``--redis-url`` (default
$FENCEMQ_REDIS_URL), ``--prefix`` (default $FENCEMQ_PREFIX or fmq) and
``--cluster`` (force Redis Cluster mode; otherwise detected from
``INFO cluster``: every master is visited).

Exit codes: 0 success; 1 not found (no such queue, group, member, session or
dead letter to replay) or refused (a purge not confirmed, a Redis error
reply); 2 usage (bad option, bad name, bad cursor; purge without --yes when
not interactive), no Redis URL, or the Redis at it does not answer (one line
on stderr naming the URL and what to check).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from fencemq.ops import inspection
from fencemq.ops import maintenance
from fencemq.ops import operations as ops
from fencemq.errors import BadArgument
from fencemq.model.keys import check_topic
from fencemq.cli.common import CliError, fail
from fencemq.cli.dlq_cmd import dlq_app
from fencemq.cli.inspect_cmd import _groups_table, inspect_app
from fencemq.cli.opskit import (
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    ROOT,
    Cluster,
    Ctx,
    Json,
    Lmq,
    Owner,
    Prefix,
    RedisUrl,
    Topic,
    _deadline,
    _emit_json,
    _err,
    _name,
    _opt,
    _out,
    _progress,
    _queue,
    _row,
    _secs,
    _table,
)
from fencemq.cli.top_cmd import top

# -- queues / lmqs -----------------------------------------------------------------------------


def _list(command: str, redis_url: str | None, prefix: str | None, cluster: bool, as_json: bool,
          flt_args: dict[str, Any], limit: int, cursor: str | None) -> None:
    ctx = Ctx(command, redis_url, prefix, cluster)
    try:
        flt = ops.QueueFilter(**flt_args)
        if flt.topic is not None:
            check_topic(flt.topic)
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
        t = _table("Lite queues" if lite else "Queues")
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
    console.print(Text(f"{len(page.rows)} shown, {page.scanned} keys scanned on {where}.", style="dim"))
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


# -- evict / sweep / seek -----------------------------------------------------------------------


def evict(
    topic: Topic,
    group: Annotated[str, typer.Argument(metavar="GROUP", show_default=False)],
    client: Annotated[str, typer.Argument(metavar="CLIENT", help="The member to evict.", show_default=False)],
    lmq: Lmq = None,
    owner: Owner = None,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """Fence a client off a subscription: eviction marker, ownership dropped, checkouts back to the queue.

    Its PULLs return empty until it subscribes again; it is told with an
    `unsubscribe` notice (by=operator).
    """
    ctx = Ctx("evict", redis_url, prefix, cluster)
    ref = _queue(ctx, topic, lmq, owner)
    _name(ctx, group, "group")
    _name(ctx, client, "client")
    res = ctx.run(lambda r, k: maintenance.evict(r, k, ref, group, client))
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
        res = ctx.run(lambda r, k: maintenance.sweep(r, k, [queue] if queue else None, progress=progress))
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
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """Move a subscription group's cursor (operator seek) and raise its epoch.

    Every checkout of the group is released (its tags go stale: ACK/RENEW
    settle nothing), its returned and delayed messages are dropped; the group
    then reads from the new cursor. Prints the new epoch and cursor, and
    whether the target was below retention (clamped).
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
    res = ctx.run(lambda r, k: maintenance.seek(r, k, ref, group, kind, arg))
    if as_json:
        _emit_json(res)
        return
    target = kind if arg is None else f"{kind} {arg}"
    clamped = " (clamped to the oldest retained message)" if res["clamped"] else ""
    _out().print(Text.assemble("seek group ", (group, "bold"), " of ", (res["queue"], "bold"),
                               f" to {target}: epoch {res['before']['epoch']} → {res['epoch']}, cursor "
                               f"{_opt(res['before']['cursor'])} → {res['cursor']}{clamped}"))


def _interactive() -> bool:
    return sys.stdin.isatty()


# -- purge -----------------------------------------------------------------------------------


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
    res = ctx.run(lambda r, k: maintenance.purge(r, k, ref))
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


# -- bench --------------------------------------------------------------------------------------


def _bench_out(args: list[str]) -> Path:
    out = ROOT / "bench" / "results"
    for i, a in enumerate(args):
        if a == "--out" and i + 1 < len(args):
            out = Path(args[i + 1])
        elif a.startswith("--out="):
            out = Path(a.split("=", 1)[1])
    return out.resolve()


def _relay(argv: list[str], **kw: Any) -> int:
    """Run a command, copying its stdout and stderr to ours line by line (so they can be captured)."""
    import threading

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, **kw)

    def copy(src: Any, dst: Any) -> None:
        for line in src:
            dst.write(line)
            dst.flush()

    err = threading.Thread(target=copy, args=(proc.stderr, sys.stderr), daemon=True)
    err.start()
    try:
        copy(proc.stdout, sys.stdout)
        return proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
        err.join(5)
        proc.stdout.close()
        proc.stderr.close()


def bench(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Finish with a JSON summary {returncode, out, written}.")] = False,
) -> None:
    """Run the end-to-end benchmark (`python -m bench.run`), passing every other argument through.

    E.g. `fencemq bench --messages 20000 --repeat 1`; `fencemq bench -- --help`
    lists bench.run's options. Needs a source checkout (bench/ is not installed).
    """
    if not (ROOT / "bench" / "run.py").is_file():
        fail("bench", CliError(f"no benchmark at {ROOT / 'bench'}: `fencemq bench` runs from a source checkout"))
        raise typer.Exit(1)
    args = list(ctx.args)
    out = _bench_out(args)
    started = time.time()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        # In the caller's directory (a relative --out is where they expect it); bench/ found via PYTHONPATH.
        returncode = _relay([sys.executable, "-m", "bench.run", *args], env=env)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    written = sorted(str(p) for p in out.glob("*") if p.is_file() and p.stat().st_mtime >= started - 1) \
        if out.is_dir() else []
    if as_json:
        typer.echo(json.dumps({"returncode": returncode, "out": str(out), "written": written}))
    elif written:
        typer.echo(f"results written to {out}: {', '.join(Path(w).name for w in written)}")
    elif returncode == 0:
        typer.echo(f"no results written (results go to {out})")
    if returncode:
        fail("bench", CliError(f"python -m bench.run exited with {returncode}"))
        raise typer.Exit(returncode if returncode in (1, 2) else 1)


# -- registration -----------------------------------------------------------------------------


def register(app: typer.Typer) -> None:
    """Add the operator commands to the `fencemq` app."""
    app.command("queues")(queues)
    app.command("lmqs")(lmqs)
    app.add_typer(inspect_app, name="inspect")
    app.command("evict")(evict)
    app.command("sweep")(sweep)
    app.command("seek")(seek)
    app.command("purge")(purge)
    app.add_typer(dlq_app, name="dlq")
    app.command("top")(top)
    app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(bench)


if __name__ == "__main__":  # pragma: no cover
    standalone = typer.Typer(add_completion=False, no_args_is_help=True)
    register(standalone)
    standalone()

