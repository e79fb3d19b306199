"""The primitive ops of a tile program and their locality, and how sync ops get their inputs.

A value is a (B, C, H, W) tensor. Every op knows, for an output box of its destination value, which box
of each source value it reads (`input_boxes`, unclipped: parts outside the image are the conv's zero
padding), and can compute any output box from source tensors that cover at least the clipped input
boxes (`run`). Running every op on the full box is the untiled forward; running it on a tile's box with
explicit zero padding only where the box leaves the image is what makes tiles exact at image borders.
`RunContext` says where the sync ops (GroupNorm statistics, attention keys and values) take theirs from.
(Every op here is the same three methods over the box arithmetic of `boxes`; a reader checks one op's
`input_boxes` against its `run` side by side.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..geometry import Box
from ..vocabulary import Vocabulary
from .affine import apply_affine, group_norm_affine
from .boxes import Upsampled, clip_box, sub_tensor, zero_pad
from .streamed_attention import heads_view, streamed_attention


class OpKind(Vocabulary):
    """What an op computes, as the engine dispatches on it (the 2-D ops here, the 3-D ones in `ops3d`)."""

    OP = "op"
    CONV = "conv"
    RESAMPLE = "resample"
    POINTWISE = "pointwise"
    ADD = "add"
    GROUP_NORM = "group_norm"
    ATTENTION = "attention"
    CONV3D = "conv3d"
    FRAME_CONV = "frame_conv"
    UPSAMPLE = "upsample"
    TIME_UP = "time_up"
    TIME_DOWN = "time_down"
    REARRANGE = "rearrange"
    COMBINE = "combine"
    CAT = "cat"
    SLICE = "slice"
    WHOLE = "whole"
    MODULE = "module"


@dataclass
class Op:
    """A primitive op reading values `src` and writing value `dst`; `name` is the module path."""

    src: tuple[str, ...]
    dst: str
    name: str

    sync = False  # needs the whole spatial domain (GroupNorm statistics, global attention)
    kind = OpKind.OP

    def out_shape(self, shapes: list[tuple[int, int]]) -> tuple[int, int]:
        """Spatial shape of dst from the shapes of src."""
        return shapes[0]

    def out_channels(self, channels: list[int]) -> int:
        """Channel count of dst from the channel counts of src."""
        return channels[0]

    def input_boxes(self, box: Box) -> list[Box]:
        """Unclipped box of each source needed to compute `box` of dst (identity for pointwise ops)."""
        return [box for _ in self.src]

    def run(self, ctx: RunContext, inputs: list[Any], have: list[Box], box: Box, shapes: list):
        """Compute `box` of dst from source tensors covering boxes `have`."""
        raise NotImplementedError

    def run_in_place(self, ctx: RunContext, inputs: list[Any], have: list[Box], box: Box, shapes: list):
        """`run`, allowed to overwrite inputs[0] (the caller's last use of it); same values. Ops that
        can (pointwise activations, GroupNorm in float32) save a tensor of working memory."""
        return self.run(ctx, inputs, have, box, shapes)

    def describe(self) -> str:
        """One line for the analysis table."""
        return self.kind


@dataclass
class Conv(Op):
    """2-D convolution, zero padding (top, bottom, left, right) made explicit per tile."""

    weight: Any = None
    bias: Any = None
    stride: tuple[int, int] = (1, 1)
    dilation: tuple[int, int] = (1, 1)
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)
    groups: int = 1
    padding_mode: str = "zeros"  # what the border pads with: zeros, "replicate" or "reflect" (F.pad's modes)
    kind = OpKind.CONV

    @property
    def kernel(self) -> tuple[int, int]:
        return int(self.weight.shape[-2]), int(self.weight.shape[-1])

    def out_shape(self, shapes):
        (h, w), (kh, kw) = shapes[0], self.kernel
        t, b, l, r = self.padding
        oh = (h + t + b - self.dilation[0] * (kh - 1) - 1) // self.stride[0] + 1
        ow = (w + l + r - self.dilation[1] * (kw - 1) - 1) // self.stride[1] + 1
        return oh, ow

    def out_channels(self, channels):
        return int(self.weight.shape[0])

    def input_boxes(self, box):
        y0, y1, x0, x1 = box
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        t, _, l, _ = self.padding
        return [(y0 * sh - t, (y1 - 1) * sh + dh * (kh - 1) + 1 - t,
                 x0 * sw - l, (x1 - 1) * sw + dw * (kw - 1) + 1 - l)]

    def run(self, ctx, inputs, have, box, shapes):
        if self._pointwise() and not isinstance(inputs[0], Upsampled):
            # a 1x1 projection needs no workspace: run it on the whole input as stored (cropping the
            # input first would copy it) and view the box out of the result

            y = F.conv2d(inputs[0], self.weight, self.bias, 1, 0, 1, self.groups)
            return sub_tensor(y, have[0], box)
        rows = box[1] - box[0]
        per_row = (box[3] - box[2]) * self.weight.shape[1] * self.kernel[0] * self.kernel[1] * 4
        band = max(1, ctx.conv_workspace // max(per_row, 1)) if ctx.conv_workspace else rows
        if band >= rows:
            return self._run_box(inputs[0], have[0], box, shapes[0])

        # row bands bound the im2col workspace of CPU convolutions; each output row is computed alike.
        # Bands are copied into one preallocated output (a list and torch.cat would hold it twice).
        out = None
        for y in range(box[0], box[1], band):
            part = self._run_box(inputs[0], have[0], (y, min(y + band, box[1]), box[2], box[3]), shapes[0])
            if out is None:
                fmt = torch.channels_last if part.dim() == 4 and part.stride(1) == 1 and part.shape[1] > 1 \
                    else torch.contiguous_format
                out = torch.empty((*part.shape[:-2], rows, part.shape[-1]), dtype=part.dtype,
                                  device=part.device, memory_format=fmt)
            out[..., y - box[0] : y - box[0] + part.shape[-2], :].copy_(part)
        return out

    def _pointwise(self) -> bool:
        """A 1x1 convolution with stride 1 and no padding (a per-pixel channel projection)."""
        return self.kernel == (1, 1) and self.stride == (1, 1) and not any(self.padding)

    def pads_itself(self, need: Box, inner: Box) -> bool:
        """Whether the convolution reading `need` (of which `inner` is in the image) pads itself: zeros,
        the same on both sides of each axis (else a padded copy is made first)."""
        return self.padding_mode == "zeros" and zero_pad(need, inner)[1]

    def _run_box(self, x, have, box, shape):
        need = self.input_boxes(box)[0]
        inner = clip_box(need, shape)
        x = sub_tensor(x, have, inner)
        pad, _ = zero_pad(need, inner)
        if self.pads_itself(need, inner):
            return F.conv2d(x, self.weight, self.bias, self.stride, (pad[2], pad[0]), self.dilation,
                            self.groups)
        # (a box leaves the image only where its crop reaches the border: replicating or reflecting the
        # crop there is the image's own padding; upsampled rows made by sub_tensor die here)
        if any(pad):
            x = F.pad(x, pad) if self.padding_mode == "zeros" else F.pad(x, pad, mode=self.padding_mode)
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)

    def describe(self):
        (kh, kw), t = self.kernel, self.padding
        mode = "" if self.padding_mode == "zeros" else f" {self.padding_mode}"
        return f"conv {kh}x{kw} s{self.stride[0]} d{self.dilation[0]} pad{t}{mode}"


@dataclass
class Resample(Op):
    """Nearest-neighbour upsampling by an integer factor (diffusers Upsample2D, TAESD nn.Upsample)."""

    scale: int = 2
    kind = OpKind.RESAMPLE

    def out_shape(self, shapes):
        return shapes[0][0] * self.scale, shapes[0][1] * self.scale

    def input_boxes(self, box):
        y0, y1, x0, x1 = box
        s = self.scale
        return [(y0 // s, (y1 - 1) // s + 1, x0 // s, (x1 - 1) // s + 1)]

    def run(self, ctx, inputs, have, box, shapes):
        return Upsampled(inputs[0], have[0], self.scale).crop(box, box)

    def lazy(self, inputs, have):
        """The output as an `Upsampled` (for a convolution that reads it band by band)."""
        return Upsampled(inputs[0], have[0], self.scale)

    def describe(self):
        return f"upsample x{self.scale} nearest"


@dataclass
class Pointwise(Op):
    """A per-position function (activation, affine rescale, TAESD clamp, channel-mixing 1x1 linear)."""

    fn: Callable | None = None
    label: str = ""
    channels: int | None = None
    fn_: Callable | None = None  # the in-place form of fn (same values), when there is one
    kernels: int = 1  # kernels one call launches (0: returns its input), as plans count them
    kind = OpKind.POINTWISE

    def out_channels(self, channels):
        return channels[0] if self.channels is None else self.channels

    def run(self, ctx, inputs, have, box, shapes):
        return self.fn(sub_tensor(inputs[0], have[0], box))

    def run_in_place(self, ctx, inputs, have, box, shapes):
        if self.fn_ is None:
            return self.run(ctx, inputs, have, box, shapes)
        return self.fn_(sub_tensor(inputs[0], have[0], box))

    def describe(self):
        return self.label or "pointwise"


@dataclass
class Add(Op):
    """Residual sum (a + b) / scale."""

    scale: float = 1.0
    kind = OpKind.ADD

    def run(self, ctx, inputs, have, box, shapes):
        y = sub_tensor(inputs[0], have[0], box) + sub_tensor(inputs[1], have[1], box)
        return y if self.scale == 1.0 else y / self.scale

    def run_in_place(self, ctx, inputs, have, box, shapes):
        y = sub_tensor(inputs[0], have[0], box).add_(sub_tensor(inputs[1], have[1], box))
        return y if self.scale == 1.0 else y.div_(self.scale)

    def describe(self):
        return "add" if self.scale == 1.0 else f"add /{self.scale:g}"


@dataclass
class GroupNorm(Op):
    """GroupNorm: a sync op, its statistics are per (batch, group) over the whole spatial domain."""

    groups: int = 32
    eps: float = 1e-6
    weight: Any = None
    bias: Any = None
    sync = True
    kind = OpKind.GROUP_NORM

    def run(self, ctx, inputs, have, box, shapes):
        x = sub_tensor(inputs[0], have[0], box)
        affine = ctx.group_affine(self, x, box, shapes[0])
        if affine is None:

            return F.group_norm(x, self.groups, self.weight, self.bias, self.eps)
        return apply_affine(x, affine)

    def run_in_place(self, ctx, inputs, have, box, shapes):
        x = sub_tensor(inputs[0], have[0], box)
        affine = ctx.group_affine(self, x, box, shapes[0])
        if affine is None:
            return self.run(ctx, inputs, have, box, shapes)
        return apply_affine(x, affine, out=x)  # (computed in float32, rounded once: any dtype)

    def affine(self, stats, x):
        """`group_norm_affine` of this GroupNorm's parameters for statistics `stats`, for values like x."""
        return group_norm_affine(stats, self.groups, self.eps, self.weight, self.bias, x.dtype, x.shape[1])

    def describe(self):
        return f"group_norm G={self.groups}"


@dataclass
class AttentionCore(Op):
    """diffusers Attention after its GroupNorm: q, k, v projections, softmax attention, out proj, residual.

    src = (normed, residual). Global by default: every query attends to every spatial token.
    """

    heads: int = 1
    to_q: Any = None
    to_k: Any = None
    to_v: Any = None
    to_out: Any = None
    residual: bool = True
    rescale: float = 1.0
    sync = True
    kind = OpKind.ATTENTION

    def run(self, ctx, inputs, have, box, shapes):
        n = sub_tensor(inputs[0], have[0], box)
        k, v = ctx.attention_kv(self, n, box)
        # a new tensor: the residual adds in place
        y = self.attend(n, k, v, chunk=ctx.query_chunk, kv_chunk=ctx.kv_chunk)
        if self.residual:
            y = y.add_(sub_tensor(inputs[1], have[1], box))
        return y.div_(self.rescale) if self.rescale != 1.0 else y

    def keys_values(self, n):
        """(B, N, C) keys and values of the tokens of n (B, C, h, w)."""
        t = n.flatten(2).transpose(1, 2)
        return self.to_k(t), self.to_v(t)

    def _heads(self, t):
        return heads_view(t, self.heads)

    def attend(self, n, k, v, chunk: int = 4096, kv_chunk: int = 0):
        """Queries of n (B, C, h, w) attend to the (B, N, C) tokens k, v; to_out(attn) as (B, C, h, w).

        kv_chunk 0: fused attention in query chunks, k and v on the device. kv_chunk > 0: k and v read
        that many tokens at a time, from the host or the device (`streamed_attention`, exact)."""

        b, c, h, w = n.shape
        q = self._heads(self.to_q(n.flatten(2).transpose(1, 2)))
        if kv_chunk:

            o = streamed_attention(q, k, v, self.heads, chunk, kv_chunk)
        else:
            k, v = self._heads(k), self._heads(v)
            outs = [F.scaled_dot_product_attention(q[:, :, i : i + chunk], k, v)
                    for i in range(0, q.shape[2], chunk)]
            o = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
        o = o.transpose(1, 2).reshape(b, h * w, -1).to(q.dtype)
        return self.to_out[1](self.to_out[0](o)).transpose(1, 2).reshape(b, -1, h, w)

    def describe(self):
        return f"attention heads={self.heads}"


@dataclass
class RunContext:
    """How sync ops behave during a run: GroupNorm statistics and attention keys/values."""

    stats: dict[int, Any] = field(default_factory=dict)  # id(op) -> (mean, var) to apply; absent -> native
    kv: dict[int, Any] = field(default_factory=dict)  # id(op) -> (k, v); absent -> keys of the box itself
    query_chunk: int = 4096
    kv_chunk: int = 0  # attention keys / values read this many tokens at a time (0: all at once)
    conv_workspace: int = 0  # bytes of im2col workspace one conv call may use (0: unbounded)

    def group_stats(self, op, x, box, shape):
        """The statistics to apply for a GroupNorm op, or None for torch's own over x."""
        return self.stats.get(id(op))

    def group_affine(self, op, x, box, shape):
        """The per-channel affine (a, s) of a GroupNorm op with known statistics, or None for torch's own
        over x (`group_norm_affine`: computed from group_stats on every call; the executor keeps it)."""
        stats = self.group_stats(op, x, box, shape)
        return None if stats is None else op.affine(stats, x)

    def attention_kv(self, op, n, box):
        """Keys and values the queries of box attend to."""
        kv = self.kv.get(id(op))
        return kv if kv is not None else op.keys_values(n)
