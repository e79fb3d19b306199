"""Attention whose keys and values arrive a chunk at a time, exact up to rounding.

Global attention over a big latent needs every token's keys and values; at 4096 px (a 512 x 512 latent
of 512 channels) those are 512 MiB in float16, more than a small device budget holds. Streamed, they stay
in host memory and cross to the device `kv_chunk` tokens at a time. Each chunk j is one fused attention
kernel that also returns the log-sum-exp of its scores, lse_j = log sum_k exp(q k^T / sqrt(d)), and the
chunks' normalised outputs o_j are merged with running float32 (o, lse) (the online softmax of Milakov &
Gimelshein 2018, "Online normalizer calculation for softmax", as FlashAttention merges blocks):

    lse' = logaddexp(lse, lse_j);  a = exp(lse - lse');  o = o_j + a (o - o_j);  lse = lse'

(the two weights sum to one: exp(lse_j - lse') = 1 - a).

Nothing is approximated: the result is softmax(q k^T / sqrt(d)) v reassociated. The fused kernels are
PyTorch's: memory-efficient attention on CUDA, flash attention on the CPU (and the meta device, where
runs are counted); neither holds the scores. Where neither runs (another device, or a kernel that refuses
its inputs, said once in the log), blocks of scores are computed in float32 instead, their size bounded
by the chunk's own bytes.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_REFUSED: set[str] = set()  # device types whose fused kernel refused once (logged), scores from then on


def streamed_attention(q, k, v, heads: int, q_chunk: int, kv_chunk: int):
    """softmax(q k^T / sqrt(d)) v over key chunks (module docstring). q: (B, H, Nq, d) on the device (a
    tensor of your own: it may be scaled in place); k, v: (B, N, H d) tokens, on the device or in
    (pinned) host memory, read kv_chunk tokens at a time; q_chunk bounds the score blocks where no fused
    kernel runs. Returns (B, H, Nq, d) in q's dtype."""

    b, h, nq, d = q.shape
    lse = torch.full((b, h, nq, 1), float("-inf"), dtype=torch.float32, device=q.device)
    o = torch.zeros((b, h, nq, d), dtype=torch.float32, device=q.device)
    for j in range(0, k.shape[1], kv_chunk):
        kj = heads_view(k[:, j : j + kv_chunk].to(q.device, non_blocking=True), heads)
        vj = heads_view(v[:, j : j + kv_chunk].to(q.device, non_blocking=True), heads)
        oj, lj = _block(q, kj, vj, q_chunk)
        top = torch.logaddexp(lse, lj)  # lse'
        a = lse.sub_(top).exp_()  # exp(lse - lse'), and exp(lse_j - lse') = 1 - a
        torch.addcmul(oj, o.sub_(oj), a, out=o)  # o = a o + (1 - a) o_j  (the first chunk: a = 0)
        lse = top
        del kj, vj, oj, lj  # (before the next chunk arrives)
    return o.to(q.dtype)


def _block(q, k, v, q_chunk: int):
    """(o_j, lse_j) of one chunk of keys and values: o_j (B, H, Nq, d) in q's dtype, lse_j (B, H, Nq, 1)
    float32; a fused kernel where one runs, else float32 score blocks (`_scores_block`)."""
    kind = q.device.type
    if kind not in _REFUSED:

        aten = torch.ops.aten
        try:
            if kind == "cuda":
                o, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[:2]
            elif kind in ("cpu", "meta"):
                o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
            else:
                raise NotImplementedError(f"no fused attention with log-sum-exp on {kind}")
            return o, lse[..., : q.shape[2]].unsqueeze(-1)  # (CUDA pads lse's rows to 32)
        except (RuntimeError, NotImplementedError) as err:
            if isinstance(err, torch.OutOfMemoryError):
                raise
            _REFUSED.add(kind)
            logger.warning("streamed attention: no fused kernel on %s (%s); computing its scores in "
                           "float32 blocks instead (exact, more kernels)", kind, str(err).splitlines()[0])
    return _scores_block(q, k, v, q_chunk)


def _scores_block(q, k, v, q_chunk: int):
    """(o_j, lse_j) from explicit float32 scores, query rows at a time: at most q_chunk rows, and no more
    score bytes than the chunk of keys and values holds itself."""

    b, h, nq, d = q.shape
    rows = max(16, min(q_chunk, d * k.element_size() // 2))  # (a row's scores: h n 4 bytes; k, v: 2 h n d)
    o = torch.empty_like(q)
    lse = torch.empty((b, h, nq, 1), dtype=torch.float32, device=q.device)
    kt = k.transpose(-1, -2)
    for i in range(0, nq, rows):
        s = torch.matmul(q[:, :, i : i + rows], kt).float().mul_(d**-0.5)
        m = s.amax(-1, keepdim=True)
        p = s.sub_(m).exp_()
        total = p.sum(-1, keepdim=True)
        o[:, :, i : i + rows] = torch.matmul(p.div_(total).to(v.dtype), v)
        lse[:, :, i : i + rows] = total.log_().add_(m)
        del s, p
    return o, lse


def heads_view(t, heads: int):
    """(B, N, H d) -> (B, H, N, d), a view."""
    b, n, c = t.shape
    return t.view(b, n, heads, c // heads).transpose(1, 2)
