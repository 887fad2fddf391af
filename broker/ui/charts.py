"""Line charts as inline SVG, drawn on the server (no script, no chart library), with a time axis.

The plot is an SVG stretched to its box; the axes' labels are HTML beside it (text inside a
stretched SVG would be distorted): the y axis at 0, half and the top of a rounded scale, the time
axis at five ticks across the chart's whole range (UTC), so a quiet broker's chart still spans it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from markupsafe import Markup, escape

WIDTH, HEIGHT, PAD = 600, 160, 4
TICKS = 5


def _nice(top: float) -> float:
    if top <= 0:
        return 1.0
    step = 10 ** (len(str(int(top))) - 1)
    for m in (1, 2, 5, 10):
        if top <= m * step:
            return float(m * step)
    return float(10 * step)


def _clock(ms: int, span_ms: int) -> str:
    return time.strftime("%H:%M:%S" if span_ms <= 600_000 else "%H:%M", time.gmtime(ms / 1000))


def _scale(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 or v == int(v) else f"{v:g}"


def line_chart(points: Sequence[dict[str, Any]], series: Iterable[tuple[str, str]], *, title: str,
               unit: str = "/s", start_ms: int | None = None, end_ms: int | None = None) -> Markup:
    """``series``: (field, label) pairs of ``points``; drawn against the points' ``t`` (ms) between
    ``start_ms`` and ``end_ms`` (the first and last point's when not given)."""
    series = list(series)
    values = [p.get(f) for p in points for f, _ in series]
    top = _nice(max([v for v in values if v is not None] or [0]))
    t0 = start_ms if start_ms is not None else (points[0]["t"] if points else 0)
    t1 = end_ms if end_ms is not None else (points[-1]["t"] if points else 1)
    span = max(1, t1 - t0)
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" preserveAspectRatio="none" '
             f'aria-label="{escape(title)}">', f"<title>{escape(title)}</title>"]
    for frac in (0.0, 0.5):
        y = PAD + (HEIGHT - 2 * PAD) * frac
        parts.append(f'<line class="grid" x1="0" x2="{WIDTH}" y1="{y:.1f}" y2="{y:.1f}"/>')
    for i in range(1, TICKS):
        x = WIDTH * i / TICKS
        parts.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="{HEIGHT}"/>')
    for i, (f, label) in enumerate(series):
        coords = []
        for p in points:
            v = p.get(f)
            if v is None or not t0 <= p["t"] <= t1:
                continue
            x = (p["t"] - t0) / span * WIDTH
            y = HEIGHT - PAD - (v / top) * (HEIGHT - 2 * PAD)
            coords.append(f"{x:.1f},{y:.1f}")
        if len(coords) >= 2:
            parts.append(f'<polyline class="s{i}" points="{" ".join(coords)}"><title>{escape(label)}</title>'
                         "</polyline>")
    parts.append("</svg>")
    ys = "".join(f'<span style="top:{100 * (1 - frac) * (HEIGHT - 2 * PAD) / HEIGHT + 100 * PAD / HEIGHT:.1f}%">'
                 f"{_scale(top * frac)}</span>" for frac in (1.0, 0.5, 0.0))
    xs = "".join(f'<span style="left:{100 * i / TICKS:.0f}%">{_clock(t0 + span * i // TICKS, span)}</span>'
                 for i in range(TICKS + 1))
    legend = " ".join(
        f'<span class="key s{i}">{escape(label)} {_last(points, f)}</span>' for i, (f, label) in enumerate(series))
    return Markup(f'<figure class="chartbox"><figcaption>{escape(title)}</figcaption>'
                  f'<div class="plot"><div class="yaxis" aria-hidden="true">{ys}</div>{"".join(parts)}</div>'
                  f'<div class="xaxis" aria-label="time axis, UTC">{xs}</div>'
                  f'<div class="legend">{legend} <span class="scale">{escape(unit.strip())}, UTC</span></div>'
                  "</figure>")


def _last(points: Sequence[dict[str, Any]], f: str) -> str:
    for p in reversed(points):
        if p.get(f) is not None:
            return f"{p[f]:,.1f}" if isinstance(p[f], float) else f"{p[f]:,}"
    return "–"
