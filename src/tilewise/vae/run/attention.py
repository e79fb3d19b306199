"""Global attention in a tiled run: every token's keys and values, where they live, and the query bands.

An attention segment has no halo: its queries need only their own tokens, given the keys and values of
all of them. Those are computed first, band by band from the staged normalised input, into one store per
tensor (no list joined at the end: that held them twice): on the device, or, when the plan streams them
(`kv_chunk`), in host memory (pinned for an accelerator), read back `kv_chunk` tokens at a time by each
query band (`locality.streamed_attention`). The queries run in the tile grid's tiles, or, with
`query_rows`, in row bands of that many reference rows across the whole width: every band reads all
keys and values once, so fewer, bigger bands move fewer bytes.
"""

from __future__ import annotations

import torch

from ...distributed import all_gather_cat
from ...geometry import TileGrid


def keys_values(op, read, h: int, w: int, rows: tuple[int, int], chunk: int, device, host: bool,
                group=None):
    """(k, v): the (B, N, C) keys and values of the normalised input's rows `rows` of h x w tokens (read
    by `read(box)`), computed about `chunk` tokens at a time into stores on the device, or in host memory
    when `host`. With a process group: every rank's tokens, gathered on the device in rank order."""

    lo, hi = rows
    band = max(1, min(h, chunk // max(w, 1)))
    starts = list(range(lo, hi, band))
    if group is not None:  # each rank's rows, gathered: row-major token order

        parts = [op.keys_values(read((y0, min(hi, y0 + band), 0, w))) for y0 in starts]
        if not parts:  # a rank without rows: no tokens, the right shapes
            parts = [op.keys_values(read((lo, lo, 0, w)))]
        k, v = (torch.cat([p[i] for p in parts], dim=1) for i in (0, 1))
        return all_gather_cat(k, group, dim=1), all_gather_cat(v, group, dim=1)
    if len(starts) == 1 and not host:
        return op.keys_values(read((lo, hi, 0, w)))
    stores, into = None, False
    for y0 in starts:
        y1 = min(hi, y0 + band)
        n = read((y0, y1, 0, w))
        t0, t1 = (y0 - lo) * w, (y1 - lo) * w
        kv = None
        if stores is None:
            b = n.shape[0]
            off = host and torch.device(device).type != "cpu"
            into = not off and projects_into(op, b)
            if into:
                c = op.to_k.weight.shape[0]
            else:
                kv = op.keys_values(n)
                c = kv[0].shape[-1]
            where = dict(device="cpu", pin_memory=torch.device(device).type == "cuda") if off else {
                "device": n.device}
            stores = [torch.empty((b, (hi - lo) * w, c), dtype=n.dtype, **where) for _ in (0, 1)]
        if into:  # one addmm a projection, straight into the store
            t = n.flatten(2).transpose(1, 2)[0]
            for layer, store in zip((op.to_k, op.to_v), stores, strict=True):
                torch.addmm(layer.bias, t, layer.weight.t(), out=store[0, t0:t1])
            continue
        k, v = kv or op.keys_values(n)
        stores[0][:, t0:t1].copy_(k, non_blocking=True)
        stores[1][:, t0:t1].copy_(v, non_blocking=True)
    return tuple(stores)


def projects_into(op, batch: int) -> bool:
    """Whether keys and values can be projected straight into a store on the device: plain Linear layers
    with biases (one addmm each) and one batch item (a store's rows are then one matrix)."""

    return batch == 1 and all(type(m) is torch.nn.Linear and m.bias is not None for m in (op.to_k, op.to_v))


def query_grid(shape: tuple[int, int], rows: int):
    """The row bands of `rows` reference rows (whole width) an attention segment's queries run in."""

    h, w = shape
    return TileGrid(h, w, (min(rows, h), w), order="row")
