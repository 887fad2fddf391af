"""``fencemq top``: the busiest queues, refreshed live (rates between two samples).

Options, exit codes and output conventions as in cli/ops.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import typer
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.text import Text

from fencemq.ops import maintenance
from fencemq.ops import operations as ops
from fencemq.model.keys import Keyspace
from fencemq.cli.common import safe_url
from fencemq.cli.opskit import (
    Cluster,
    Ctx,
    Json,
    Prefix,
    RedisUrl,
    _opt,
    _out,
    _rate,
    _row,
    _secs,
    _table,
    _when,
)

class Flow:
    """Parts laid out two spaces apart, a line broken only between two parts (never inside one, as
    plain wrapping broke 'prefix fmq' at 80 columns); a part wider than the line folds on its own."""

    def __init__(self, parts: list[Text]) -> None:
        self.parts = parts

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        line = Text()
        for part in self.parts:
            if line and line.cell_len + 2 + part.cell_len > options.max_width:
                yield line
                line = Text()
            if line:
                line.append("  ")
            line.append_text(part)
        if line:
            yield line


def _fitted_view(console: Console, sample: dict[str, Any], url: str, prefix: str) -> Group:
    """The view, in the terminal's height: rows that do not fit are counted in a last line, not scrolled."""
    queues, suspects = list(sample["queues"]), list(sample["suspected"])
    while True:
        hidden = (len(sample["queues"]) - len(queues), len(sample["suspected"]) - len(suspects))
        view = _top_view({**sample, "queues": queues, "suspected": suspects}, url, prefix, hidden)
        if not console.is_terminal or not (queues or suspects):
            return view
        if len(console.render_lines(view, console.options, pad=False)) < console.height:
            return view
        (suspects if len(suspects) >= len(queues) else queues).pop()


def _top_view(sample: dict[str, Any], url: str, prefix: str, hidden: tuple[int, int] = (0, 0)) -> Group:
    head = Flow([
        Text("FenceMQ top", style="bold"), Text(_when(sample["now_ms"])), Text(f"redis {safe_url(url)}"),
        Text(f"prefix {prefix}"), Text(f"workers {sample['workers_alive']}"),
        Text(f"sessions {sample['sessions_alive']}/{sample['sessions']}"),
        Text(f"queues {sample['queues_seen']}{'+' if sample['queues_truncated'] else ''}"),
        Text(f"publish/s {_rate(sample['totals']['publish'])}"), Text(f"deliver/s {_rate(sample['totals']['deliver'])}"),
    ])
    t = _table(drop=("last\nid", "expired/s", "nack/s", "dead", "ack/s", "checked\nout"))
    t.add_column("queue", overflow="fold", style="bold", ratio=2)
    for col in ("last\nid", "backlog", "checked\nout", "pub/s", "out/s", "ack/s", "nack/s", "expired/s", "dead"):
        t.add_column(col, justify="right")
    t.add_column("consumers", overflow="fold", ratio=1)
    for q in sample["queues"]:
        r = q["rates"]
        _row(t, q["name"], str(q["seq"]), _opt(q["backlog"]), str(q["checkouts"]), _rate(r["publish"]),
                  _rate(r["deliver"]), _rate(r["journal_ack"]), _rate(r["journal_nack"]), _rate(r["journal_timeout"]),
                  str(q["dead_letters"]), ", ".join(q["consumers"]) or "–")
    parts: list[Any] = [head, t if sample["queues"] else Text("No queues.", style="dim")]
    if sample["suspected"]:
        s = _table("Suspected and evicted members")
        for col in ("queue", "group", "member", "state"):
            s.add_column(col, overflow="fold")
        for x in sample["suspected"]:
            state = (Text(f"evicted by {x['marker']}", style="red") if x["marker"] is not None
                     else Text(f"suspected for {_secs(x['suspected_for_s'])}", style="yellow"))
            _row(s, x["queue"], x["group"], x["member"], state)
        parts.append(s)
    if any(hidden):
        parts.append(Text(f"… {hidden[0]} more queue(s), {hidden[1]} more suspect(s): a taller terminal shows them",
                          style="dim"))
    return Group(*parts)


def top(
    interval: Annotated[float, typer.Option("--interval", min=0.05, help="Seconds between refreshes.")] = 1.0,
    iterations: Annotated[int | None, typer.Option("--iterations", min=1, show_default=False,
                                                      help="Stop after this many refreshes (default: until ^C).")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="Show the busiest this many queues.")] = 20,
    scan_limit: Annotated[int, typer.Option("--scan-limit", min=1, help="Consider at most this many queues "
                                            "(the first SCAN finds) each refresh.")] = 10_000,
    topic: Annotated[str | None, typer.Option("--topic", show_default=False,
                                                 help="Only this topic's queues.")] = None,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    cluster: Cluster = False,
    as_json: Json = False,
) -> None:
    """A live view of the busiest queues, their consumers, and suspected or evicted members.

    Per queue: last id, backlog, checkouts, dead letters and rates between
    refreshes: publish/s from the last id, out/s from the members' delivered
    counters, ack/nack/expired per second from the journal. --json prints one
    JSON object per refresh, one per line.
    """
    ctx = Ctx("top", redis_url, prefix, cluster)
    flt = ops.QueueFilter(topic=topic) if topic else None
    ctx.topic = topic or "#"
    state = maintenance.TopState()

    async def loop(r: Any, k: Keyspace) -> None:
        from rich.live import Live

        n = 0
        console = _out()
        live = None if as_json else Live(console=console, auto_refresh=False, transient=False,
                                         vertical_overflow="crop")
        try:
            if live is not None:
                live.start()
            while True:
                sample = await maintenance.top_sample(r, k, state, limit=limit, scan_limit=scan_limit, flt=flt)
                n += 1
                if as_json:
                    typer.echo(json.dumps(sample, separators=(",", ":"), default=str))
                else:
                    live.update(_fitted_view(console, sample, ctx.url, ctx.prefix), refresh=True)
                if iterations is not None and n >= iterations:
                    return
                await asyncio.sleep(interval)
        finally:
            if live is not None:
                live.stop()

    try:
        ctx.run(loop)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
