"""The HTML report of an analytics run, in the order people read it.

1. the fence audit: PASS/FAIL, each check with the guarantee it proves, on
   which queues and on how much, and plainly what could not be checked;
2. backlog and oldest unacked message; 3. redeliveries; 4. consumers with
   lock expiries and suspicions; 5. preemption churn (the lmqs' too, from
   their meta counters); 6. seeks; then the journal events and result tables.

One self-contained file: no scripts, no external assets, the plots inlined
as PNG data URIs, so it opens offline, attached to a ticket or committed.
Figures are in human units (``4 min 0 s``, ``1.2 M``); a plot whose values
span two orders of magnitude or more gets a log scale, and counts get
integer ticks. Plots need matplotlib (Agg backend); without it the report
says so and shows the tables. Imports nothing from the broker (spark-submit
ships it alone).
"""

from __future__ import annotations

import base64
import html
import io
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1200px;color:#222}
h1{margin-bottom:.2em} h2{margin-top:1.8em;border-bottom:1px solid #ddd;padding-bottom:.2em}
.meta{color:#666}
.verdict{font-size:1.6em;font-weight:bold;padding:.4em 1em;border-radius:6px;display:inline-block}
.PASS{background:#e3f6e5;color:#1b6e2a;border:1px solid #8fd19e}
.FAIL{background:#fdecea;color:#a11;border:1px solid #f5a3a3}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
th,td{border:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f4f4f4} td.n{text-align:right;font-variant-numeric:tabular-nums}
figure{margin:.6em 0} img{max-width:100%;border:1px solid #eee}
.ok{color:#1b6e2a} .bad{color:#a11;font-weight:bold} .warn{color:#8a5a00} .note{color:#666;font-size:.9em}
.cards{display:flex;flex-wrap:wrap;gap:.6em} .card{border:1px solid #ddd;border-radius:6px;padding:.4em .8em}
.card b{display:block;font-size:1.3em}
"""

# What each figure of the summary is called in the report, and its unit
LABELS: dict[str, tuple[str, str]] = {
    "queues": ("queues", "count"), "lmqs": ("of which lmqs", "count"), "groups": ("subscriptions (groups)", "count"),
    "members": ("consumers (members)", "count"), "journal_events": ("journal events read", "count"),
    "not_audited": ("queues without a journal", "count"), "topics": ("topics", "count"),
    "backlog": ("backlog (unread + ready)", "count"), "unread": ("unread", "count"), "ready": ("ready again", "count"),
    "delayed": ("delayed", "count"), "checkouts": ("checked out", "count"),
    "max_oldest_unacked_age_ms": ("oldest unacked message", "ms"),
    "outs": ("deliveries (journal)", "count"), "redeliveries": ("redeliveries", "count"), "acks": ("acks", "count"),
    "nacks": ("nacks", "count"), "discards": ("discards", "count"), "dead_letters": ("dead letters", "count"),
    "timeouts": ("lock expiries", "count"), "seeks": ("seeks", "count"), "preemptions": ("preemptions", "count"),
    "evictions": ("operator evictions", "count"), "fenced_pulls": ("fenced pulls", "count"),
    "lmqs_with_churn": ("lmqs with churn", "count"), "groups_with_churn": ("subscriptions with churn", "count"), "suspicions": ("suspicions", "count"),
    "suspected_now": ("consumers suspected now", "count"),
}


# -- human units ---------------------------------------------------------------------------------------


def count(n: Any) -> str:
    """1,234 below 10,000; then 12.3 k, 1.2 M, 3.4 G."""
    if n is None:
        return ""
    n = int(n)
    if abs(n) < 10_000:
        return f"{n:,}"
    for div, unit in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if abs(n) >= div:
            v = n / div
            return f"{v:.1f} {unit}" if abs(v) < 100 else f"{v:,.0f} {unit}"
    return f"{n:,}"  # pragma: no cover


def duration(ms: Any) -> str:
    """850 ms, 4.2 s, 4 min 0 s, 2 h 5 min, 3 d 4 h."""
    if ms is None:
        return ""
    ms = int(ms)
    sign, ms = ("-" if ms < 0 else ""), abs(ms)
    if ms < 1000:
        return f"{sign}{ms} ms"
    s = ms / 1000
    if s < 60:
        return f"{sign}{s:.1f} s"
    s = int(s)
    if s < 3600:
        return f"{sign}{s // 60} min {s % 60} s"
    if s < 86400:
        return f"{sign}{s // 3600} h {s % 3600 // 60} min"
    return f"{sign}{s // 86400} d {s % 86400 // 3600} h"


def wants_log_scale(values: list[float]) -> bool:
    """A plot's values span two orders of magnitude or more (zeros aside): linear would hide the small ones."""
    shown = [v for v in values if v and v > 0]
    return bool(shown) and max(shown) / min(shown) >= 100


def when(ms: Any) -> str:
    if ms is None:
        return ""
    return datetime.fromtimestamp(int(ms) / 1000, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _cell(column: str, value: Any) -> tuple[str, bool]:
    """(text, numeric) of a table cell, by what the column holds."""
    if value is None:
        return "", False
    if isinstance(value, bool):
        return ("yes" if value else "no"), False
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value), False
    if isinstance(value, int):
        if column.endswith("_ms") and ("age" in column or column.startswith("lock")):
            return duration(value), True
        if column.endswith("_ms"):
            return when(value), False
        if column in ("seq", "first_seq", "last_seq", "id", "oldest_pending_id", "cursor", "epoch", "group_epoch",
                      "evicted_at", "resubscribed_at", "acquisitions"):
            return str(value), True
        return count(value), True
    if isinstance(value, float):
        return f"{value:,.2f}", True
    return str(value), False


def _table(rows: list[dict[str, Any]], columns: list[str] | None = None, empty: str = "none",
           headers: dict[str, str] | None = None) -> str:
    if not rows:
        return f'<p class="note">{html.escape(empty)}</p>'
    columns = columns or list(rows[0])
    headers = headers or {}
    head = "".join(f"<th>{html.escape(headers.get(c, c.replace('_', ' ')))}</th>" for c in columns)
    body = []
    for r in rows:
        cells = []
        for c in columns:
            text, numeric = _cell(c, r.get(c))
            cells.append(f"<td{' class=n' if numeric else ''}>{html.escape(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _label(r: dict[str, Any], member: bool = False) -> str:
    queue = r.get("topic") or r.get("queue") or "?"
    if r.get("lmq") is not None:
        queue += f"[{r['lmq']}]"
    text = f"{queue} / {r.get('group')}"
    return text + (f" / {r.get('member')}" if member else "")


# -- plots -----------------------------------------------------------------------------------------------


class Plots:
    """Bar charts rendered to inline PNG data URIs (None when matplotlib is missing)."""

    def __init__(self) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            from matplotlib import ticker
        except ImportError:
            self.plt = None
            self.note = "plots skipped: matplotlib is not installed (pip install matplotlib)"
            return
        self.plt, self.ticker, self.note = plt, ticker, None

    def bar(self, caption: str, labels: list[str], values: list[float], unit: str, *, horizontal: bool = True,
            color: str = "#4c72b0", durations: bool = False) -> str:
        if self.plt is None:
            return ""
        plt, ticker = self.plt, self.ticker
        fig, ax = plt.subplots(figsize=(8, 0.7 + 0.3 * max(len(labels), 3)) if horizontal else (8, 3.6))
        log = wants_log_scale(values)
        if not labels:
            ax.text(0.5, 0.5, "nothing to show", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
        else:
            pos = range(len(labels))
            if horizontal:
                ax.barh(pos, values, color=color)
                ax.set_yticks(pos, [lab[:52] for lab in labels], fontsize=8)
                ax.invert_yaxis()
                axis = ax.xaxis
                if log:
                    ax.set_xscale("log")
            else:
                ax.bar(pos, values, color=color)
                ax.set_xticks(pos, labels, fontsize=8, rotation=30 if len(labels) > 8 else 0)
                axis = ax.yaxis
                if log:
                    ax.set_yscale("log")
            fmt = (lambda v, _p: duration(v)) if durations else (lambda v, _p: count(v) if v == int(v) else "")
            if log:
                axis.set_major_locator(ticker.LogLocator(base=10))
                axis.set_minor_formatter(ticker.NullFormatter())
            else:
                axis.set_major_locator(ticker.MaxNLocator(integer=True, nbins=6))
            axis.set_major_formatter(ticker.FuncFormatter(fmt))
            (ax.set_xlabel if horizontal else ax.set_ylabel)(unit + (" (log scale)" if log else ""))
        ax.set_title(caption, fontsize=10)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90)
        plt.close(fig)
        data = base64.b64encode(buf.getvalue()).decode()
        return (f"<figure><img alt='{html.escape(caption)}' src='data:image/png;base64,{data}'>"
                f"</figure>")


# -- the report ------------------------------------------------------------------------------------------


def _audit(summary: dict[str, Any], data: dict[str, Any]) -> list[str]:
    audit = summary["audit"]
    scope = audit["scope"]
    verdict = audit["verdict"]
    parts = ["<h2>1. Fence audit</h2>", f"<div class='verdict {verdict}'>{verdict}</div>"]
    state, history = scope["state"], scope["history"]

    def kinds(by_kind: dict[str, int]) -> str:
        return ", ".join(f"{count(n)} {k}" for k, n in sorted(by_kind.items())) or "none"

    parts.append(
        f"<p>State checks ran on every queue ({kinds(state['by_kind'])}: {count(state['checkouts'])} checkouts, "
        f"{count(state['marked_members'])} evicted clients). History checks read the journal, in commit order, "
        f"of the queues that keep one ({kinds(history['by_kind'])}: {count(history['journal_events'])} "
        "events).</p>")
    rows = []
    for c in audit["checks"]:
        ok = c["violations"] == 0
        rows.append(f"<tr><td class={'ok' if ok else 'bad'}>{'pass' if ok else 'FAIL'}</td>"
                    f"<td>{html.escape(c['fence'])}</td><td>{html.escape(c['what'])}</td>"
                    f"<td>{html.escape(c['kind'])}</td><td class=n>{count(c['queues'])}</td>"
                    f"<td>{html.escape(_over(c['over']))}</td>"
                    f"<td class=n>{count(c['violations'])}</td></tr>")
    parts.append("<table><thead><tr><th>result</th><th>guarantee</th><th>checked</th><th>how</th><th>queues</th>"
                 "<th>on</th><th>violations</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")
    skipped = scope["history_not_checked"]
    if skipped:
        parts.append(
            "<p class='warn'><b>Not proved:</b> the history checks (eviction history, epoch history, ack-once) did "
            f"not run on {kinds(skipped)} queues: they keep no journal (lmqs by default; "
            "FENCEMQ_LITE_JOURNAL_CAP turns it on). For them only the state checks above ran, and their "
            "churn below comes from the counters in their meta hash.</p>")
    else:
        parts.append("<p class='ok'>Every queue keeps a journal: every check ran on every queue.</p>")
    parts.append("<h3>Coverage per queue kind</h3>")
    parts.append(_table(data.get("audit_coverage") or [], ["kind", "journal", "queues", "journal_events",
                                                          "checkouts", "marked_members"],
                        headers={"journal": "keeps a journal (history checked)"}))
    for c in audit["checks"]:
        rows_ = data.get(c["table"]) or []
        if rows_:
            more = f" (first {len(rows_)} of {count(c['violations'])})" if c["violations"] > len(rows_) else ""
            parts.append(f"<h3 class=bad>Violations: {html.escape(c['what'])}{more}</h3>{_table(rows_)}")
    return parts


def _over(text: str) -> str:
    n, _, rest = text.partition(" ")
    return f"{count(int(n))} {rest}" if n.isdigit() else text


def render(out: Path, summary: dict[str, Any], manifest: dict[str, Any], data: dict[str, Any]) -> Path:
    out = Path(out)
    plots = Plots()
    t = summary["totals"]
    chain = manifest.get("chain_length") or 1
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>FenceMQ analytics</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>FenceMQ analytics</h1>",
        (f"<p class='meta'>Snapshot {html.escape(str(manifest.get('created')))} of "
         f"{html.escape(str(manifest.get('source')))} (prefix {html.escape(str(manifest.get('prefix')))}, "
         f"{count(t.get('queues'))} queues"
         + (f", an incremental snapshot read with its chain of {chain}" if chain > 1 else "")
         + f") — report generated {datetime.now(UTC).isoformat(timespec='seconds').replace('+00:00', 'Z')}</p>"),
    ]
    parts += _audit(summary, data)

    cards = [("queues", t.get("queues")), ("lmqs", t.get("lmqs")), ("backlog", t.get("backlog")),
             ("oldest unacked", None), ("redeliveries", t.get("redeliveries")),
             ("lock expiries", t.get("timeouts")), ("preemptions", t.get("preemptions")),
             ("evictions", t.get("evictions")), ("seeks", t.get("seeks"))]
    parts.append("<div class='cards'>" + "".join(
        f"<div class='card'>{html.escape(k)}<b>"
        f"{html.escape(duration(t.get('max_oldest_unacked_age_ms')) if k == 'oldest unacked' else count(v))}"
        "</b></div>" for k, v in cards) + "</div>")

    # 2. backlog and oldest unacked
    parts.append("<h2>2. Backlog and oldest unacked message</h2>")
    top = data["backlog"][:15]
    parts.append(plots.bar("Largest backlogs (unread + ready)", [_label(r) for r in top],
                           [r["backlog"] for r in top], "messages"))
    hist = data["age_histogram"]
    parts.append(plots.bar("Oldest unacked message age: subscriptions per bucket", [h[0] for h in hist],
                           [h[1] for h in hist], "subscriptions", horizontal=False, color="#dd8452"))
    parts.append(_table([{"age": label, "subscriptions": n} for label, n in hist]))
    parts.append("<h3>Per topic / group</h3>")
    parts.append(_table(data["backlog_by_topic"]))
    parts.append("<h3>Largest backlogs (per topic / lmq / group)</h3>")
    parts.append(_table(data["backlog"], ["topic", "lmq", "group", "mode", "owner", "unread", "ready", "delayed",
                                          "checkouts", "backlog", "oldest_unacked_age_ms"],
                        headers={"oldest_unacked_age_ms": "oldest unacked"}))
    parts.append("<h3>Oldest unacked messages</h3>")
    parts.append(_table(data["oldest"], ["topic", "lmq", "group", "oldest_pending_id", "oldest_unacked_age_ms",
                                         "backlog"], headers={"oldest_pending_id": "message id",
                                                              "oldest_unacked_age_ms": "age"},
                        empty="nothing unacked"))

    # 3. redeliveries
    parts.append("<h2>3. Redeliveries</h2>")
    dc = data["delivery_counts"]
    parts.append(plots.bar("Messages by number of deliveries", [str(r["acquisitions"]) for r in dc],
                           [r["messages"] for r in dc], "messages", horizontal=False, color="#55a868"))
    parts.append(_table(dc, ["acquisitions", "messages", "out_events"],
                        headers={"acquisitions": "deliveries", "out_events": "deliveries journaled"},
                        empty="no deliveries in the journals read"))
    parts.append("<h3>Subscriptions with the most redeliveries</h3>")
    parts.append(_table(data.get("redeliveries") or [], ["topic", "lmq", "group", "outs", "redeliveries",
                                                          "messages", "max_acquisitions"],
                        headers={"outs": "deliveries", "max_acquisitions": "most deliveries of one message"},
                        empty="no redeliveries"))

    # 4. consumers
    parts.append("<h2>4. Consumers with lock expiries and suspicions</h2>")
    cons = [r for r in data["consumers"] if r.get("lock_expiries")][:15]
    parts.append(plots.bar("Lock expiries per consumer", [_label(r, True) for r in cons],
                           [r["lock_expiries"] for r in cons], "expired leases", color="#c44e52"))
    parts.append(_table(data["consumers"], ["topic", "lmq", "group", "member", "outs", "acks", "nacks",
                                            "lock_expiries", "suspicions", "suspected_now", "evicted_by"],
                        headers={"outs": "deliveries"}, empty="no lock expired and no consumer is suspected"))

    # 5. churn
    parts.append("<h2>5. Preemption churn</h2>")
    parts.append(f"<p>{count(t.get('preemptions'))} preemptions, {count(t.get('evictions'))} operator "
                 f"evictions and {count(t.get('fenced_pulls'))} fenced pulls in "
                 f"{count(t.get('groups_with_churn'))} subscriptions, {count(t.get('lmqs_with_churn'))} of them on "
                 "lmqs. From the counters every lmq keeps in its meta hash "
                 "once churn happens (source <i>meta</i>), and from journals where queues keep one.</p>")
    pre = data["preemptions"][:15]
    parts.append(plots.bar("Churn per lmq / group (preemptions + evictions)", [_label(r) for r in pre],
                           [r["preemptions"] + r["evictions"] for r in pre], "preemptions + evictions",
                           color="#8172b3"))
    parts.append(_table(data["preemptions"], ["topic", "lmq", "group", "preemptions", "evictions", "fenced_pulls",
                                              "owners", "clients", "first_ms", "last_ms", "source"],
                        headers={"owners": "clients seen", "clients": "who", "first_ms": "first",
                                 "last_ms": "last"}, empty="no preemptions, evictions or fenced pulls"))

    # 6. seeks
    parts.append("<h2>6. Seeks</h2>")
    parts.append(_table(data["seeks"], ["topic", "lmq", "group", "seeks", "earliest", "latest", "id", "time",
                                        "last_seek_ms", "epoch", "cursor"], headers={"last_seek_ms": "last seek"},
                        empty="no seeks"))

    parts.append("<h2>Journal events</h2>")
    evs = data["events"]
    parts.append(plots.bar("Journal events by type", [r["event"] for r in evs], [r["count"] for r in evs],
                           "events", color="#937860"))
    parts.append("<h2>All figures</h2>")
    parts.append(_table([{"figure": LABELS.get(k, (k.replace("_", " "), ""))[0],
                          "value": duration(v) if LABELS.get(k, ("", ""))[1] == "ms" else count(v)}
                         for k, v in t.items()]))
    if plots.note:
        parts.append(f"<p class='note'>{html.escape(plots.note)}</p>")
    parts.append("<h2>Result tables</h2>")
    parts.append(_table([{"table": k, "rows": v, "path": f"{k}/"} for k, v in summary["tables"].items()]))
    parts.append("</body></html>")
    path = out / "report.html"
    path.write_text("\n".join(p for p in parts if p), encoding="utf-8")
    return path
