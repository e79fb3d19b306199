"""Exact GroupNorm statistics over tiles: per-(batch, group) moments, merged across disjoint tiles.

Each tile contributes the float64 mean and sum of squared deviations of its core (two vectorised passes,
shifted by the float32 group mean); tiles merge with Chan et al.'s pairwise update (1979), so the result
equals torch's GroupNorm statistics over the whole value within float error, whatever the tile order.
"""

from __future__ import annotations


class GroupStats:
    """Exact per-(batch, group) mean and variance merged over disjoint tiles (Chan et al. 1979)."""

    def __init__(self, groups: int):
        self.groups = groups
        self.n = 0
        self.mean = None
        self.m2 = None

    def add(self, x) -> None:
        """Merge the statistics of tile x (B, C, h, w): shifted two-pass moments, then the Chan update."""
        nb = x[0].numel() // self.groups
        if nb == 0:
            return
        mb, m2b = moments(x.detach(), self.groups)
        if self.mean is None:
            self.n, self.mean, self.m2 = nb, mb, m2b
            return
        n = self.n + nb
        delta = mb - self.mean
        self.mean = self.mean + delta * (nb / n)
        self.m2 = self.m2 + m2b + delta.square() * (self.n * nb / n)
        self.n = n

    def result(self):
        """(mean, biased variance) as float64 (B, groups) tensors, as torch's GroupNorm uses."""
        return self.mean, self.m2 / self.n


def moments(x, groups: int, chunk: int = 1 << 20):
    """Per-(batch, group) mean and sum of squared deviations of x (B, C, h, w) as float64, in two passes:
    per-channel cascade sums of x, then of (x - m)^2 shifted by the float32 group mean m, a band of rows
    at a time through one buffer in x's memory layout (NCHW or channels-last, read without a copy).

    torch.var_mean's Welford reduction is scalar on CPU (~10x slower than these vectorised sums) and a
    whole-tile temporary costs page faults; the shift keeps float32 sums accurate (no E[x^2] - E[x]^2).
    """
    import torch

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
