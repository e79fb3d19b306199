"""Sync ops of video programs: a GroupNorm of a video value (statistics per (batch, group) over the step's
frames and the whole frame), a GroupNorm of each frame (statistics per (batch, frame, group) over the
whole frame: the frames folded into the batch, Mochi's and Cosmos'), an attention over every token of the
step's frames (HunyuanVideo's mid-block, a causal mask between frames), an attention over each frame's
tokens (Cosmos', `FrameSDPA`), and the frames of several values concatenated along time (`FrameCat`); and
an attention over each position's frames (Mochi's encoder, Cosmos' causal one: local in space, over every
frame of the step).

In a one-step program (every frame in one step, as the traced lowering makes them) the step's frames are
the video's: these are the model's own GroupNorm and attention. The video executor merges a GroupNorm's
statistics over every tile of the step (`vae.run.stats.GroupStats`) before its segment runs, and makes
the attention's keys and values of every token of the step before its queries run tile by tile. A
GroupNorm of each frame and an attention over each frame's tokens reduce over no frame but their own, so
they are exact in a program of several causal steps too (a step holds whole frames); the others run in
one-step programs only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .affine import apply_affine
from .boxes import sub_tensor
from .ops import GroupNorm, Op, OpKind
from .streamed_attention import heads_view


@dataclass
class VideoGroupNorm(GroupNorm):
    """GroupNorm of a video value (B, C, t, H, W): statistics per (batch, group) over the step's frames
    and the whole frame (nn.GroupNorm on a 5-D tensor); its affine is per channel, as a 2-D one."""

    per_frame = False  # (statistics over the step's frames; `FrameGroupNorm`: of each frame)

    @staticmethod
    def fold(x):
        """(B, C, t, h, w) -> the (N, C, h', w') value whose per-(N, group) moments are this GroupNorm's
        statistics (`run.stats.GroupStats`): (B, C, t h, w)."""
        return x.flatten(2, 3)

    def affine(self, stats, x):
        if stats[0].requires_grad or stats[1].requires_grad:  # (a recomputed step: differentiable)
            return self._affine_graph(stats, x)
        a, s = super().affine(stats, x)
        return a.unsqueeze(-1), s.unsqueeze(-1)  # (B, C, 1, 1, 1)

    def _affine_graph(self, stats, x):
        """`group_norm_affine` with autograd (statistics that carry a graph: no out= kernels)."""
        mean, var = stats
        cg, dt = x.shape[1] // self.groups, torch.promote_types(x.dtype, torch.float32)
        r = torch.rsqrt(var + self.eps)
        a, s = r.repeat_interleave(cg, 1).to(dt), (-r * mean).repeat_interleave(cg, 1).to(dt)
        if self.weight is not None:
            a, s = a * self.weight, s * self.weight
        if self.bias is not None:
            s = s + self.bias
        return a.view(*a.shape, 1, 1, 1), s.view(*s.shape, 1, 1, 1)

    def describe(self):
        return f"group_norm G={self.groups} over the step's frames"


@dataclass
class FrameGroupNorm(VideoGroupNorm):
    """GroupNorm of each frame of a video value (B, C, t, H, W): statistics per (batch, frame, group) over
    the whole frame, as nn.GroupNorm of its frames folded into the batch ((B t, C, H, W); Mochi's
    MochiChunkedGroupNorm3D, Cosmos' CosmosCausalGroupNorm); its affine is per channel and frame."""

    per_frame = True

    @staticmethod
    def fold(x):
        """(B, C, t, h, w) -> (B t, C, h, w): each frame a row of the statistics (a view for B = 1)."""
        return x.transpose(1, 2).flatten(0, 1)

    def run(self, ctx, inputs, have, box, shapes):
        x = sub_tensor(inputs[0], have[0], box)
        affine = ctx.group_affine(self, x, box, shapes[0])
        if affine is None:  # (torch's own, the untiled run: each frame a row of its statistics)
            y = F.group_norm(self.fold(x), self.groups, self.weight, self.bias, self.eps)
            return y.view(x.shape[0], x.shape[2], *y.shape[1:]).transpose(1, 2)
        return apply_affine(x, affine)

    def affine(self, stats, x):
        b, c, t = x.shape[:3]
        if stats[0].requires_grad or stats[1].requires_grad:  # (a recomputed step: differentiable)
            a, s = self._affine_graph(stats, x)
        else:
            a, s = GroupNorm.affine(self, stats, x)
        # (B t, C, ...) -> (B, C, t, 1, 1)
        return tuple(v.reshape(b, t, c, 1, 1).transpose(1, 2) for v in (a, s))

    def describe(self):
        return f"group_norm G={self.groups} of each frame"


@dataclass
class StepAttention(Op):
    """diffusers Attention (after its GroupNorm) over every token of the step's frames, tokens in (t, h, w)
    order; `causal`: a token attends to the tokens of its frame and the frames before it (HunyuanVideo's
    prepare_causal_attention_mask); `own_frame`: to the tokens of its frame (an Attention of each frame,
    the frames in the batch: SVD's temporal decoder); else to all. src = (normed, residual). A sync op."""

    heads: int = 1
    to_q: Any = None
    to_k: Any = None
    to_v: Any = None
    to_out: Any = None
    residual: bool = True
    rescale: float = 1.0
    causal: bool = True
    own_frame: bool = False
    sync = True
    kind = OpKind.ATTENTION

    @staticmethod
    def _tokens(n):
        """(B, C, t, h, w) -> (B, t, h w, C)."""
        return n.flatten(3).permute(0, 2, 3, 1)

    def keys_values(self, n):
        """(B, t, N, C) keys and values of the tokens of n, frame by frame (bands of rows concatenate
        along dim 2)."""
        t = self._tokens(n)
        return self.to_k(t), self.to_v(t)

    def attend(self, n, k, v, chunk: int = 4096):
        """Queries of n (B, C, t, h, w) (frames 0.. of the step) attend to k, v of the step's frames (of
        their frame and the ones before, when causal), in query chunks; to_out(attn) as (B, C, t, h, w)."""
        b, c, t, h, w = n.shape
        q = self.to_q(self._tokens(n))
        outs = []
        for f in range(t):
            kf, vf = (k[:, f : f + 1], v[:, f : f + 1]) if self.own_frame else (
                (k[:, : f + 1], v[:, : f + 1]) if self.causal else (k, v))
            kf, vf = heads_view(kf.flatten(1, 2), self.heads), heads_view(vf.flatten(1, 2), self.heads)
            qf = heads_view(q[:, f], self.heads)
            parts = [F.scaled_dot_product_attention(qf[:, :, i : i + chunk], kf, vf)
                     for i in range(0, qf.shape[2], chunk)]
            o = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
            outs.append(o.transpose(1, 2).reshape(b, h * w, -1))
        o = torch.stack(outs, 1).to(q.dtype)  # (B, t, h w, C)
        y = self.to_out[1](self.to_out[0](o))
        return y.permute(0, 3, 1, 2).reshape(b, -1, t, h, w)

    def run(self, ctx, inputs, have, box, shapes):
        n = sub_tensor(inputs[0], have[0], box)
        k, v = ctx.attention_kv(self, n, box)
        y = self.attend(n, k, v, ctx.query_chunk)
        if self.residual:
            y = y + sub_tensor(inputs[1], have[1], box)
        return y / self.rescale if self.rescale != 1.0 else y

    def describe(self):
        if self.own_frame:
            return f"attention over each frame's tokens, heads={self.heads}"
        mask = "causal between frames" if self.causal else "no mask"
        return f"attention over the step's tokens, heads={self.heads}, {mask}"


@dataclass
class ColumnAttention(Op):
    """diffusers Attention over each position's frames (Mochi's encoder: `x.permute(0, 3, 4, 2, 1)
    .flatten(0, 2)`, tokens (B h w, t, C), its processor's causal mask between frames), the module run as
    it is on the columns of the box, `chunk` positions a call (the stock block's chunks: the same
    values). Local in space (no halo); it reads every frame of the step, so one-step programs only."""

    module: Any = None
    chunk: int = 1 << 15

    def run(self, ctx, inputs, have, box, shapes):
        x = sub_tensor(inputs[0], have[0], box)
        b, c, t, h, w = x.shape
        cols = x.permute(0, 3, 4, 2, 1).flatten(0, 2)
        parts = [self.module(cols[i : i + self.chunk]) for i in range(0, cols.shape[0], self.chunk)]
        y = torch.cat(parts) if len(parts) > 1 else parts[0]
        return y.unflatten(0, (b, h, w)).permute(0, 4, 3, 1, 2)

    def describe(self):
        return "attention over each position's frames"


@dataclass
class FrameSDPA(Op):
    """scaled_dot_product_attention over each frame's tokens (Cosmos' CosmosSpatialAttentionProcessor2_0:
    tokens (B t, heads, h w, C / heads)) of queries, keys and values that are 1x1x1 projections of one
    value (`proj`: their (weight, bias), as traced); no mask. src = (normed,). The output is the
    attention's, back as (B, C, t, h, w) (its output projection and residual are ops of their own). A
    sync op: every query attends to every token of its frame."""

    proj: tuple = ()  # ((w_q, b_q), (w_k, b_k), (w_v, b_v))
    heads: int = 1
    sync = True
    kind = OpKind.ATTENTION

    def _tokens(self, n, part: int):
        """Projection `part` (0: queries, 1: keys, 2: values) of n (B, C, t, h, w) as (B t, heads, h w, d)."""
        w, b = self.proj[part]
        y = F.conv3d(n, w, b).permute(0, 2, 3, 4, 1).flatten(2, 3).flatten(0, 1)
        return y.unflatten(2, (self.heads, -1)).transpose(1, 2)

    def keys_values(self, n):
        """(B t, heads, N, d) keys and values of the tokens of n, frame by frame (bands of rows
        concatenate along dim 2)."""
        return self._tokens(n, 1), self._tokens(n, 2)

    def attend(self, n, k, v, chunk: int = 4096):
        """Queries of n (B, C, t, h, w) attend to k, v of their frame in query chunks; (B, C, t, h, w)."""
        b, _, t, h, w = n.shape
        q = self._tokens(n, 0)
        parts = [F.scaled_dot_product_attention(q[:, :, i : i + chunk], k, v)
                 for i in range(0, q.shape[2], chunk)]
        o = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        o = o.transpose(1, 2).flatten(2, 3).type_as(q)
        return o.unflatten(1, (h, w)).unflatten(0, (b, t)).permute(0, 4, 1, 2, 3)

    def out_channels(self, channels):
        return int(self.proj[2][0].shape[0])

    def run(self, ctx, inputs, have, box, shapes):
        n = sub_tensor(inputs[0], have[0], box)
        k, v = ctx.attention_kv(self, n, box)
        return self.attend(n, k, v, ctx.query_chunk)

    def describe(self):
        return f"attention over each frame's tokens, heads={self.heads}"


@dataclass
class ColumnSDPA(Op):
    """scaled_dot_product_attention over each position's frames (Cosmos'
    CosmosTemporalAttentionProcessor2_0: tokens (B h w, heads, t, C / heads)) of queries, keys and values
    (src = (q, k, v)); `causal`: a frame attends to itself and the frames before it (its tril mask). The
    output back as (B, C, t, h, w). Local in space (no halo); it reads every frame of the step, so
    one-step programs only."""

    heads: int = 1
    causal: bool = True

    def _tokens(self, x):
        """(B, C, t, h, w) -> (B h w, heads, t, d)."""
        return x.permute(0, 3, 4, 2, 1).flatten(0, 2).unflatten(2, (self.heads, -1)).transpose(1, 2)

    def run(self, ctx, inputs, have, box, shapes):
        q, k, v = (sub_tensor(t, h, box) for t, h in zip(inputs, have, strict=True))
        b, _, t, h, w = q.shape
        mask = torch.tril(q.new_ones(t, t)).bool() if self.causal else None
        o = F.scaled_dot_product_attention(self._tokens(q), self._tokens(k), self._tokens(v), attn_mask=mask)
        o = o.transpose(1, 2).flatten(2, 3).type_as(q)
        return o.unflatten(0, (b, h, w)).permute(0, 4, 3, 1, 2)

    def out_channels(self, channels):
        return channels[2]

    def describe(self):
        mask = ", causal between frames" if self.causal else ""
        return f"attention over each position's frames, heads={self.heads}{mask}"


@dataclass
class FrameCat(Op):
    """Video values of one spatial shape concatenated along time (torch.cat(..., dim=2)): HunyuanVideo's
    upsampler resamples a value's first frame and its other frames apart and joins them."""

    kind = OpKind.CAT

    def frames(self, ts, step):
        return sum(ts)

    def run(self, ctx, inputs, have, box, shapes):
        return torch.cat([sub_tensor(t, h, box) for t, h in zip(inputs, have, strict=True)], dim=2)

    def describe(self):
        return f"cat {len(self.src)} along time"
