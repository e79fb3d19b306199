"""build_report without a browser: sections, embedded pictures, self-containment, cost parsing, errors."""

from __future__ import annotations

import base64
import json
import re

import pytest

from tilewise.report import CAVEAT, STEP_INCREMENT, build_html, build_report, cost_series
from tilewise.report.builder import MAX_ROWS
from tilewise.report.svg import decade_ticks, line_plot, nice_ticks

PLAN = {
    "tile_size": 64, "overlap": 8, "halo": 11,
    "tiles": [{"index": i, "window": [0, 64, 56 * i, 56 * i + 64], "read": [0, 64, 56 * i, 56 * i + 75]}
              for i in range(3)],
    "stages": [{"stage": "decoder.up.0", "bytes": 1234567}, {"stage": "output", "bytes": 98304}],
}
COSTS = [{"tokens": t, "seconds": 2e-6 * t + 3e-11 * t * t} for t in (1024, 4096, 16384)]


def _png(path, color, size=(12, 8)):
    from PIL import Image

    Image.new("RGB", size, color).save(path)
    return path.read_bytes()


@pytest.fixture
def full_run(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    (tmp_path / "costs.json").write_text(json.dumps(COSTS))
    (tmp_path / "errors.json").write_text(json.dumps({"max_abs_error": 3.5e-7, "psnr_db": 91.25}))
    pngs = {name: _png(tmp_path / name, c) for name, c in
            [("tiles.png", (255, 0, 0)), ("heatmap.png", (0, 0, 255)), ("output.png", (0, 255, 0))]}
    return tmp_path, pngs


def _data_uri_bytes(html: str, element_id: str) -> bytes:
    m = re.search(rf'<img id="{element_id}" alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert m, f"no embedded picture #{element_id}"
    return base64.b64decode(m.group(1))


def test_full_run_has_every_section_and_embeds_pictures_bytewise(full_run):
    run, pngs = full_run
    out = build_report(run)
    assert out == run / "report.html"
    assert not list(run.glob(".*.tmp"))
    html = out.read_text(encoding="utf-8")
    for sid in ("plan", "tiles", "errors", "pictures", "cost-instrument", "measured-cost"):
        assert f'id="{sid}"' in html, sid
    assert _data_uri_bytes(html, "tiles-img") == pngs["tiles.png"]
    assert _data_uri_bytes(html, "heatmap-img") == pngs["heatmap.png"]
    assert _data_uri_bytes(html, "img-output") == pngs["output.png"]
    # the plan table shows every tile's read box and the per-stage bytes
    for t in PLAN["tiles"]:
        assert ", ".join(map(str, t["read"])) in html
    assert "decoder.up.0" in html and ">1234567<" in html
    assert ">3.5e-07<" in html and ">91.25<" in html
    assert "no measurement in this run" not in html


def test_page_is_self_contained(full_run):
    html = build_html(full_run[0])
    assert "http://" not in html and "https://" not in html and "//" not in re.sub(r"<script>.*?</script>",
                                                                                 "", html, flags=re.S)
    assert "<link" not in html and "@import" not in html
    srcs = re.findall(r'\bsrc="([^"]*)"', html)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "<script src" not in html


def test_instrument_always_present_with_caveat_and_initial_state(tmp_path):
    html = build_report(tmp_path, tmp_path / "r.html").read_text(encoding="utf-8")
    assert 'id="ci-no-measurement"' in html and "no measurement in this run" in html
    assert CAVEAT in html
    for words in ("no image grid", "convolution", "attention kernel", "bucket padding", "tiling algorithm",
                  "cannot", "illustrative analogy"):
        assert words in CAVEAT
    for eid in ("ci-a", "ci-x", "ci-predict", "ci-y", "ci-reset", "ci-step", "ci-play"):
        assert f'id="{eid}"' in html
    assert re.search(r'<output id="ci-y">1</output>', html)
    assert f'<span id="ci-increment">{STEP_INCREMENT:g}</span>' in html
    assert 'id="ci-a" type="number" step="any" value="1"' in html
    assert 'id="ci-x" type="number" step="any" value="1"' in html
    assert "INC = 0.1" in html and "A0 = 1" in html and "X0 = 1" in html


def test_measured_plot_has_one_marker_per_point_and_references(full_run):
    html = build_html(full_run[0])
    section = html[html.index('id="measured-cost"'):]
    markers = re.findall(r"<title>measured: ([^<]*)</title>", section)
    assert len(markers) == len(COSTS)
    assert "(reference)" in section and "log-log" in section


def test_cost_series_forms_and_labels():
    series, xk, yk = cost_series({"points": [{"tokens": 1, "seconds": 2.0, "label": "a"},
                                             {"tokens": 4, "seconds": 5.0, "label": "b"},
                                             {"tokens": 2, "seconds": 3.0, "label": "a"}]})
    assert (xk, yk) == ("tokens", "seconds")
    assert series == {"a": [(1.0, 2.0), (2.0, 3.0)], "b": [(4.0, 5.0)]}
    series, xk, yk = cost_series([{"area": 10, "ms": 1}])
    assert (xk, yk, series) == ("area", "ms", {"measured": [(10.0, 1.0)]})


@pytest.mark.parametrize("bad", [[], {"points": "x"}, [{"tokens": 1}], [{"foo": 1, "seconds": 1}],
                                 [{"tokens": 1, "seconds": 1}, {"tokens": "2", "seconds": 1}]])
def test_bad_costs_raise_value_error(tmp_path, bad):
    (tmp_path / "costs.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="costs.json"):
        build_report(tmp_path)
    assert not (tmp_path / "report.html").exists()


def test_malformed_json_and_missing_dir_raise(tmp_path):
    (tmp_path / "plan.json").write_text("{not json")
    with pytest.raises(ValueError, match="plan.json is not valid JSON"):
        build_report(tmp_path)
    with pytest.raises(ValueError, match="existing directory"):
        build_report(tmp_path / "nope")


def test_long_tables_are_truncated_with_a_count(tmp_path):
    n = MAX_ROWS + 7
    (tmp_path / "plan.json").write_text(json.dumps({"tiles": [{"index": i} for i in range(n)]}))
    html = build_html(tmp_path)
    assert f"7 more rows not shown (of {n})" in html
    assert f">{MAX_ROWS - 1}<" in html and f">{MAX_ROWS}<" not in html


def test_values_are_html_escaped(tmp_path):
    (tmp_path / "errors.json").write_text(json.dumps({"<script>": "a&b"}))
    html = build_html(tmp_path)
    assert "&lt;script&gt;" in html and "a&amp;b" in html


@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 2.25), (0.3, 97.0), (-5, 5), (1e-6, 3e-6), (0, 65536)])
def test_nice_ticks_cover_the_range_with_round_steps(lo, hi):
    t = nice_ticks(lo, hi)
    assert t[0] <= lo and t[-1] >= hi and 2 <= len(t) <= 12
    steps = {round(b - a, 9) for a, b in zip(t, t[1:])}
    assert len(steps) == 1
    step = steps.pop()
    mantissa = step / 10 ** __import__("math").floor(__import__("math").log10(step))
    assert round(mantissa, 6) in (1, 2, 5, 10)


def test_decade_ticks_and_log_plot_validation():
    assert decade_ticks(2.9, 4.2) == [2.0, 3.0, 4.0, 5.0]
    assert decade_ticks(3.0, 3.0) == [3.0, 4.0]
    with pytest.raises(ValueError, match="positive"):
        line_plot({"s": [(0.0, 1.0)]}, "x", "y", log=True)
    with pytest.raises(ValueError, match="at least one point"):
        line_plot({"s": []}, "x", "y")


def test_import_is_light():
    import subprocess
    import sys

    heavy = "('torch', 'diffusers', 'matplotlib')"
    code = f"import sys, tilewise.report; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
