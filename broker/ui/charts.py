"""Line charts as inline SVG, drawn on the server (no script, no chart library)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from markupsafe import Markup, escape

WIDTH, HEIGHT, PAD = 600, 160, 4


def _nice(top: float) -> float:
    if top <= 0:
        return 1.0
    step = 10 ** (len(str(int(top))) - 1)
    for m in (1, 2, 5, 10):
        if top <= m * step:
            return float(m * step)
    return float(10 * step)


def line_chart(points: Sequence[dict[str, Any]], series: Iterable[tuple[str, str]], *, title: str,
               unit: str = "/s") -> Markup:
    """``series``: (field, label) pairs of ``points``; drawn against the points' ``t`` (ms)."""
    series = list(series)
    values = [p.get(f) for p in points for f, _ in series]
    top = _nice(max([v for v in values if v is not None] or [0]))
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" preserveAspectRatio="none" '
             f'aria-label="{escape(title)}">', f"<title>{escape(title)}</title>"]
    for frac in (0.25, 0.5, 0.75):
        y = PAD + (HEIGHT - 2 * PAD) * frac
        parts.append(f'<line class="grid" x1="0" x2="{WIDTH}" y1="{y:.1f}" y2="{y:.1f}"/>')
    if len(points) >= 2:
        t0, t1 = points[0]["t"], points[-1]["t"]
        span = max(1, t1 - t0)
        for i, (f, label) in enumerate(series):
            coords = []
            for p in points:
                v = p.get(f)
                if v is None:
                    continue
                x = (p["t"] - t0) / span * WIDTH
                y = HEIGHT - PAD - (v / top) * (HEIGHT - 2 * PAD)
                coords.append(f"{x:.1f},{y:.1f}")
            if coords:
                parts.append(f'<polyline class="s{i}" points="{" ".join(coords)}"><title>{escape(label)}</title>'
                             "</polyline>")
    parts.append("</svg>")
    legend = " ".join(
        f'<span class="key s{i}">{escape(label)} {_last(points, f)}</span>' for i, (f, label) in enumerate(series))
    scale = f'<span class="scale">scale: 0 – {top:g}{escape(unit)}</span>'
    return Markup(f'<figure class="chartbox"><figcaption>{escape(title)}</figcaption>{"".join(parts)}'
                  f'<div class="legend">{legend} {scale}</div></figure>')


def _last(points: Sequence[dict[str, Any]], f: str) -> str:
    for p in reversed(points):
        if p.get(f) is not None:
            return f"{p[f]:,.1f}"
    return "–"
