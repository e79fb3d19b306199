"""GroupNorm with known statistics as one per-channel affine y = a x + s (how a tile applies statistics
gathered over every tile)."""

from __future__ import annotations

import torch


def apply_group_norm(x, stats, groups, eps, weight, bias, out=None):
    """GroupNorm with given per-(batch, group) mean and variance (float64): one per-channel affine
    y = a x + s with a = weight rstd, s = bias - a mean, computed in float32 (or wider) and rounded once
    to x's dtype. out=x overwrites x with the same values."""
    return apply_affine(x, group_norm_affine(stats, groups, eps, weight, bias, x.dtype, x.shape[1]), out=out)


def group_norm_affine(stats, groups, eps, weight, bias, dtype, channels):
    """(a, s): GroupNorm with statistics (mean, var) (float64, (B, groups)) as the per-channel affine
    y = a x + s, (B, C, 1, 1) tensors in float32 or wider: the group's r = (var + eps)^-1/2 and r mean in
    float64, both spread to the channels and rounded once, then a = r weight and s = bias - r mean weight
    (six kernels with weight and bias; computed once per GroupNorm and run)."""

    mean, var = stats
    b, cg = mean.shape[0], channels // groups
    r = torch.empty((2, b, groups), dtype=torch.float64, device=mean.device)
    torch.rsqrt(var + eps, out=r[0])
    torch.mul(r[0], mean, out=r[1])
    dt = torch.promote_types(dtype, torch.float32)
    rc = torch.empty((2, b, groups, cg), dtype=dt, device=mean.device)
    rc.copy_(r.unsqueeze(-1).expand(2, b, groups, cg))  # (one kernel: spread and rounded)
    rc = rc.view(2, b, channels)
    if weight is None:
        a, s = rc[0], rc[1].neg()
    elif bias is None:
        a, s = rc[0] * weight, (rc[1] * weight).neg_()
    else:
        a, s = rc[0] * weight, torch.addcmul(bias, rc[1], weight, value=-1)
    return a.view(-1, channels, 1, 1), s.view(-1, channels, 1, 1)


def apply_affine(x, affine, out=None):
    """y = a x + s per channel (`group_norm_affine`) in one kernel, in float32 or wider, stored in x's
    dtype; into `out` (x itself is allowed) or a new tensor in x's memory layout. x's batch may be n
    times the affine's: n tiles of the same samples stacked tile-major (batched tiles), each given its
    sample's affine."""

    a, s = affine
    if a.shape[0] > 1 and x.shape[0] != a.shape[0]:  # (tiles stacked: viewed (n, B, C, h, w), no copy)
        n, b = divmod(x.shape[0], a.shape[0])
        if b:
            raise ValueError(f"a batch of {x.shape[0]} is not a whole number of the affine's {a.shape[0]} "
                             "samples")
        a, s, whole = a.unsqueeze(0), s.unsqueeze(0), x
        x = x.unflatten(0, (n, a.shape[1]))
        if torch.is_grad_enabled() and (a.requires_grad or whole.requires_grad):
            return (x * a + s).to(x.dtype).flatten(0, 1)
        out = torch.empty_like(whole) if out is None else out
        torch.addcmul(s, x, a, out=out.unflatten(0, (n, a.shape[1])))
        return out
    if torch.is_grad_enabled() and (a.requires_grad or x.requires_grad):  # (out= has no autograd)
        return (x * a + s).to(x.dtype)
    if out is None:
        out = torch.empty_like(x)
    return torch.addcmul(s, x, a, out=out)
