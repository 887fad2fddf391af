"""``fencemq inspect queue|group|member|session``: one object of the broker, in full."""


from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from fencemq.fences.retention import Policy
from fencemq.ops import inspection
from fencemq.cli.retention_cmd import describe
from fencemq.cli.opskit import (
    Cluster,
    Ctx,
    Json,
    Lmq,
    Owner,
    Prefix,
    RedisUrl,
    Topic,
    _checkouts_table,
    _deadline,
    _emit_json,
    _kv,
    _member_state,
    _members_table,
    _name,
    _opt,
    _out,
    _queue,
    _row,
    _secs,
    _table,
    _when,
)

# -- inspect -----------------------------------------------------------------------------------

inspect_app = typer.Typer(help="Inspect a queue, a subscription group, a member, or a client's session.",
                          no_args_is_help=True)

InspectLimit = Annotated[int, typer.Option("--limit", min=0, max=100_000,
                                           help="List at most this many checkouts (handles, notices).")]


def _queue_header(q: dict[str, Any]) -> Table:
    rows: list[tuple[str, Any]] = [
        ("queue", Text(q["name"], style="bold")), ("id", q["qid"]), ("kind", q["kind"]),
        ("log", f"ids {q['first']}..{q['seq']} ({q['retained']} retained)"),
        ("retention", describe(Policy(**q["retention"])) if q.get("retention")
         else Text("none: what every group settled is deleted", style="dim")),
        ("last tag", q["last_tag"]), ("created", _when(q["created_ms"])), ("last write", _when(q["last_write_ms"])),
        ("backlog", q["backlog"]),
        ("checkouts", (f"{q['checkouts_total']} ({q['leased']} leased, "
                       f"{q['checkouts_total'] - q['leased']} waiting in mailboxes)")),
        ("returned", q["ready"]), ("delayed", q["delayed"]), ("scheduled", q["scheduled"]),
        ("expired", f"{q['expired']}" + (" (the lite topic's)" if q["kind"] == "lite" else "")),
        ("dead letters", Text(str(q["dead_letters"]), style="red" if q["dead_letters"] else "")),
        ("journal", f"{q['journal_length']} events (cap {_opt(q['journal_cap'])})"),
    ]
    if q.get("priority"):  # a priority queue's messages held per level, 9 first (fencemq priority show: per group)
        levels = q["priority"]["levels"]
        rows.append(("priority", ", ".join(f"level {lv}: {levels[lv]}" for lv in sorted(levels, reverse=True))
                     or "honoured (nothing held)"))
    if q["push_members"]:
        rows.append(("push members", ", ".join(q["push_members"])))
    if q["expires_in_s"] is not None:
        rows.append(("reclaimed in", _secs(q["expires_in_s"]) + " (idle lmq)"))
    return _kv(rows)


def _groups_table(groups: list[dict[str, Any]]) -> Table | Text:
    if not groups:
        return Text("No subscription groups.", style="dim")
    t = _table("Groups", drop=("returned", "delayed", "cursor", "unread", "epoch", "mode"))
    for col, kw in (("group", {"overflow": "fold", "style": "bold"}), ("mode", {}), ("epoch", {"justify": "right"}),
                    ("cursor", {"justify": "right"}), ("owner", {"overflow": "fold"}),
                    ("unread", {"justify": "right"}), ("returned", {"justify": "right"}),
                    ("delayed", {"justify": "right"}), ("backlog", {"justify": "right"}),
                    ("checked\nout", {"justify": "right"}), ("members", {"overflow": "fold"})):
        t.add_column(col, **kw)
    for g in groups:
        members = Text()
        for i, m in enumerate(g["members"]):
            if i:
                members.append(", ")
            members.append(m["member"], style="cyan" if m["owner"] else "")
            if m["marker"] is not None:
                members.append(f" (evicted by {m['marker']})", style="red")
            elif m["suspected"]:
                members.append(" (suspected)", style="yellow")
        _row(t, g["group"], _opt(g["mode"]), str(g["epoch"]), str(g["cursor"]), _opt(g["owner"]), str(g["unread"]),
                  str(g["returned"]), _opt(g["delayed"]), str(g["backlog"]), str(g["checkouts"]),
                  members if g["members"] else Text("–", style="dim"))
    return t


@inspect_app.command("queue")
def inspect_queue(
    topic: Topic,
    lmq: Lmq = None,
    owner: Owner = None,
    limit: InspectLimit = 20,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """A queue: log bounds, counters, every group (cursor, epoch, owner, backlog, members), checkouts."""
    ctx = Ctx("inspect", redis_url, prefix, cluster)
    ref = _queue(ctx, topic, lmq, owner)
    q = ctx.run(lambda r, k: inspection.inspect_queue(r, k, ref, limit=limit))
    if as_json:
        _emit_json(q)
        return
    console = _out()
    console.print(_queue_header(q))
    console.print(_groups_table(q["groups"]))
    for g in q["groups"]:
        if g["members"]:
            console.print(_members_table(g["members"], f"Members of {g['group']}"))
    console.print(_checkouts_table(q["checkouts"], q["checkouts_total"]))


@inspect_app.command("group")
def inspect_group(
    topic: Topic,
    group: Annotated[str, typer.Argument(metavar="GROUP", show_default=False)],
    lmq: Lmq = None,
    owner: Owner = None,
    limit: InspectLimit = 20,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """A subscription group: mode, epoch, cursor, owner, backlog, members (markers, suspicion, mailboxes), checkouts."""
    ctx = Ctx("inspect", redis_url, prefix, cluster)
    ref = _queue(ctx, topic, lmq, owner)
    g = ctx.run(lambda r, k: inspection.inspect_group(r, k, ref, group, limit=limit))
    if as_json:
        _emit_json(g)
        return
    console = _out()
    console.print(_kv([
        ("queue", Text(g["queue"], style="bold")), ("group", Text(g["group"], style="bold")),
        ("mode", g["mode"]), ("policy", g["policy"]), ("strategy", g["strategy"]), ("on preempt", g["on_preempt"]),
        ("epoch", g["epoch"]), ("cursor", f"{g['cursor']} (last id {g['seq']}, first retained {g['first']})"),
        ("owner", g["owner"]), ("unread", g["unread"]), ("returned", g["returned"]), ("delayed", g["delayed"]),
        ("backlog", g["backlog"]), ("checkouts", g["checkouts_total"]),
    ]))
    console.print(_members_table(g["members"]))
    console.print(_checkouts_table(g["checkouts"], g["checkouts_total"]))


def _session_rows(s: dict[str, Any] | None) -> list[tuple[str, Any]]:
    if s is None:
        return [("session", Text("none (never connected, or ended)", style="dim"))]
    lease = (_deadline(s["lease_in_s"]) if s["alive"] else
             Text("expired (being cleaned up)" if s["lease_deadline_ms"] is not None else "none", style="yellow"))
    return [("worker", s["worker"]), ("connection", s["connection"]), ("since", _when(s["since_ms"])),
            ("lease", lease), ("subscriptions", s["subscriptions"]), ("notices queued", s["notices_queued"])]


@inspect_app.command("member")
def inspect_member(
    topic: Topic,
    group: Annotated[str, typer.Argument(metavar="GROUP", show_default=False)],
    member: Annotated[str, typer.Argument(metavar="MEMBER", help="The member's client id.", show_default=False)],
    lmq: Lmq = None,
    owner: Owner = None,
    limit: InspectLimit = 20,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """One member: delivered/max, lock, suspicion, eviction marker, mailbox depth, its checkouts, its session."""
    ctx = Ctx("inspect", redis_url, prefix, cluster)
    ref = _queue(ctx, topic, lmq, owner)
    m = ctx.run(lambda r, k: inspection.inspect_member(r, k, ref, group, member, limit=limit))
    if as_json:
        _emit_json(m)
        return
    console = _out()
    mailbox = "–" if m["mailbox_depth"] is None else f"{m['mailbox_depth']} of capacity {m['capacity']}"
    console.print(_kv([
        ("queue", Text(m["queue"], style="bold")), ("group", f"{m['group']} ({m['mode']}, epoch {m['epoch']})"),
        ("member", Text(m["member"], style="bold")), ("state", _member_state(m)),
        ("position", m["position"]), ("group owner", m["group_owner"]),
        ("delivered", f"{m['delivered']}" + (f" of max {m['max']}" if m["max"] is not None else "")),
        ("lock ms", m["lock_ms"]), ("qos", m["qos"]),
        ("suspected", f"for {_secs(m['suspected_for_s'])}" if m["suspected"] else "no"),
        ("marker", m["marker"]), ("mailbox", mailbox), ("checkouts", m["checkouts_total"]), ("handle", m["handle"]),
    ]))
    console.print(_kv(_session_rows(m["session"]), title="Session"))
    console.print(_checkouts_table(m["checkouts"], m["checkouts_total"]))


@inspect_app.command("session")
def inspect_session(
    client: Annotated[str, typer.Argument(metavar="CLIENT", help="The client id.", show_default=False)],
    limit: InspectLimit = 20,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """A client's session: worker, lease, every subscription handle it holds (and its state), queued notices."""
    ctx = Ctx("inspect", redis_url, prefix, cluster)
    client = _name(ctx, client, "client")
    s = ctx.run(lambda r, k: inspection.inspect_session(r, k, client, limit=limit))
    if as_json:
        _emit_json(s)
        return
    console = _out()
    console.print(_kv([("client", Text(s["client"], style="bold")), *_session_rows(s)]))
    if s["handles"]:
        t = _table(f"Subscriptions ({len(s['handles'])} of {s['handles_total']})"
                   if s["handles_total"] > len(s["handles"]) else "Subscriptions",
                   drop=("epoch", "delivered", "mode"))
        for col, kw in (("queue", {"overflow": "fold", "style": "bold"}), ("group", {"overflow": "fold"}),
                        ("mode", {}), ("epoch", {"justify": "right"}), ("state", {}),
                        ("delivered", {"justify": "right"}), ("checked\nout", {"justify": "right"})):
            t.add_column(col, **kw)
        for h in s["handles"]:
            if "error" in h:
                _row(t, h["handle"][:40], "–", "–", "–", Text(h["error"], style="red"), "–", "–")
                continue
            state = _member_state(h) if h["member"] else Text("gone (not a member)", style="red")
            _row(t, h["queue"], h["group"], _opt(h["mode"]), str(h["epoch"]), state,
                      f"{h['delivered']}" + (f"/{h['max']}" if h["max"] is not None else ""), str(h["checkouts"]))
        console.print(t)
    else:
        console.print(Text("No subscriptions.", style="dim"))
    if s["lite_counts"]:
        console.print(_kv([(k, v) for k, v in sorted(s["lite_counts"].items())], title="Lite subscriptions per topic"))
    if s["notices"]:
        t = _table(f"Queued notices ({len(s['notices'])} of {s['notices_queued']})")
        t.add_column("type")
        t.add_column("details", overflow="fold")
        for n in s["notices"]:
            details = ", ".join(f"{k}={v}" for k, v in n.items() if k not in ("type", "handle"))
            _row(t, str(n.get("type", "?")), details)
        console.print(t)


