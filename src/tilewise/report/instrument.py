"""The cost instrument of seed 000: y = a*x^2 with inputs a and x, a prediction, Reset / Step / Play.

Shown beside the measured cost curve of the real model, with the seed's caveat: the toy function has
no image grid, convolution, attention kernel, bucket padding or tiling algorithm, so it cannot decide a
real model's cost scaling or whether tiling preserves its output.
"""

from __future__ import annotations

INITIAL_A = 1.0
INITIAL_X = 1.0
STEP_INCREMENT = 0.1  # Step adds this to x
PLAY_LIMIT = 3.0  # Play stops before x would pass this
PLAY_PERIOD_MS = 400  # one Step per period while playing

CAVEAT = (
    "This is a toy function, not a model of tilewise. y = a·x² contains no image grid, no local "
    "convolution, no attention kernel, no bucket padding and no tiling algorithm. It therefore cannot "
    "decide whether a real model's cost grows like this, nor whether a real model's output stays the same "
    "when it is tiled. Reading x as a normalized size ratio (requested size / reference size) is only an "
    "illustrative analogy to a quadratic cost term, such as global attention over all spatial tokens. "
    "Real models mix several terms (local operations that grow roughly with the token count, attention "
    "that can grow with its square, kernel thresholds), so only measuring the real model, as in the plot "
    "beside this, says how its cost scales."
)

_JS = """
(function () {
  const A0 = %(a0)s, X0 = %(x0)s, INC = %(inc)s, LIMIT = %(limit)s, PERIOD = %(period)s;
  const $ = (id) => document.getElementById(id);
  const a = $("ci-a"), x = $("ci-x"), p = $("ci-predict"), y = $("ci-y"), verdict = $("ci-verdict");
  const play = $("ci-play"), status = $("ci-status"), ratio = $("ci-ratio"), trace = $("ci-trace");
  let timer = null;
  const clean = (n) => Number(n.toFixed(10));            // drop float noise: 1.1*1.1 -> 1.21
  const show = (n) => String(Number(n.toPrecision(12)));
  function num(el) { const s = el.value.trim(); return s === "" ? NaN : Number(s); }
  function compute() {
    const av = num(a), xv = num(x);
    if (!Number.isFinite(av) || !Number.isFinite(xv)) {
      y.textContent = "\\u2014"; verdict.textContent = "a and x must be numbers"; verdict.className = "off";
      ratio.textContent = ""; return null;
    }
    const yv = clean(av * xv * xv);
    y.textContent = show(yv);
    const y0 = clean(av * X0 * X0);
    ratio.textContent = "relative to x = " + show(X0) + ": x \\u00d7" + show(clean(xv / X0)) +
      (y0 !== 0 ? " gives y \\u00d7" + show(clean(yv / y0)) : "");
    judge(yv); draw(av, xv, yv); return yv;
  }
  function judge(yv) {
    const pv = num(p);
    if (p.value.trim() === "") {
      verdict.textContent = "enter a prediction of y"; verdict.className = ""; return;
    }
    if (!Number.isFinite(pv)) {
      verdict.textContent = "the prediction must be a number"; verdict.className = "off"; return;
    }
    const d = clean(yv - pv);
    if (Math.abs(d) <= 1e-9 * Math.max(1, Math.abs(yv))) {
      verdict.textContent = "right: you predicted " + show(pv); verdict.className = "right";
    } else {
      verdict.textContent = "off by " + (d > 0 ? "+" : "") + show(d) + " (you predicted " + show(pv) +
        ", y = " + show(yv) + ")";
      verdict.className = "off";
    }
  }
  function draw(av, xv, yv) {
    const W = 300, H = 180, m = 28, xmax = Math.max(LIMIT, Math.abs(xv));
    const ymax = Math.max(Math.abs(av) * xmax * xmax, 1e-12), pts = [];
    const sx = (t) => m + t / xmax * (W - 2 * m);
    const sy = (t) => H - m - t / ymax * (H - 2 * m) * (av < 0 ? -1 : 1);
    for (let i = 0; i <= 60; i++) {
      const t = xmax * i / 60;
      pts.push(sx(t).toFixed(1) + "," + sy(av * t * t).toFixed(1));
    }
    $("ci-curve-line").setAttribute("points", pts.join(" "));
    const dot = $("ci-curve-dot");
    dot.setAttribute("cx", sx(Math.abs(xv)).toFixed(1)); dot.setAttribute("cy", sy(yv).toFixed(1));
  }
  function log(xv, yv) {
    const li = document.createElement("li"); li.textContent = "x = " + show(xv) + ", y = " + show(yv);
    trace.appendChild(li);
  }
  function step() {
    const xv = num(x);
    if (!Number.isFinite(xv)) { compute(); return false; }
    x.value = show(clean(xv + INC));
    const yv = compute(); if (yv !== null) log(num(x), yv);
    return true;
  }
  function pause() {
    if (timer !== null) { clearInterval(timer); timer = null; }
    play.textContent = "Play"; status.textContent = "paused";
  }
  function tick() {
    const xv = num(x);
    if (!Number.isFinite(xv) || clean(xv + INC) > LIMIT) {
      pause(); status.textContent = "stopped at the limit x = " + show(LIMIT); return;
    }
    step();
  }
  function start() {
    const xv = num(x);
    if (!Number.isFinite(xv) || clean(xv + INC) > LIMIT) {
      status.textContent = "x is at the limit " + show(LIMIT) + ": Reset or lower x"; return;
    }
    play.textContent = "Pause"; status.textContent = "playing"; timer = setInterval(tick, PERIOD);
  }
  function reset() {
    pause(); a.value = show(A0); x.value = show(X0); p.value = ""; trace.textContent = "";
    status.textContent = "reset"; compute();
  }
  $("ci-reset").addEventListener("click", reset);
  $("ci-step").addEventListener("click", () => { pause(); step(); });
  play.addEventListener("click", () => (timer === null ? start() : pause()));
  for (const el of [a, x, p]) el.addEventListener("input", compute);
  compute();
})();
"""


def _n(v: float) -> str:
    return format(v, "g")


def instrument_js() -> str:
    """The instrument's inline script, with its constants filled in."""
    return _JS % {"a0": _n(INITIAL_A), "x0": _n(INITIAL_X), "inc": _n(STEP_INCREMENT),
                  "limit": _n(PLAY_LIMIT), "period": PLAY_PERIOD_MS}


def instrument_html(measured: str | None) -> str:
    """The instrument section: controls and toy curve, the caveat, and the measured curve (or a note)."""
    y0 = _n(INITIAL_A * INITIAL_X**2)
    measured_block = measured if measured else (
        '<p class="none" id="ci-no-measurement">no measurement in this run (costs.json is absent): '
        "the real model's cost curve is not known here</p>")
    return f"""
<section id="cost-instrument">
<h2>Cost instrument: y = a·x²</h2>
<div class="cols">
<div class="col">
<p class="how">Reset, set a = 1 and x = 1, predict y = 1, then Step or Play. Separately Reset, set a = 1 and
x = 1.5, predict y = 2.25, then Step or Play.
<b>Step</b> adds <span id="ci-increment">{_n(STEP_INCREMENT)}</span> to x;
<b>Play</b> steps every {PLAY_PERIOD_MS / 1000:g} s until x would pass
<span id="ci-limit">{_n(PLAY_LIMIT)}</span> or you press Pause; <b>Reset</b> restores a = {_n(INITIAL_A)},
x = {_n(INITIAL_X)} and clears the prediction.</p>
<div class="controls">
<label>a <input id="ci-a" type="number" step="any" value="{_n(INITIAL_A)}"></label>
<label>x <input id="ci-x" type="number" step="any" value="{_n(INITIAL_X)}"></label>
<label>your prediction of y <input id="ci-predict" type="number" step="any" placeholder="predict y"></label>
</div>
<p class="result">y = a·x² = <output id="ci-y">{y0}</output> <span id="ci-verdict"></span></p>
<p class="ratio" id="ci-ratio"></p>
<div class="buttons"><button id="ci-reset" type="button">Reset</button>
<button id="ci-step" type="button">Step</button>
<button id="ci-play" type="button">Play</button> <span id="ci-status"></span></div>
<svg id="ci-curve" width="300" height="180" viewBox="0 0 300 180" role="img" aria-label="y = a x squared">
<line x1="28" y1="152" x2="272" y2="152" class="axis"/><line x1="28" y1="28" x2="28" y2="152" class="axis"/>
<polyline id="ci-curve-line" points="" fill="none" stroke="#1f77b4" stroke-width="2"/>
<circle id="ci-curve-dot" r="4" fill="#d62728"/></svg>
<ol id="ci-trace"></ol>
</div>
<div class="col">
<h3>Measured cost of the real model</h3>
{measured_block}
<p class="caveat" id="ci-caveat"><b>Caveat.</b> {CAVEAT}</p>
</div>
</div>
<script>{instrument_js()}</script>
</section>
"""
