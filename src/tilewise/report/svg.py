"""Inline SVG line plots (no plotting library, no network): measured cost against size."""

from __future__ import annotations

import math
from html import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round tick values covering [lo, hi] (1-2-5 steps, Heckbert's nice numbers)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"tick range must be finite, got lo={lo}, hi={hi}")
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, v = [], start
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 12))
        v += step
    if ticks[-1] < hi:
        ticks.append(round(v, 12))
    return ticks


def decade_ticks(lo: float, hi: float) -> list[float]:
    """Whole decades (log10 values) covering [lo, hi]; at least two."""
    a, b = math.floor(lo), math.ceil(hi)
    return [float(t) for t in range(a, max(b, a + 1) + 1)]


def fmt(v: float) -> str:
    """Short human number: 1, 2.25, 1.5e+04."""
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.2g}"
    return f"{v:.4g}"


def line_plot(series: dict[str, list[tuple[float, float]]], x_label: str, y_label: str,
              width: int = 520, height: int = 320, dashed: frozenset[str] = frozenset(),
              title: str = "", log: bool = False) -> str:
    """An inline <svg>: axes, ticks, a polyline + markers per series, a legend; log: log-log axes."""
    raw = [p for s in series.values() for p in s]
    if not raw:
        raise ValueError("line_plot needs at least one point; got only empty series "
                         f"{sorted(series)}")
    if log and any(x <= 0 or y <= 0 for x, y in raw):
        raise ValueError(f"log axes need positive values, got {[p for p in raw if min(p) <= 0][:5]}")
    tr = (lambda v: math.log10(v)) if log else (lambda v: v)
    label = (lambda t: fmt(10**t)) if log else fmt
    series = {k: [(tr(x), tr(y)) for x, y in s] for k, s in series.items()}
    pts = [p for s in series.values() for p in s]
    ml, mr, mt, mb = 64, 28, 28 if title else 12, 44
    lo = (lambda v: v) if log else (lambda v: min(0.0, v))
    ticks = decade_ticks if log else nice_ticks
    xt = ticks(lo(min(p[0] for p in pts)), max(p[0] for p in pts))
    yt = ticks(lo(min(p[1] for p in pts)), max(p[1] for p in pts))
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]

    def sx(x: float) -> float:
        return ml + (x - x0) / (x1 - x0) * (width - ml - mr)

    def sy(y: float) -> float:
        return height - mb - (y - y0) / (y1 - y0) * (height - mt - mb)

    out = [f'<svg class="plot" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           f'role="img" aria-label="{escape(title or y_label)}">']
    if title:
        out.append(f'<text x="{width / 2:.1f}" y="16" text-anchor="middle" class="ttl">'
                   f'{escape(title)}</text>')
    for t in xt:
        out.append(f'<line x1="{sx(t):.1f}" y1="{mt}" x2="{sx(t):.1f}" y2="{height - mb}" class="grid"/>'
                   f'<text x="{sx(t):.1f}" y="{height - mb + 16}" text-anchor="middle">{label(t)}</text>')
    for t in yt:
        out.append(f'<line x1="{ml}" y1="{sy(t):.1f}" x2="{width - mr}" y2="{sy(t):.1f}" class="grid"/>'
                   f'<text x="{ml - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{label(t)}</text>')
    out.append(f'<text x="{(ml + width - mr) / 2:.1f}" y="{height - 6}" text-anchor="middle">'
               f'{escape(x_label)}</text>')
    out.append(f'<text transform="translate(14 {(mt + height - mb) / 2:.1f}) rotate(-90)" '
               f'text-anchor="middle">{escape(y_label)}</text>')
    for i, (name, s) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        s = sorted(s)
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
        dash = ' stroke-dasharray="5 4"' if name in dashed else ""
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        if name not in dashed:
            out.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}">'
                       f'<title>{escape(name)}: {label(x)}, {label(y)}</title></circle>' for x, y in s)
        ly = mt + 14 * i + 10
        out.append(f'<line x1="{ml + 10}" y1="{ly}" x2="{ml + 28}" y2="{ly}" stroke="{color}" '
                   f'stroke-width="2"{dash}/><text x="{ml + 32}" y="{ly + 4}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)
