"""The HTML report of an analytics run: audit verdict, totals, top lists, PNG plots.

Plain HTML (no scripts, no external assets) next to its PNGs, so the
directory can be opened from disk, attached to a ticket or committed. Plots
need matplotlib (Agg backend); without it the report says so and shows the
tables only. Imports nothing from the broker (spark-submit ships it alone).
"""

from __future__ import annotations

import html
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

AUDIT_TITLES = {
    "audit_evicted_out": "Checkouts handed to a client after its eviction committed (before it subscribed again)",
    "audit_stale_epoch": "Checkouts under a stale epoch (lower than the group's, raised by an earlier seek)",
    "audit_double_ack": "Messages acknowledged twice within a group with no rewind (seek) between",
}

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1200px;color:#222}
h1{margin-bottom:.2em} h2{margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:.2em}
.meta{color:#666}
.verdict{font-size:1.6em;font-weight:bold;padding:.5em 1em;border-radius:6px;display:inline-block}
.PASS{background:#e3f6e5;color:#1b6e2a;border:1px solid #8fd19e}
.FAIL{background:#fdecea;color:#a11;border:1px solid #f5a3a3}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
th,td{border:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f4f4f4} td.n{text-align:right;font-variant-numeric:tabular-nums}
.plots{display:flex;flex-wrap:wrap;gap:1em} .plots figure{margin:0} .plots img{max-width:560px;border:1px solid #eee}
.ok{color:#1b6e2a} .bad{color:#a11;font-weight:bold} .note{color:#666;font-size:.9em}
"""


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else ""
    if isinstance(value, float):
        return f"{value:,.3f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v) for v in value)
    return str(value)


def _is_time(column: str, value: Any) -> bool:
    return (column.endswith("_ms") and "age" not in column and isinstance(value, int)
            and not isinstance(value, bool) and value > 10**11)


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _table(rows: list[dict[str, Any]], columns: list[str] | None = None, empty: str = "none") -> str:
    if not rows:
        return f'<p class="note">{html.escape(empty)}</p>'
    columns = columns or list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c)
            if _is_time(c, v):  # a Redis-clock timestamp: shown as UTC time, not as a count
                cells.append(f"<td>{html.escape(_when(v))}</td>")
                continue
            cls = ' class="n"' if isinstance(v, (int, float)) and not isinstance(v, bool) else ""
            cells.append(f"<td{cls}>{html.escape(_fmt(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _label(r: dict[str, Any], member: bool = False) -> str:
    queue = r.get("topic") or r.get("queue") or "?"
    if r.get("lmq") is not None:
        queue += f"[{r['lmq']}]"
    text = f"{queue} / {r.get('group')}"
    return text + (f" / {r.get('member')}" if member else "")


def _plots(out: Path, data: dict[str, Any]) -> tuple[list[tuple[str, str]], str | None]:
    """[(png file, caption)], or an explanation when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "plots skipped: matplotlib is not installed (pip install matplotlib)"

    made: list[tuple[str, str]] = []

    def bar(name: str, caption: str, labels: list[str], values: list[float], xlabel: str,
            horizontal: bool = True, color: str = "#4c72b0") -> None:
        fig, ax = plt.subplots(figsize=(7, 0.6 + 0.32 * max(len(labels), 3)) if horizontal else (7, 3.6))
        if not labels:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
        elif horizontal:
            ax.barh(range(len(labels)), values, color=color)
            ax.set_yticks(range(len(labels)), [lab[:48] for lab in labels], fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel(xlabel)
        else:
            ax.bar(range(len(labels)), values, color=color)
            ax.set_xticks(range(len(labels)), labels, fontsize=8, rotation=30 if len(labels) > 8 else 0)
            ax.set_ylabel(xlabel)
        ax.set_title(caption, fontsize=10)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        made.append((name, caption))

    top = data["backlog"][:15]
    bar("backlog_top.png", "Largest backlogs (unread + ready)", [_label(r) for r in top],
        [r["backlog"] for r in top], "messages")
    hist = data["age_histogram"]
    bar("oldest_unacked_age.png", "Oldest unacked message age, groups per bucket", [h[0] for h in hist],
        [h[1] for h in hist], "groups", horizontal=False, color="#dd8452")
    dc = data["delivery_counts"]
    bar("delivery_counts.png", "Delivery-count distribution (messages by deliveries)",
        [str(r["acquisitions"]) for r in dc], [r["messages"] for r in dc], "messages", horizontal=False,
        color="#55a868")
    cons = [r for r in data["consumers"] if r.get("lock_expiries")][:15]
    bar("lock_expiries_top.png", "Lock expiries per consumer", [_label(r, True) for r in cons],
        [r["lock_expiries"] for r in cons], "expired leases", color="#c44e52")
    pre = data["preemptions"][:15]
    bar("preemptions_top.png", "Preemption churn per lmq / group", [_label(r) for r in pre],
        [r["preemptions"] + r["evictions"] for r in pre], "preemptions + evictions", color="#8172b3")
    evs = data["events"]
    bar("journal_events.png", "Journal events by type", [r["event"] for r in evs], [r["count"] for r in evs],
        "events", color="#937860")
    return made, None


def render(out: Path, summary: dict[str, Any], manifest: dict[str, Any], data: dict[str, Any]) -> Path:
    out = Path(out)
    plots, plot_note = _plots(out, data)
    audit = summary["audit"]
    verdict = audit["verdict"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>FenceMQ analytics</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>FenceMQ analytics</h1>",
        (f"<p class='meta'>Snapshot {html.escape(str(manifest.get('created')))} of "
         f"{html.escape(str(manifest.get('source')))} (prefix {html.escape(str(manifest.get('prefix')))}, "
         f"{_fmt(manifest.get('queues'))} queues) — report generated "
         f"{datetime.now(UTC).isoformat(timespec='seconds').replace('+00:00', 'Z')}</p>"),
        "<h2>Fence audit</h2>",
        f"<div class='verdict {verdict}'>{verdict}</div>",
        ("<p>Each count must be zero on a healthy broker. Events are compared in journal order "
         "(position in the queue's journal), never by timestamp.</p><ul>"),
    ]
    for name, title in AUDIT_TITLES.items():
        n = audit[name[len("audit_"):]]
        cls = "ok" if n == 0 else "bad"
        parts.append(f"<li><span class='{cls}'>{_fmt(n)}</span> — {html.escape(title)}</li>")
    parts.append("</ul>")
    unaudited = summary["totals"].get("not_audited", 0)
    if unaudited:
        parts.append(f"<p class='bad'>{_fmt(unaudited)} queues have no journal and were not audited "
                     "(lmqs keep one only with FENCEMQ_LITE_JOURNAL_CAP set).</p>")
    for name, title in AUDIT_TITLES.items():
        rows = data.get(name) or []
        if rows:
            n = audit[name[len("audit_"):]]
            more = f" (first {len(rows)} of {_fmt(n)})" if n > len(rows) else ""
            parts.append(f"<h3>{html.escape(title)}{more}</h3>{_table(rows)}")

    t = summary["totals"]
    parts.append("<h2>Totals</h2>")
    parts.append(_table([{"figure": k, "value": v} for k, v in t.items()]))
    parts.append("<h2>Plots</h2>")
    if plot_note:
        parts.append(f"<p class='note'>{html.escape(plot_note)}</p>")
    parts.append("<div class='plots'>" + "".join(
        f"<figure><img src='{html.escape(png)}' alt='{html.escape(cap)}'></figure>" for png, cap in plots) + "</div>")

    parts.append("<h2>Backlog per topic / group</h2>")
    parts.append(_table(data["backlog_by_topic"]))
    parts.append("<h2>Largest backlogs (per topic / lmq / group)</h2>")
    parts.append(_table(data["backlog"], ["topic", "lmq", "group", "mode", "owner", "unread", "ready", "delayed",
                                          "checkouts", "backlog", "oldest_unacked_age_ms"]))
    parts.append("<h2>Oldest unacked messages</h2>")
    parts.append(_table(data["oldest"], ["topic", "lmq", "group", "oldest_pending_id", "oldest_unacked_age_ms",
                                         "backlog"]))
    parts.append("<h3>Oldest unacked age, groups per bucket</h3>")
    parts.append(_table([{"age": label, "groups": n} for label, n in data["age_histogram"]]))
    parts.append("<h2>Delivery-count distribution</h2>")
    parts.append(_table(data["delivery_counts"]))
    parts.append("<h2>Lock expiries and suspicions per consumer</h2>")
    parts.append(_table(data["consumers"], ["topic", "lmq", "group", "member", "outs", "acks", "nacks",
                                            "lock_expiries", "suspicions", "suspected_now", "evicted_by"],
                        empty="no lock expired and no consumer is suspected"))
    parts.append("<h2>Preemption churn</h2>")
    parts.append(_table(data["preemptions"], ["topic", "lmq", "group", "preemptions", "evictions", "fenced_pulls",
                                              "owners", "evicted", "first_ms", "last_ms"], empty="no preemptions"))
    parts.append("<h2>Seek activity</h2>")
    parts.append(_table(data["seeks"], ["topic", "lmq", "group", "seeks", "earliest", "latest", "id", "time",
                                        "last_seek_ms", "epoch", "cursor"], empty="no seeks"))
    parts.append("<h2>Journal events</h2>")
    parts.append(_table(data["events"]))
    parts.append("<h2>Result tables</h2>")
    parts.append(_table([{"table": k, "rows": v, "path": f"{k}/"} for k, v in summary["tables"].items()]))
    parts.append("</body></html>")
    path = out / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
