"""Measured bucket cost: a per-shape profiler, least-squares fits of cost vs tokens, and their plot.

Seed 000: local operations scale roughly with token count, global attention quadratically, and real
models mix terms and kernel thresholds; so buckets are chosen by time measured at the real guidance and
precision (`choice.choose_buckets`), and the report keeps the logical work (padded positions) beside it.

torch (~2 s), numpy, tqdm and matplotlib (~0.5 s) are imported inside the functions that use them, so that
`import tilewise.buckets` imports none of them.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..atomic import atomic_path
from .assign import Size
from .planner import BucketPlanner, _check_size, _positive_int


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

    # 1. the buckets and options, checked
    if isinstance(buckets, BucketPlanner):
        latent_factor, buckets = buckets.latent_factor, buckets.buckets
    buckets = _checked_buckets(buckets, latent_factor)
    batch_size, repeats = _positive_int("batch_size", batch_size), _positive_int("repeats", repeats)
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup!r}")
    if order not in ("interleaved", "blocked"):
        raise ValueError(f"order must be 'interleaved' or 'blocked', got {order!r}")
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    dev = torch.device(device)
    # 2. one seeded latent batch per bucket, (N, channels, H/f, W/f), N doubled by CFG
    n = batch_size * (2 if guidance > 1 else 1)
    gen = torch.Generator().manual_seed(seed)
    shapes = [(n, channels, b[1] // latent_factor, b[0] // latent_factor) for b in buckets]
    # 3. warm-up calls, then the timed repeats
    with torch.inference_mode():
        xs = [torch.randn(shape, generator=gen).to(device=dev, dtype=dt) for shape in shapes]
        times = _timed_repeats(fn, xs, dev, warmup, repeats, order, disable)
    timings = [
        BucketTiming(b, s, batch_size, tuple(t)) for b, s, t in zip(buckets, shapes, times, strict=True)
    ]
    return BucketProfile(timings, float(guidance), str(dt).removeprefix("torch."), str(dev))


def _checked_buckets(buckets: Iterable[Size], latent_factor: int) -> list[Size]:
    """The buckets as (width, height) ints, refused unless there is one and every side divides by f."""
    buckets = [_check_size("bucket", b) for b in buckets]
    bad = [b for b in buckets if b[0] % latent_factor or b[1] % latent_factor]
    if not buckets or bad:
        raise ValueError(
            f"need buckets with sides divisible by latent_factor={latent_factor}; bad: {bad or buckets}"
        )
    return buckets


def _timed_repeats(fn: Callable[[Any], Any], xs: list[Any], device: Any, warmup: int, repeats: int,
                   order: str, disable: bool | None) -> list[list[float]]:
    """Seconds of each timed fn(x) per input, after `warmup` untimed calls on each."""
    from tqdm.auto import tqdm

    times: list[list[float]] = [[] for _ in xs]
    # interleaved: repeat r times every shape before repeat r + 1, so slow drift or other jobs' load
    # spreads over all buckets alike; blocked: all repeats of one shape back to back
    rounds = (
        [list(range(len(xs)))] * repeats
        if order == "interleaved"
        else [[i] * repeats for i in range(len(xs))]
    )
    for x in tqdm(xs, desc="warm up buckets", disable=disable):
        for _ in range(warmup):
            fn(x)
    for row in tqdm(rounds, desc="profile buckets", disable=disable):
        for i in row:
            times[i].append(_time_call(fn, xs[i], device))
    return times


def _time_call(fn: Callable[[Any], Any], x: Any, device: Any) -> float:
    """Seconds for one fn(x), bracketed by device synchronizations."""
    _synchronize(device)
    t0 = time.perf_counter()
    fn(x)
    _synchronize(device)
    return time.perf_counter() - t0
