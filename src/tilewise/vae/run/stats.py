"""Exact GroupNorm statistics over tiles: per-(batch, group) moments, merged across disjoint tiles.

Each tile contributes the mean and variance of its core (float32 or wider: one torch.var_mean pass, or
two vectorised passes shifted by the float32 group mean); the tiles' moments are merged with Chan et
al.'s update (1979) for all parts at once when the statistics are read, in float64 and a fixed number of
kernels (a stack, two matrix-vector products with the parts' weights): the result equals torch's
GroupNorm statistics over the whole value within float error, whatever the tile order, and a tile
costs no merge kernels.
"""

from __future__ import annotations

import torch


class GroupStats:
    """Exact per-(batch, group) mean and variance merged over disjoint tiles (Chan et al. 1979).

    `chunk`: bytes of float32 rows one pass of `moments` holds; 0: one torch.var_mean pass a tile
    (GPU plans: one kernel a tile, its float32 results widened to float64 when merged)."""

    def __init__(self, groups: int, chunk: int = 1 << 20):
        self.groups, self.chunk = groups, chunk
        self._n, self._both = 0, None  # pixels merged, and their (mean, var) stacked: (2, B, groups)
        self._parts: list = []  # (count, mean, variance) of tiles added since the last merge

    def add(self, x) -> None:
        """Add the moments of tile x (B, C, h, w); merged when read."""
        nb = x[0].numel() // self.groups
        if not nb:
            return
        if self.chunk == 0:
            mean, var = var_mean(x.detach(), self.groups)
        else:
            mean, m2 = moments(x.detach(), self.groups, self.chunk)
            var = m2 / nb
        self._parts.append((nb, mean, var))

    def result(self):
        """(mean, biased variance) as float64 (B, groups) tensors, as torch's GroupNorm uses (views of
        `stacked`)."""
        both = self.stacked
        return (None, None) if both is None else (both[0], both[1])

    @property
    def stacked(self):
        """The merged (mean, var), one float64 (2, B, groups) tensor (None before any pixel)."""
        self._merge()
        return self._both

    @property
    def n(self) -> int:
        self._merge()
        return self._n

    @property
    def mean(self):
        both = self.stacked
        return None if both is None else both[0]

    @property
    def m2(self):
        """The merged sum of squared deviations, n var (Chan et al.'s M2)."""
        both = self.stacked
        return None if both is None else both[1] * self._n

    def replace(self, n: int, mean, m2) -> None:
        """Set the merged moments (sharding: the merge over all ranks), dropping pending parts."""

        self._parts, self._n = [], n
        self._both = torch.stack((mean, m2 / n)).to(torch.float64)

    def _merge(self) -> None:
        """Fold the pending parts in, in float64, with weights w_i = n_i / n: mean = sum w_i mean_i,
        var = sum w_i (var_i + (mean_i - mean)^2) (Chan et al.'s update over k parts at once)."""
        if not self._parts:
            return

        parts, self._parts = self._parts, []
        if self._both is not None:
            parts = [(self._n, self._both[0], self._both[1]), *parts]
        f64 = torch.float64
        k, n = len(parts), sum(p[0] for p in parts)
        both = torch.stack([t for p in parts for t in p[1:]]).to(f64)  # (2k, B, G)
        self._n = n
        if k == 1:
            self._both = both
            return
        stacked = both.view(k, 2, -1)  # (k, 2, B G)
        w = _to_device(torch.tensor([p[0] / n for p in parts], dtype=f64), both.device)
        out = torch.empty((2, stacked.shape[2]), dtype=f64, device=both.device)
        torch.mv(stacked[:, 0].T, w, out=out[0])
        d = stacked[:, 0] - out[0]
        torch.mv(torch.addcmul(stacked[:, 1], d, d).T, w, out=out[1])
        self._both = out.view(2, *parts[0][1].shape)


def _to_device(t, device):
    """A small host tensor on `device`: through pinned memory without a host wait on CUDA."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def moments(x, groups: int, chunk: int = 1 << 20):
    """Per-(batch, group) mean and sum of squared deviations of x (B, C, h, w) as float64, in two passes:
    per-channel cascade sums of x, then of (x - m)^2 shifted by the float32 group mean m, a band of rows
    at a time (`chunk` bytes of float32) through one buffer in x's memory layout (NCHW or channels-last,
    read without a copy).

    torch.var_mean's Welford reduction is scalar on CPU (~10x slower than these vectorised sums) and a
    whole-tile temporary costs page faults; the shift keeps float32 sums accurate (no E[x^2] - E[x]^2).
    chunk=0 (GPU plans, where every kernel is a launch): one `var_mean` pass instead of ~20 kernels a
    chunk.
    """

    if chunk == 0:
        mean, var = var_mean(x, groups)
        return mean.to(torch.float64), var.to(torch.float64) * (x[0].numel() // groups)
    b, c, h, w = x.shape
    cg = c // groups
    n = cg * h * w
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    m = x.sum((2, 3), dtype=acc).view(b, groups, cg).sum(-1) / n  # (B, G)
    mc = m.repeat_interleave(cg, dim=1).view(b, c, 1, 1)
    rows = max(1, min(h, chunk // max(b * c * w * 4, 1)))
    fmt = torch.channels_last if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(
        memory_format=torch.channels_last) else torch.contiguous_format
    buf = torch.empty((b, c, rows, w), dtype=acc, device=x.device, memory_format=fmt)
    s1 = s2 = 0
    for y in range(0, h, rows):
        xs = x[:, :, y : y + rows]
        d = torch.sub(xs, mc, out=buf[:, :, : xs.shape[2]])
        s1 = s1 + d.sum((2, 3)).to(torch.float64)
        s2 = s2 + d.square_().sum((2, 3)).to(torch.float64)
    s1, s2 = s1.view(b, groups, cg).sum(-1), s2.view(b, groups, cg).sum(-1)
    return m.to(torch.float64) + s1 / n, s2 - s1.square() / n


def var_mean(x, groups: int):
    """(mean, biased variance) of each (batch, group) of x (B, C, h, w) in one torch.var_mean (Welford)
    pass, float32 or wider (half-precision values are read as float32)."""

    g = x.unflatten(1, (groups, x.shape[1] // groups))
    if g.dtype not in (torch.float32, torch.float64):
        g = g.float()
    var, mean = torch.var_mean(g, dim=(2, 3, 4), correction=0)
    return mean, var
