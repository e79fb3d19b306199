"""Measured bucket cost: a per-shape profiler, least-squares cost fits and plot, and bucket-set choice.

Seed 000: local operations scale roughly with token count, global attention quadratically, and real
models mix terms and kernel thresholds; so buckets are chosen by time measured at the real guidance and
precision, and the report keeps the logical work (padded positions) beside it.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import atomic_path
from .assign import Size, aspect_error
from .planner import BucketPlanner, _check_size, _positive_int

logger = logging.getLogger(__name__)


# ---- profiling ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class BucketTiming:
    """Wall-clock times of one call of `fn` at one bucket's input shape."""

    bucket: Size
    shape: tuple[int, ...]  # the input passed to fn: (N, C, H/f, W/f), N = batch_size * (2 if CFG)
    batch_size: int  # requests per call (before CFG doubling)
    times: tuple[float, ...]  # seconds, one per repeat, after warm-up

    @property
    def tokens(self) -> int:
        """Latent positions per request (H/f * W/f): the logical work of one item."""
        return self.shape[-2] * self.shape[-1]

    @property
    def median(self) -> float:
        """Median seconds per call."""
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        """Max - min seconds per call over the repeats."""
        return max(self.times) - min(self.times)

    @property
    def minimum(self) -> float:
        """Fastest call, seconds (the least disturbed estimate on a shared, noisy machine)."""
        return min(self.times)

    @property
    def per_request(self) -> float:
        """Median seconds per request (per call / batch_size)."""
        return self.median / self.batch_size


@dataclass
class BucketProfile:
    """Per-bucket measured cost beside logical work; fits of cost vs tokens; a PNG plot."""

    timings: list[BucketTiming]
    guidance: float
    dtype: str
    device: str

    def costs(self, statistic: str = "median") -> dict[Size, float]:
        """bucket -> seconds per request, by the median (default) or the minimum over repeats.

        This is the input choose_buckets and BucketPlanner(costs=) take.
        """
        return {
            t.bucket: c / t.batch_size for t, c in zip(self.timings, self._per_call(statistic), strict=True)
        }

    def fit(self, degree: int, statistic: str = "median") -> tuple[list[float], float]:
        """Least-squares polynomial fit of seconds per call (median or min) vs tokens: (c0.., RMS)."""
        return _polyfit([t.tokens for t in self.timings], self._per_call(statistic), degree)

    def _per_call(self, statistic: str) -> list[float]:
        """Seconds per call of each timing by the median or the minimum over repeats."""
        if statistic not in ("median", "min"):
            raise ValueError(f"statistic must be 'median' or 'min', got {statistic!r}")
        return [t.median if statistic == "median" else t.minimum for t in self.timings]

    def table(self) -> str:
        """Markdown table: bucket, tokens, input shape, median and spread (ms), ms per request."""
        rows = [
            "| bucket (w x h) | tokens | input shape | median ms/call | spread ms | ms/request |",
            "|---|---:|---|---:|---:|---:|",
        ]
        for t in sorted(self.timings, key=lambda t: (t.tokens, t.bucket)):
            rows.append(
                f"| {t.bucket[0]}x{t.bucket[1]} | {t.tokens} | {tuple(t.shape)} | {t.median * 1e3:.2f} "
                f"| {t.spread * 1e3:.2f} | {t.per_request * 1e3:.2f} |"
            )
        return "\n".join(rows)

    def plot(self, path: str | os.PathLike, statistic: str = "median") -> Path:
        """Write a PNG of measured cost vs token count with linear and quadratic least-squares fits."""
        return plot_costs(self, path, statistic)


def _polyfit(x: Sequence[float], y: Sequence[float], degree: int) -> tuple[list[float], float]:
    """Ordinary least squares y ~ sum_i c_i x^i (numpy lstsq); returns coefficients and RMS residual."""
    import numpy as np

    if len(x) < degree + 1:
        raise ValueError(f"a degree-{degree} fit needs at least {degree + 1} buckets, got {len(x)}")
    X = np.vander(np.asarray(x, dtype=np.float64), degree + 1, increasing=True)
    c, *_ = np.linalg.lstsq(X, np.asarray(y, dtype=np.float64), rcond=None)
    rms = float(np.sqrt(np.mean((X @ c - np.asarray(y)) ** 2)))
    return [float(v) for v in c], rms


def plot_costs(profile: BucketProfile, path: str | os.PathLike, statistic: str = "median") -> Path:
    """Scatter of median cost (with min-max bars) vs tokens, plus linear and quadratic fits, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    x = np.array([t.tokens for t in profile.timings], dtype=float)
    y = np.array(profile._per_call(statistic)) * 1e3
    lo = y - np.array([min(t.times) for t in profile.timings]) * 1e3
    hi = np.array([max(t.times) for t in profile.timings]) * 1e3 - y
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.errorbar(x, y, yerr=[lo, hi], fmt="o", ms=4, label=f"measured ({statistic}, bars min-max)")
    xs = np.linspace(0, x.max() * 1.05, 200)
    for degree, style in ((1, "--"), (2, "-")):
        c, rms = profile.fit(degree, statistic)
        ax.plot(
            xs, np.polyval(c[::-1], xs) * 1e3, style, label=f"degree {degree} fit (RMS {rms * 1e3:.2f} ms)"
        )
    ax.set_xlabel("latent tokens per request (H/f x W/f)")
    ax.set_ylabel(f"ms per call (N={profile.timings[0].shape[0]} incl. CFG)")
    ax.set_title(f"bucket cost, guidance={profile.guidance}, {profile.dtype}, {profile.device}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
    finally:
        plt.close(fig)
    return path


def _synchronize(device: Any) -> None:
    """Wait for queued device work so wall-clock timing measures it."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def profile_buckets(
    fn: Callable[[Any], Any],
    buckets: Iterable[Size] | BucketPlanner,
    *,
    batch_size: int = 1,
    guidance: float = 1.0,
    dtype: Any = "float32",
    device: Any = "cpu",
    repeats: int = 5,
    warmup: int = 1,
    latent_factor: int = 8,
    channels: int = 4,
    seed: int = 0,
    order: str = "blocked",
    disable: bool | None = None,
) -> BucketProfile:
    """Time fn(latents) at each bucket's shape after warm-up; CFG (guidance > 1) doubles the batch.

    ``fn`` gets one tensor (N, channels, H/f, W/f) of seeded normal noise and runs one model step,
    e.g. ``lambda x: unet(x, t, encoder_hidden_states=emb.expand(len(x), -1, -1))``. Runs under
    ``torch.inference_mode()``; device work is synchronized before each clock read. ``order``:
    "blocked" (default) times all repeats of one shape in a row, as batch_by_bucket runs them;
    "interleaved" times every shape once per round, which spreads drift and other jobs' load over all
    buckets but, with many shapes, measures colder per-shape state (on CPU with 53 shapes of the
    benchmark UNet we saw 6-22% higher minima).
    """
    import torch
    from tqdm.auto import tqdm

    if isinstance(buckets, BucketPlanner):
        latent_factor, buckets = buckets.latent_factor, buckets.buckets
    buckets = [_check_size("bucket", b) for b in buckets]
    bad = [b for b in buckets if b[0] % latent_factor or b[1] % latent_factor]
    if not buckets or bad:
        raise ValueError(
            f"need buckets with sides divisible by latent_factor={latent_factor}; bad: {bad or buckets}"
        )
    batch_size, repeats = _positive_int("batch_size", batch_size), _positive_int("repeats", repeats)
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup!r}")
    if order not in ("interleaved", "blocked"):
        raise ValueError(f"order must be 'interleaved' or 'blocked', got {order!r}")
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    dev = torch.device(device)
    n = batch_size * (2 if guidance > 1 else 1)
    gen = torch.Generator().manual_seed(seed)
    shapes = [(n, channels, b[1] // latent_factor, b[0] // latent_factor) for b in buckets]
    times: list[list[float]] = [[] for _ in buckets]
    # interleaved: repeat r times every shape before repeat r + 1, so slow drift or other jobs' load
    # spreads over all buckets alike; blocked: all repeats of one shape back to back
    rounds = (
        [list(range(len(buckets)))] * repeats
        if order == "interleaved"
        else [[i] * repeats for i in range(len(buckets))]
    )
    with torch.inference_mode():
        xs = [torch.randn(shape, generator=gen).to(device=dev, dtype=dt) for shape in shapes]
        for x in tqdm(xs, desc="warm up buckets", disable=disable):
            for _ in range(warmup):
                fn(x)
        for row in tqdm(rounds, desc="profile buckets", disable=disable):
            for i in row:
                times[i].append(_time_call(fn, xs[i], dev))
    timings = [
        BucketTiming(b, s, batch_size, tuple(t)) for b, s, t in zip(buckets, shapes, times, strict=True)
    ]
    return BucketProfile(timings, float(guidance), str(dt).removeprefix("torch."), str(dev))


def _time_call(fn: Callable[[Any], Any], x: Any, device: Any) -> float:
    """Seconds for one fn(x), bracketed by device synchronizations."""
    _synchronize(device)
    t0 = time.perf_counter()
    fn(x)
    _synchronize(device)
    return time.perf_counter() - t0


# ---- choice -------------------------------------------------------------------------------------
@dataclass
class BucketChoice:
    """The chosen bucket set, each request's bucket, and logical work beside measured cost."""

    buckets: list[Size]
    total_cost: float
    exact: bool
    method: str
    policy: str
    assignment: dict[Size, Size]  # request (w, h) -> bucket (w, h)
    counts: dict[Size, int]  # request (w, h) -> how many times it occurs
    costs: dict[Size, float] = field(repr=False)
    latent_factor: int = 8
    batch_size: int = 1  # short batches are charged as full ones

    def rows(self) -> list[dict[str, Any]]:
        """Per chosen bucket: requests, tokens, padded tokens, padding fraction, cost per request, total."""
        f2 = self.latent_factor**2
        out = []
        for b in self.buckets:
            reqs = [(r, c) for r, c in self.counts.items() if self.assignment[r] == b]
            n = sum(c for _, c in reqs)
            tokens = n * b[0] * b[1] / f2
            content = sum(c * min(r[0], b[0]) * min(r[1], b[1]) for r, c in reqs) / f2
            out.append(
                {
                    "bucket": b,
                    "requests": n,
                    "tokens": tokens,
                    "padded_tokens": tokens - content,
                    "padding_fraction": (tokens - content) / tokens if tokens else 0.0,
                    "cost_per_request": self.costs[b],
                    "batches": math.ceil(n / self.batch_size),
                    "total_cost": math.ceil(n / self.batch_size) * self.batch_size * self.costs[b],
                }
            )
        return out

    @property
    def padding_fraction(self) -> float:
        """Padded tokens / processed tokens over all requests."""
        rows = self.rows()
        tokens = sum(r["tokens"] for r in rows)
        return sum(r["padded_tokens"] for r in rows) / tokens if tokens else 0.0

    def table(self) -> str:
        """Markdown: logical work (tokens, padded tokens) beside measured cost, per bucket and in total."""
        lines = [
            "| bucket (w x h) | requests | batches | tokens | padded tokens | padding | ms/request "
            "| total ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in self.rows():
            b = r["bucket"]
            lines.append(
                f"| {b[0]}x{b[1]} | {r['requests']} | {r['batches']} | {r['tokens']:.0f} | "
                f"{r['padded_tokens']:.0f} | "
                f"{r['padding_fraction']:.1%} | {r['cost_per_request'] * 1e3:.2f} | "
                f"{r['total_cost'] * 1e3:.1f} |"
            )
        lines.append(
            f"| **total** | {sum(self.counts.values())} | {sum(r['batches'] for r in self.rows())} | | | "
            f"{self.padding_fraction:.1%} | | "
            f"{self.total_cost * 1e3:.1f} |"
        )
        return "\n".join(lines)

    def planner(self, **kwargs: Any) -> BucketPlanner:
        """A BucketPlanner over the chosen buckets and their measured costs (kwargs go to BucketPlanner)."""
        kwargs.setdefault("latent_factor", self.latent_factor)
        return BucketPlanner(buckets=self.buckets, costs={b: self.costs[b] for b in self.buckets}, **kwargs)


def feasible(
    request: Size, bucket: Size, policy: str, max_aspect_error: float, max_area_error: float
) -> bool:
    """Can `bucket` take `request` under `policy`? pad: covers it; resize: aspect and area within bounds."""
    if policy == "pad":
        return bucket[0] >= request[0] and bucket[1] >= request[1]
    area = abs(math.log(bucket[0] * bucket[1] / (request[0] * request[1])))
    return aspect_error(request, bucket) <= max_aspect_error and area <= math.log1p(max_area_error)


def choose_buckets(
    request_sizes: Sequence[Size] | Mapping[Size, int],
    costs: Mapping[Size, float] | BucketProfile,
    k: int,
    policy: str = "pad",
    *,
    max_aspect_error: float = 0.1,
    max_area_error: float = 0.25,
    method: str = "auto",
    max_combinations: int = 200_000,
    batch_size: int = 1,
    latent_factor: int = 8,
) -> BucketChoice:
    """Pick k of the costed buckets minimising sum over requests of the cheapest feasible bucket's cost.

    Objective (a k-median / facility-location problem): total = sum_r count_r * min_{b in S, feasible}
    cost_b, costs being seconds per request at full batches. With ``batch_size`` > 1 a bucket serving
    n requests is charged ceil(n / batch_size) full batches, so short batches are paid in full (requests
    still go to their cheapest feasible bucket).

    ``method="exhaustive"`` enumerates all C(n, k) sets (exact); ``"greedy"`` adds the bucket that
    lowers the total most, then applies single-swap local search until no swap improves (not guaranteed
    optimal; the result is 1-swap optimal); ``"auto"`` is exhaustive when C(n, k) <= max_combinations.
    Feasibility: ``pad`` needs the bucket to cover the request; ``resize`` needs aspect error <=
    max_aspect_error and |log(area ratio)| <= log(1 + max_area_error).
    """
    import numpy as np

    counts = _request_counts(request_sizes)
    costs = (
        costs.costs()
        if isinstance(costs, BucketProfile)
        else {_check_size("bucket", b): float(c) for b, c in costs.items()}
    )
    k = _positive_int("k", k)
    if policy not in ("pad", "resize"):
        raise ValueError(f"choose_buckets policy must be 'pad' or 'resize', got {policy!r}")
    if method not in ("auto", "exhaustive", "greedy"):
        raise ValueError(f"method must be 'auto', 'exhaustive' or 'greedy', got {method!r}")
    cands = sorted(costs)
    if k > len(cands):
        raise ValueError(f"k={k} exceeds the {len(cands)} costed candidate buckets")
    reqs = list(counts)
    M = np.array(
        [
            [costs[b] if feasible(r, b, policy, max_aspect_error, max_area_error) else np.inf for b in cands]
            for r in reqs
        ]
    )
    _check_coverage(reqs, M, policy)
    w = np.array([counts[r] for r in reqs], dtype=np.float64)
    c = np.array([costs[b] for b in cands])
    B = _positive_int("batch_size", batch_size)
    exhaustive = method == "exhaustive" or (method == "auto" and math.comb(len(cands), k) <= max_combinations)
    chosen = _exhaustive(M, c, w, k, B) if exhaustive else _greedy_swap(M, c, w, k, B)
    unserved, total = (float(v[0]) for v in _set_costs(M, c, w, np.array([chosen]), B))
    if unserved > 0:
        raise ValueError(f"no set of k={k} buckets serves every request under policy='{policy}'; raise k")
    sub = M[:, chosen]
    assignment = {r: cands[chosen[int(np.argmin(sub[i]))]] for i, r in enumerate(reqs)}
    picked = sorted(cands[j] for j in chosen)
    return BucketChoice(
        picked,
        float(total),
        exhaustive,
        "exhaustive" if exhaustive else "greedy+swap",
        policy,
        assignment,
        counts,
        costs,
        latent_factor,
        B,
    )


def _request_counts(request_sizes: Sequence[Size] | Mapping[Size, int]) -> dict[Size, int]:
    """Multiplicity of each (width, height) request."""
    if isinstance(request_sizes, Mapping):
        counts = {
            _check_size("request", r): _positive_int(f"count of {r}", c) for r, c in request_sizes.items()
        }
    else:
        counts = dict(Counter(_check_size("request", r) for r in request_sizes))
    if not counts:
        raise ValueError("request_sizes is empty")
    return counts


def _check_coverage(reqs: list[Size], M: Any, policy: str) -> None:
    """Raise ValueError naming requests that no candidate bucket can take."""
    import numpy as np

    orphans = [r for r, row in zip(reqs, M, strict=True) if not np.isfinite(row).any()]
    if orphans:
        raise ValueError(f"no candidate bucket can take requests {orphans[:10]} under policy='{policy}'")


def _set_costs(M: Any, c: Any, w: Any, block: Any, B: int) -> tuple[Any, Any]:
    """For each k-subset (rows of block): unserved weight, and sum_b ceil(n_b / B) * B * c_b.

    Each request goes to its cheapest feasible bucket in the subset (first on ties); n_b counts them.
    With B = 1 this is sum_r w_r * min_{b in S} M[r, b]; with B > 1 short batches are paid in full.
    """
    import numpy as np

    sub = M[:, block]  # (requests, subsets, k)
    m = sub.min(axis=2)
    served = np.isfinite(m)
    unserved = ((~served) * w[:, None]).sum(axis=0)
    onehot = (sub.argmin(axis=2)[..., None] == np.arange(block.shape[1])) & served[..., None]
    n = (onehot * w[:, None, None]).sum(axis=0)  # (subsets, k): requests per chosen bucket
    return unserved, (np.ceil(n / B) * B * c[block]).sum(axis=1)


def _exhaustive(M: Any, c: Any, w: Any, k: int, B: int) -> list[int]:
    """Exact: evaluate every k-subset of columns in vectorised chunks; first minimum in lexical order."""
    import itertools

    import numpy as np

    best, best_cost = None, math.inf
    chunk = max(1, 1_000_000 // (M.shape[0] * k))  # bounds the (requests, chunk, k) arrays to ~8 MB each
    combos = itertools.combinations(range(M.shape[1]), k)
    while True:
        block = np.array(list(itertools.islice(combos, chunk)), dtype=np.int64)
        if block.size == 0:
            break
        unserved, cost = _set_costs(M, c, w, block, B)
        tot = np.where(unserved > 0, np.inf, cost)
        i = int(np.argmin(tot))
        if tot[i] < best_cost:
            best, best_cost = block[i].tolist(), float(tot[i])
    return best if best is not None else list(range(k))


def _greedy_swap(M: Any, c: Any, w: Any, k: int, B: int) -> list[int]:
    """Greedy forward selection on (unserved weight, cost), then first-improvement single swaps."""
    import numpy as np

    def key(cols: list[int]) -> tuple[float, float]:
        unserved, cost = _set_costs(M, c, w, np.array([cols]), B)
        return float(unserved[0]), float(cost[0])

    chosen: list[int] = []
    for _ in range(k):
        rest = [j for j in range(M.shape[1]) if j not in chosen]
        chosen.append(min(rest, key=lambda j: key(chosen + [j])))
    improved = True
    while improved:
        improved = False
        current = key(chosen)
        for pos in range(k):
            for j in range(M.shape[1]):
                if j in chosen:
                    continue
                trial = chosen[:pos] + [j] + chosen[pos + 1 :]
                if key(trial) < current:
                    chosen, current, improved = trial, key(trial), True
    return sorted(chosen)
