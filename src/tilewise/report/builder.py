"""Build one self-contained HTML page from a run directory (inline CSS/JS, images as data URIs)."""

from __future__ import annotations

import base64
import json
import logging
import os
from html import escape
from pathlib import Path
from typing import Any

from ..atomic import atomic_path
from .instrument import instrument_html
from .svg import fmt, line_plot

logger = logging.getLogger(__name__)

MAX_ROWS = 200  # rows shown per table; the rest are counted, not dropped silently
MAX_EXTRA_PNG_BYTES = 8 * 2**20  # other pictures larger than this are listed, not embedded
X_KEYS = ("tokens", "area", "pixels", "positions", "size", "x")
Y_KEYS = ("seconds", "time_s", "time", "ms", "flops", "y")

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1200px;color:#222;padding:0 16px}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:28px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;
vertical-align:top}th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
img{max-width:100%;border:1px solid #ccc}.cols{display:flex;flex-wrap:wrap;gap:32px}.col{flex:1 1 420px}
.controls label{display:inline-block;margin:4px 12px 4px 0}.controls input{width:7em}
#ci-y{font-weight:bold;font-size:18px}.right{color:#1a7f37}.off{color:#b42318}
.buttons button{margin-right:6px;padding:4px 14px}.caveat{background:#fff8e1;padding:8px 12px;
border-left:4px solid #f0b400}.none{color:#777;font-style:italic}svg text{font-size:11px;fill:#333}
svg .grid{stroke:#eee}svg .axis{stroke:#999}svg .ttl{font-size:13px}#ci-trace{max-height:8em;overflow:auto}
"""


def _read_json(path: Path) -> Any:
    """Parse a JSON file; a malformed one raises ValueError naming the file."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _cell(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return f"<td>{escape(str(v))}</td>"
    if isinstance(v, (int, float)):
        return f'<td class="num">{escape(fmt(v) if isinstance(v, float) else str(v))}</td>'
    if isinstance(v, (dict, list)):
        return f"<td>{render_value(v)}</td>"
    return f"<td>{escape(str(v))}</td>"


def _records_table(rows: list[dict]) -> str:
    """A list of dicts as one table, columns = union of keys in first-seen order."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(_cell(r.get(c, "")) for c in cols) + "</tr>" for r in rows[:MAX_ROWS])
    more = (f'<p class="none">{len(rows) - MAX_ROWS} more rows not shown (of {len(rows)})</p>'
            if len(rows) > MAX_ROWS else "")
    return f"<table><tr>{head}</tr>{body}</table>{more}"


def render_value(v: Any) -> str:
    """Render JSON data as HTML: dicts as key/value tables, lists of dicts as tables, lists inline."""
    if isinstance(v, dict):
        rows = "".join(f"<tr><th>{escape(str(k))}</th>{_cell(x)}</tr>" for k, x in v.items())
        return f"<table>{rows}</table>"
    if isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
        return _records_table(v)
    if isinstance(v, list):
        shown = ", ".join(escape(fmt(x) if isinstance(x, float) else str(x)) for x in v[:MAX_ROWS])
        return shown + (f" … ({len(v)} items)" if len(v) > MAX_ROWS else "")
    return escape(str(v))


def data_uri(path: Path) -> str:
    """A PNG file as a base64 data URI."""
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _pick(d: dict, keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if isinstance(d.get(k), (int, float)) and not isinstance(d.get(k), bool)),
                None)


def cost_series(costs: Any) -> tuple[dict[str, list[tuple[float, float]]], str, str]:
    """Measured points from costs.json: a list of {tokens, seconds[, label]} (or {"points": [...]}).

    Returns ({label: [(x, y), ...]}, x_key, y_key); the x and y keys are the first of X_KEYS / Y_KEYS
    present in the first point.
    """
    points = costs.get("points", costs.get("measurements")) if isinstance(costs, dict) else costs
    if not isinstance(points, list) or not points or not all(isinstance(p, dict) for p in points):
        raise ValueError(f"costs.json must be a non-empty list of objects like {{'tokens': 4096, "
                         f"'seconds': 0.8}} (or {{'points': [...]}}), got {str(costs)[:200]}")
    xk, yk = _pick(points[0], X_KEYS), _pick(points[0], Y_KEYS)
    if xk is None or yk is None:
        raise ValueError(f"costs.json points need a numeric size key (one of {X_KEYS}) and a numeric "
                         f"cost key (one of {Y_KEYS}); first point is {points[0]}")
    series: dict[str, list[tuple[float, float]]] = {}
    for p in points:
        if _pick(p, (xk,)) is None or _pick(p, (yk,)) is None:
            raise ValueError(f"costs.json point {p} lacks numeric {xk!r} or {yk!r}")
        series.setdefault(str(p.get("label", "measured")), []).append((float(p[xk]), float(p[yk])))
    return series, xk, yk


def measured_plot(costs: Any) -> str:
    """SVG of measured cost vs size, with dashed ∝size and ∝size² references through the smallest point."""
    series, xk, yk = cost_series(costs)
    first = min(min(s) for s in series.values())
    x_ref, y_ref = first
    xs = sorted({x for s in series.values() for x, _ in s})
    plot = dict(series)
    if x_ref > 0 and len(xs) > 1:
        plot[f"∝ {xk} (reference)"] = [(x, y_ref * x / x_ref) for x in xs]
        plot[f"∝ {xk}² (reference)"] = [(x, y_ref * (x / x_ref) ** 2) for x in xs]
    dashed = frozenset(k for k in plot if k.endswith("(reference)"))
    log = all(x > 0 and y > 0 for s in plot.values() for x, y in s)
    svg = line_plot(plot, xk, yk, dashed=dashed, log=log,
                    title=f"measured {yk} vs {xk}" + (" (log-log)" if log else ""))
    note = ('<p>Dashed lines are references scaled through the smallest measured point, not fits: '
            "a linear and a quadratic term in the size"
            + (" (slopes 1 and 2 on these log-log axes)" if log else "") + ".</p>")
    return f'<div id="measured-cost">{svg}{note}{render_value(costs)}</div>'


def _section(title: str, body: str, sid: str) -> str:
    return f'<section id="{sid}"><h2>{escape(title)}</h2>{body}</section>'


def _picture(path: Path, alt: str, sid: str) -> str:
    return f'<img id="{sid}" alt="{escape(alt)}" src="{data_uri(path)}">'


def build_html(run_dir: Path) -> str:
    """The report page for a run directory, as a string."""
    parts = []
    known = {"plan.json", "tiles.png", "heatmap.png", "errors.json", "costs.json", "run.json"}
    if (run_dir / "run.json").is_file():
        parts.append(_section("Run", render_value(_read_json(run_dir / "run.json")), "run"))
    if (run_dir / "plan.json").is_file():
        parts.append(_section("Plan: tiles, halos, memory per stage",
                              render_value(_read_json(run_dir / "plan.json")), "plan"))
    if (run_dir / "tiles.png").is_file():
        parts.append(_section("Tile layout", _picture(run_dir / "tiles.png", "tile layout", "tiles-img"),
                              "tiles"))
    err = []
    if (run_dir / "errors.json").is_file():
        err.append(render_value(_read_json(run_dir / "errors.json")))
    if (run_dir / "heatmap.png").is_file():
        err.append(_picture(run_dir / "heatmap.png", "error heatmap", "heatmap-img"))
    if err:
        parts.append(_section("Tiled vs untiled: errors", "".join(err), "errors"))
    costs_path = run_dir / "costs.json"
    measured = measured_plot(_read_json(costs_path)) if costs_path.is_file() else None
    extra = sorted(p for p in run_dir.glob("*.png") if p.name not in known)
    if extra:
        items = []
        for p in extra:
            size = p.stat().st_size
            if size > MAX_EXTRA_PNG_BYTES:
                items.append(f'<p class="none">{escape(p.name)}: {size} bytes, too large to embed '
                             f"(limit {MAX_EXTRA_PNG_BYTES})</p>")
            else:
                items.append(f"<figure>{_picture(p, p.name, 'img-' + p.stem)}"
                             f"<figcaption>{escape(p.name)}</figcaption></figure>")
        parts.append(_section("Pictures", "".join(items), "pictures"))
    parts.append(instrument_html(measured))  # the measured curve sits beside the instrument
    title = f"tilewise report: {run_dir.resolve().name}"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
            f"<h1>{escape(title)}</h1>{''.join(parts)}</body></html>\n")


def build_report(run_dir: str | os.PathLike, out_html: str | os.PathLike | None = None) -> Path:
    """Write the self-contained report of `run_dir` to `out_html` (default RUN_DIR/report.html)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run_dir must be an existing directory, got {str(run_dir)!r}")
    out = Path(out_html) if out_html is not None else run_dir / "report.html"
    html = build_html(run_dir)
    with atomic_path(out) as tmp:
        Path(tmp).write_text(html, encoding="utf-8")
    logger.info("wrote report %s (%d bytes)", out, len(html))
    return out
