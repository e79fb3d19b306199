"""Bucket sets under an area budget (or given explicitly) and the assignment of requests to them."""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .assign import Assignment, Size, aspect_error
from .imageops import RESAMPLE

logger = logging.getLogger(__name__)

POLICIES = ("pad", "resize", "crop", "auto")
FITS = ("cover", "inside")
MAX_WIDTHS = 100_000  # bucket widths a grid may try: more is a budget no bucket list is meant for


def _positive_int(name: str, value: Any) -> int:
    """Return value as int, or raise ValueError naming it when it is not a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _number(name: str, value: Any, low: float, high: float = math.inf, high_open: bool = False) -> float:
    """Return value as a float in [low, high] ([low, high) with high_open), or raise naming it."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or value > high or (high_open and value == high):
        top = ("inf" if high == math.inf else f"{high:g}") + (")" if high_open else "]")
        raise ValueError(f"{name} must be a number in [{low:g}, {top}, got {value!r}")
    return float(value)


def _check_size(name: str, size: Any) -> Size:
    """Validate a (width, height) pair of positive integers."""
    if not isinstance(size, Sequence) or len(size) != 2:
        raise ValueError(f"{name} must be a (width, height) pair, got {size!r}")
    return _positive_int(f"{name} width", size[0]), _positive_int(f"{name} height", size[1])


def grid_buckets(area: int, step: int, min_side: int, max_side: int, max_aspect: float) -> list[Size]:
    """Kohya-style grid: for each width w (multiple of step) the tallest h with w*h <= area, both ways."""
    out: set[Size] = set()
    for w in range(min_side, max_side + 1, step):
        h = min(max_side, (area // w) // step * step)
        if h >= min_side and max(w, h) / min(w, h) <= max_aspect:
            out.update({(w, h), (h, w)})
    return sorted(out, key=lambda b: (b[0] / b[1], b[0]))


class BucketPlanner:
    """A set of (width, height) buckets and explicit pad / resize / crop assignment into them.

    Either ``area`` (a pixel budget; the kohya-style grid of ``grid_buckets``) or ``buckets`` (an explicit
    list). Every side must be a multiple of ``step``, and ``step`` a multiple of ``latent_factor`` (the
    VAE's downsampling), so masks and latents line up. ``costs`` maps a bucket to its cost (for example
    measured seconds per request from ``profile_buckets``); without it the cost is the bucket's area.
    """

    def __init__(
        self,
        area: int | None = None,
        step: int = 64,
        min_side: int | None = None,
        max_side: int | None = None,
        max_aspect: float = 4.0,
        *,
        buckets: Iterable[Size] | None = None,
        latent_factor: int = 8,
        costs: Mapping[Size, float] | None = None,
        max_aspect_error: float = 0.25,
        max_pad_fraction: float = 0.25,
        resample: str = "bicubic",
        fill: float = 0,
    ):
        self.step = _positive_int("step", step)
        self.latent_factor = _positive_int("latent_factor", latent_factor)
        if self.step % self.latent_factor:
            raise ValueError(f"step={step} must be a multiple of latent_factor={latent_factor}")
        self.max_aspect = _number("max_aspect (width/height or height/width)", max_aspect, 1.0)
        self.max_aspect_error = _number("max_aspect_error", max_aspect_error, 0.0)
        self.max_pad_fraction = _number("max_pad_fraction (padded / bucket pixels)", max_pad_fraction, 0.0,
                                        1.0, high_open=True)
        if resample not in RESAMPLE:
            raise ValueError(f"resample must be one of {RESAMPLE}, got {resample!r}")
        fills = fill if isinstance(fill, tuple) else (fill,)
        if not fills or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in fills):
            raise ValueError(f"fill must be a number or a tuple of numbers (one per channel), got {fill!r}")
        self.resample, self.fill = resample, fill
        if (area is None) == (buckets is None):
            raise ValueError(f"give exactly one of area= or buckets=, got area={area!r}, buckets={buckets!r}")
        if buckets is None:
            self.buckets = self._grid(area, min_side, max_side)
        else:
            self.buckets = self._explicit(buckets)
        self.costs = self._check_costs(costs)

    # ---- construction ---------------------------------------------------------------------------
    def _grid(self, area: Any, min_side: Any, max_side: Any) -> list[Size]:
        """Validate the budget and build the grid."""
        area = _positive_int("area", area)
        lo = self.step if min_side is None else _positive_int("min_side", min_side)
        hi = (
            (area // lo) // self.step * self.step if max_side is None else _positive_int("max_side", max_side)
        )
        for name, v in (("min_side", lo), ("max_side", hi)):
            if v % self.step:
                raise ValueError(f"{name}={v} is not a multiple of step={self.step}")
        if lo > hi:
            raise ValueError(f"min_side={lo} must be <= max_side={hi}")
        # a width past sqrt(area * max_aspect) has no height within both the area and the aspect
        hi = min(hi, (math.isqrt(int(area * self.max_aspect)) // self.step + 1) * self.step)
        widths = (hi - lo) // self.step + 1
        if widths > MAX_WIDTHS:
            step = -(-(hi - lo) // (MAX_WIDTHS - 1) // self.latent_factor) * self.latent_factor
            raise ValueError(f"area={area} with step={self.step} gives {widths} bucket widths to try, more "
                             f"than {MAX_WIDTHS}: use a step of at least {step}, or a smaller area")
        buckets = grid_buckets(area, self.step, lo, hi, self.max_aspect)
        if not buckets:
            raise ValueError(
                f"no bucket fits area={area}, step={self.step}, min_side={lo}, max_side={hi}, "
                f"max_aspect={self.max_aspect}: need min_side**2 <= area"
            )
        return buckets

    def _explicit(self, buckets: Iterable[Size]) -> list[Size]:
        """Validate an explicit bucket list: positive, multiples of step, within max_aspect."""
        out = sorted({_check_size("bucket", b) for b in buckets}, key=lambda b: (b[0] / b[1], b[0]))
        if not out:
            raise ValueError("buckets= is empty; give at least one (width, height)")
        bad = [b for b in out if b[0] % self.step or b[1] % self.step]
        if bad:
            raise ValueError(f"bucket sides must be multiples of step={self.step}; these are not: {bad}")
        wide = [b for b in out if max(b) / min(b) > self.max_aspect]
        if wide:
            raise ValueError(
                f"buckets {wide} exceed max_aspect={self.max_aspect}; raise max_aspect or drop them"
            )
        return out

    def _check_costs(self, costs: Mapping[Size, float] | None) -> dict[Size, float]:
        """Costs per bucket (default: area); every bucket needs one."""
        if costs is None:
            return {b: float(b[0] * b[1]) for b in self.buckets}
        missing = [b for b in self.buckets if tuple(b) not in costs]
        if missing:
            raise ValueError(f"costs= has no entry for buckets {missing}")
        return {b: _number(f"costs[{b}]", costs[b], 0.0) for b in self.buckets}

    def __repr__(self) -> str:
        f = self.latent_factor
        return f"BucketPlanner({len(self.buckets)} buckets, step={self.step}, latent_factor={f})"

    def __len__(self) -> int:
        return len(self.buckets)

    # ---- compiled shapes ------------------------------------------------------------------------
    def shapes(self, batch_sizes: Iterable[int] = (1,), guidance: float = 1.0) -> list[tuple[int, int, int]]:
        """Distinct model input shapes (N, H/f, W/f) for these batch sizes; CFG (guidance > 1) doubles N."""
        cfg = 2 if guidance > 1 else 1
        f = self.latent_factor
        ns = sorted({_positive_int("batch size", n) * cfg for n in batch_sizes})
        return [(n, h // f, w // f) for n in ns for (w, h) in self.buckets]

    def num_shapes(self, batch_sizes: Iterable[int] = (1,), guidance: float = 1.0) -> int:
        """How many distinct shapes a compiler would see (len of shapes())."""
        return len(self.shapes(batch_sizes, guidance))

    # ---- assignment -----------------------------------------------------------------------------
    def assign(
        self,
        width: int,
        height: int,
        policy: str = "pad",
        *,
        fit: str = "cover",
        offset: str | tuple[int, int] = "center",
        bucket: Size | None = None,
        max_aspect_error: float | None = None,
        max_pad_fraction: float | None = None,
        policies: Sequence[str] = ("pad", "resize"),
    ) -> Assignment:
        """Assign a (width, height) request to a bucket by an explicit policy; see Assignment for the steps.

        ``offset``: "center", "top-left" or (top, left): where the content sits (pad, fit="inside") or
        where the kept window starts (resize fit="cover": in the resized image; crop: in the request).
        ``bucket`` forces a bucket of this planner. ``auto`` returns the cheapest of ``policies`` whose
        padding fraction is <= max_pad_fraction (pad) or aspect error <= max_aspect_error (resize).
        """
        req = (_positive_int("width", width), _positive_int("height", height))
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if fit not in FITS:
            raise ValueError(f"fit must be one of {FITS}, got {fit!r}")
        if bucket is not None and tuple(bucket) not in self.costs:
            raise ValueError(f"bucket={bucket!r} is not one of this planner's buckets {self.buckets}")
        max_ae = self.max_aspect_error if max_aspect_error is None else float(max_aspect_error)
        max_pf = self.max_pad_fraction if max_pad_fraction is None else float(max_pad_fraction)
        if policy == "auto":
            return self._auto(req, offset, bucket, max_ae, max_pf, policies)
        if policy == "pad":
            return self._pad(req, bucket or self._pad_bucket(req), offset)
        if policy == "crop":
            return self._crop(req, bucket or self._crop_bucket(req), offset)
        b = bucket or self._resize_bucket(req, max_ae)
        return self._cover(req, b, offset) if fit == "cover" else self._inside(req, b, offset)

    # ---- bucket choice --------------------------------------------------------------------------
    def _pad_bucket(self, req: Size) -> Size:
        """Cheapest bucket at least as large as the request on both sides (ties: less padding)."""
        fits = [b for b in self.buckets if b[0] >= req[0] and b[1] >= req[1]]
        if not fits:
            raise ValueError(self._no_fit_message(req, "pad", "at least as large as"))
        return min(fits, key=lambda b: (self.costs[b], b[0] * b[1], b))

    def _crop_bucket(self, req: Size) -> Size:
        """Largest bucket no larger than the request on either side (ties: closer aspect)."""
        fits = [b for b in self.buckets if b[0] <= req[0] and b[1] <= req[1]]
        if not fits:
            raise ValueError(self._no_fit_message(req, "crop", "no larger than"))
        return min(fits, key=lambda b: (-b[0] * b[1], aspect_error(req, b), b))

    def _resize_bucket(self, req: Size, max_ae: float) -> Size:
        """Bucket with the closest aspect ratio (ties: closest area), within max_aspect_error."""
        best = min(self.buckets, key=lambda b: self._resize_key(req, b))
        if aspect_error(req, best) > max_ae:
            raise ValueError(
                f"request {req[0]}x{req[1]} (aspect {req[0] / req[1]:.3f}) has no bucket within "
                f"max_aspect_error={max_ae}: the closest is {best[0]}x{best[1]} (aspect error "
                f"{aspect_error(req, best):.3f}); the bucket set allows aspects up to {self.max_aspect}"
            )
        return best

    @staticmethod
    def _resize_key(req: Size, b: Size) -> tuple:
        """Order for resize: closest aspect, then closest area (log ratio), then the bucket itself."""
        return aspect_error(req, b), abs(math.log(b[0] * b[1] / (req[0] * req[1]))), b

    def _no_fit_message(self, req: Size, policy: str, relation: str) -> str:
        """Error text for a request no bucket can take under pad / crop."""
        ar = max(req) / min(req)
        extra = f"; its aspect {ar:.2f} exceeds max_aspect={self.max_aspect}" if ar > self.max_aspect else ""
        return (
            f"no bucket is {relation} the {req[0]}x{req[1]} request for policy='{policy}'{extra}; "
            "buckets span "
            f"widths {min(b[0] for b in self.buckets)}..{max(b[0] for b in self.buckets)} and heights "
            f"{min(b[1] for b in self.buckets)}..{max(b[1] for b in self.buckets)}; use policy='resize' "
            "or add a bucket"
        )

    # ---- per-policy assignments -----------------------------------------------------------------
    def _make(self, req: Size, b: Size, policy: str, fit: str | None, resized: Size, crop, pad) -> Assignment:
        """Build the Assignment with this planner's latent factor, resampling filter and fill."""
        return Assignment(
            req,
            tuple(b),
            policy,
            fit,
            resized,
            tuple(crop),
            tuple(pad),
            self.latent_factor,
            self.resample,
            self.fill,
        )

    def _place(self, outer: Size, inner: Size, offset: Any, align: int) -> tuple[int, int]:
        """(top, left) of an inner (w, h) box in an outer one: centred (aligned down to `align`) or given."""
        room_y, room_x = outer[1] - inner[1], outer[0] - inner[0]
        if offset == "center":
            return room_y // 2 // align * align, room_x // 2 // align * align
        if offset == "top-left":
            return 0, 0
        if not isinstance(offset, Sequence) or len(offset) != 2 or isinstance(offset, str):
            raise ValueError(f"offset must be 'center', 'top-left' or (top, left), got {offset!r}")
        top, left = int(offset[0]), int(offset[1])
        if not (0 <= top <= room_y and 0 <= left <= room_x):
            raise ValueError(f"offset (top, left)={offset!r} must lie in [0, {room_y}] x [0, {room_x}]")
        return top, left

    def _pad(self, req: Size, b: Size, offset: Any) -> Assignment:
        """Pad: place the request unchanged inside a bucket at least as large."""
        if b[0] < req[0] or b[1] < req[1]:
            raise ValueError(
                f"policy='pad' needs a bucket >= the request on both sides: {b} vs request {req}"
            )
        top, left = self._place(b, req, offset, self.latent_factor)
        pad = (top, b[1] - req[1] - top, left, b[0] - req[0] - left)
        return self._make(req, b, "pad", None, req, (0, 0), pad)

    def _crop(self, req: Size, b: Size, offset: Any) -> Assignment:
        """Crop: cut a bucket-sized window out of the request, no resampling."""
        if b[0] > req[0] or b[1] > req[1]:
            raise ValueError(
                f"policy='crop' needs a bucket <= the request on both sides: {b} vs request {req}"
            )
        top, left = self._place(req, b, offset, 1)
        return self._make(req, b, "crop", None, req, (top, left), (0, 0, 0, 0))

    def _cover(self, req: Size, b: Size, offset: Any) -> Assignment:
        """Resize (aspect kept) until the image covers the bucket, then crop the bucket out of it."""
        s = max(b[0] / req[0], b[1] / req[1])
        resized = (max(b[0], math.floor(req[0] * s + 0.5)), max(b[1], math.floor(req[1] * s + 0.5)))
        top, left = self._place(resized, b, offset, 1)
        return self._make(req, b, "resize", "cover", resized, (top, left), (0, 0, 0, 0))

    def _inside(self, req: Size, b: Size, offset: Any) -> Assignment:
        """Resize (aspect kept) until the image fits inside the bucket, then pad the rest."""
        s = min(b[0] / req[0], b[1] / req[1])
        resized = (
            min(b[0], max(1, math.floor(req[0] * s + 0.5))),
            min(b[1], max(1, math.floor(req[1] * s + 0.5))),
        )
        top, left = self._place(b, resized, offset, self.latent_factor)
        pad = (top, b[1] - resized[1] - top, left, b[0] - resized[0] - left)
        return self._make(req, b, "resize", "inside", resized, (0, 0), pad)

    def _auto(
        self,
        req: Size,
        offset: Any,
        bucket: Size | None,
        max_ae: float,
        max_pf: float,
        policies: Sequence[str],
    ) -> Assignment:
        """Cheapest admissible assignment over the allowed policies (ties: pad, then resize, then crop)."""
        bad = [p for p in policies if p not in ("pad", "resize", "crop")]
        if bad or not policies:
            raise ValueError(
                f"auto policies must be a non-empty subset of ('pad', 'resize', 'crop'), got {policies!r}"
            )
        options = []
        pool = [tuple(bucket)] if bucket is not None else self.buckets
        order = {"pad": 0, "resize": 1, "crop": 2}
        if "pad" in policies:
            fits = [b for b in pool if b[0] >= req[0] and b[1] >= req[1]]
            options += [a for a in (self._pad(req, b, offset) for b in fits) if a.pad_fraction <= max_pf]
        if "resize" in policies:
            b = bucket or min(self.buckets, key=lambda b: self._resize_key(req, b))
            if aspect_error(req, b) <= max_ae:
                options.append(self._cover(req, b, offset))
        if "crop" in policies:
            fits = [b for b in pool if b[0] <= req[0] and b[1] <= req[1]]
            b = min(fits, key=lambda b: (-b[0] * b[1], aspect_error(req, b), b)) if fits else None
            if b is not None and aspect_error(req, b) <= max_ae:
                options.append(self._crop(req, b, offset))
        if not options:
            raise ValueError(
                f"policy='auto' found no assignment for {req[0]}x{req[1]} among {list(policies)} with "
                f"max_pad_fraction={max_pf} and max_aspect_error={max_ae}; loosen them or add buckets"
            )
        return min(options, key=lambda a: (self.costs[a.bucket], order[a.policy], a.cut_fraction, a.bucket))
