"""Collectives over tile-parallel ranks: fused sums of accumulators, maxima, gathers, exact moment merges."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .groups import DEFAULT_TIMEOUT, _backend, _comm_device, _global, rank_world


def all_reduce_sum(tensors: Sequence[Any], group: Any, dtype: Any = None) -> None:
    """Sum each tensor over the ranks, in place, with one all-reduce of a packed buffer in `dtype`.

    `dtype` defaults to float64 (sums of float32 parts are then exact to ~1e-16 relative, so the result
    hardly depends on the number of ranks); pass float32 to halve the traffic.
    """
    if group is None or not tensors:
        return
    dtype = dtype or torch.float64
    device = _comm_device(group, tensors[0].device)
    flat = torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view(t.shape))
        offset += n


def all_reduce_accumulator(acc: Any, group: Any, dtype: Any = None) -> None:
    """Fused all-reduce of a blending Accumulator: value and weight buffers summed in one collective."""
    if getattr(acc, "_done", False):
        raise RuntimeError("the accumulator was already normalised by result(); reduce before result()")
    all_reduce_sum([acc.value, acc.weight], group, dtype)


def all_reduce_max(value: int, group: Any) -> int:
    """The largest of one int over the ranks (e.g. a channel count that an empty shard cannot know)."""
    if group is None:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=_comm_device(group, None))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def all_gather_cat(tensor: Any, group: Any, dim: int = 0) -> Any:
    """Concatenate every rank's tensor along `dim` in rank order; sizes along `dim` may differ (even 0).

    The other dimensions must agree. Used for attention keys/values: each rank computes them for its
    tokens, every rank gets all of them.
    """
    if group is None:
        return tensor
    rank, world = rank_world(group)
    device = _comm_device(group, tensor.device)
    dim = dim % tensor.ndim
    shape = torch.tensor(list(tensor.shape), dtype=torch.int64, device=device)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    shapes = [s.tolist() for s in shapes]
    others = [[n for d, n in enumerate(s) if d != dim] for s in shapes]
    if any(o != others[rank] for o in others):
        raise ValueError(f"all_gather_cat: shapes {shapes} differ outside dim {dim}")
    longest = max(s[dim] for s in shapes)
    padded = list(tensor.shape)
    padded[dim] = longest
    buf = torch.zeros(padded, dtype=tensor.dtype, device=device)
    buf.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    parts = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(parts, buf, group=group)
    out = torch.cat([p.narrow(dim, 0, s[dim]) for p, s in zip(parts, shapes, strict=True)], dim=dim)
    return out.to(tensor.device)


def merge_moments(parts: Sequence[tuple[Any, Any, Any]]) -> tuple[Any, Any, Any]:
    """Chan et al. (1979) pairwise merge of (count, mean, M2) triples, left to right; empty parts skipped."""
    n, mean, m2 = parts[0]
    for nb, mb, m2b in parts[1:]:
        nb = float(nb)
        if nb == 0:
            continue
        if n == 0:
            n, mean, m2 = nb, mb, m2b
            continue
        total = n + nb
        delta = mb - mean
        mean = mean + delta * (nb / total)
        m2 = m2 + m2b + delta.square() * (n * nb / total)
        n = total
    return n, mean, m2


def all_merge_moments(count: float, mean: Any, m2: Any, group: Any) -> tuple[float, Any, Any]:
    """Exact global (count, mean, M2) from every rank's local ones: all-gather, Chan merge in rank order.

    `mean` and `m2` are float64 tensors of one shape (e.g. (batch, groups) for GroupNorm), zeros with
    count 0 on a rank that saw no pixels. Merging about each part's own mean is exact, unlike summing
    per-shard variances (wrong by the spread of the shard means). Every rank gets the same result.
    """
    if group is None:
        return count, mean, m2
    _, world = rank_world(group)
    device = _comm_device(group, mean.device)
    packed = torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=device),
                        mean.detach().reshape(-1).to(device, torch.float64),
                        m2.detach().reshape(-1).to(device, torch.float64)])
    parts = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(parts, packed, group=group)
    k = mean.numel()
    triples = [(float(p[0]), p[1 : 1 + k].view(mean.shape), p[1 + k :].view(mean.shape)) for p in parts]
    n, mu, M2 = merge_moments(triples)
    return n, mu.to(mean.device), M2.to(mean.device)


def broadcast(value: Any, group: Any, src: int = 0) -> Any:
    """Rank `src`'s tensor (in place, returned) or picklable object, on every rank."""
    if group is None:
        return value
    src_global = _global(group, src)
    if isinstance(value, torch.Tensor):
        device = _comm_device(group, value.device)
        buf = value.to(device)
        dist.broadcast(buf, src=src_global, group=group)
        if buf is not value:
            value.copy_(buf)
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src_global, group=group)
    return box[0]


def barrier(group: Any, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Wait for every rank; gloo names the ranks that did not arrive within `timeout` seconds."""
    if group is None:
        return
    if "gloo" in _backend(group):
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout))
    else:
        dist.barrier(group=group)  # NCCL: bounded by the timeout given to init_process_group
