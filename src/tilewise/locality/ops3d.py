"""Ops of video tile programs: values are the frames of one causal step, (B, C, t, H, W); boxes stay spatial.

A 3-D causal VAE (Qwen-Image, Wan 2.x, LTX-Video) runs its frames in causal steps, the model's own
chunks. Every op here computes its output box for one step's frames with the `Op` interface of the 2-D
ops (`input_boxes`, `run`, out_shape / out_channels: spatial, so halos, segments and the analysis are
those of 2-D programs), and `frames(ts, step)` says how many frames it makes of its inputs' frame
counts. A temporal op reads the frames before the step from its cache in `StepContext`: exactly the
frames it reads back (2 for Wan's 3x3x3 convolutions, the last one for its temporal downsampling), over
the box it reads, so each tile carries the cache of its own boxes. Per-frame attention is a sync op
over the tokens of one frame; the sync ops over every frame of a step (a video GroupNorm, attention over
the step's tokens) are in `ops3d_sync`. The 2-D `Pointwise` and `Add` ops work on these values as they
are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .boxes import box_area, clip_box, sub_tensor
from .ops import Op, OpKind, Resample, RunContext


def frames_of(op: Op, ts: list[int], step: int) -> int:
    """Frames op makes in step `step` from sources of ts frames (ops without a `frames` keep them)."""
    fn = getattr(op, "frames", None)
    return fn(ts, step) if fn is not None else ts[0]


def fold(x):
    """(B, C, t, h, w) -> (B t, C, h, w), frames into the batch as diffusers' Wan blocks do."""
    b, c, t, h, w = x.shape
    return x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)


def unfold(y, b: int, t: int):
    """(B t, C, h, w) -> (B, C, t, h, w), the inverse of fold (a permuted view)."""
    return y.view(b, t, *y.shape[1:]).permute(0, 2, 1, 3, 4)


@dataclass
class StepContext(RunContext):
    """RunContext of one causal step: which step runs, and the temporal caches of the boxes it runs on.

    `caches` maps id(op) -> (box, frames): one tile's caches (the executor swaps in each tile's dict;
    the untiled run has one). On the last step nothing is kept (no later step reads it)."""

    step: int = 0
    last: bool = False
    caches: dict[int, Any] = field(default_factory=dict)
    cache_device: Any = None  # where caches are kept (None: where they are made)

    def cached(self, op: Op, box, device):
        """The frames op kept over `box` in the step before (on `device`), or None before any."""
        hit = self.caches.get(id(op))
        if hit is None:
            return None
        if hit[0] != box:
            raise AssertionError(f"{op.name}: cache kept over {hit[0]}, read over {box}")
        return hit[1].to(device, non_blocking=True)

    def keep(self, op: Op, box, frames) -> None:
        """Keep `frames` (copied) as op's cache over `box` for the next step."""
        if self.last:
            return
        if self.cache_device is not None and frames.device != self.cache_device:
            self.caches[id(op)] = (box, frames.to(self.cache_device))
        else:
            self.caches[id(op)] = (box, frames.clone())


@dataclass
class CausalConv3d(Op):
    """3-D convolution causal in time: spatial padding per tile (as `Conv`: zeros, or the border
    replicated or reflected with padding_mode="replicate" / "reflect", LTX-2's decoder); in time the
    `pad_t` frames before the step come from the cache (before the first: zeros, or the first frame
    repeated with fill="first", LTX-Video), `pad_end` frames after it repeat the last (LTX-Video's
    non-causal decoder, which runs in one step) or are zeros (fill_end="zeros")."""

    weight: Any = None
    bias: Any = None
    stride: tuple[int, int] = (1, 1)  # spatial (the analysis reads stride as spatial)
    stride_t: int = 1
    dilation_t: int = 1
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)  # spatial (top, bottom, left, right)
    pad_t: int = 0
    pad_end: int = 0
    fill: str = "zeros"
    groups: int = 1
    fill_end: str = "last"
    padding_mode: str = "zeros"
    cached: int = 0  # (of pad_t: frames the traced call of a causal loop read from an earlier call's cache)
    kind = OpKind.CONV3D

    @property
    def kernel(self) -> tuple[int, int]:
        return int(self.weight.shape[-2]), int(self.weight.shape[-1])

    def out_shape(self, shapes):
        (h, w), (kh, kw) = shapes[0], self.kernel
        t, b, l, r = self.padding
        return (h + t + b - kh) // self.stride[0] + 1, (w + l + r - kw) // self.stride[1] + 1

    def out_channels(self, channels):
        return int(self.weight.shape[0])

    def frames(self, ts, step):
        kt = int(self.weight.shape[2])
        return (ts[0] + self.pad_t + self.pad_end - self.dilation_t * (kt - 1) - 1) // self.stride_t + 1

    def input_boxes(self, box):
        y0, y1, x0, x1 = box
        (kh, kw), (sh, sw) = self.kernel, self.stride
        t, _, l, _ = self.padding
        return [(y0 * sh - t, (y1 - 1) * sh + kh - t, x0 * sw - l, (x1 - 1) * sw + kw - l)]

    def cache_elems(self, box, shapes, channels: int, step: int) -> int:
        """Elements (per batch item) of the cache held after `step` for output box `box`."""
        return self.pad_t * channels * box_area(clip_box(self.input_boxes(box)[0], shapes[0]))

    def run(self, ctx, inputs, have, box, shapes):
        need = self.input_boxes(box)[0]
        inner = clip_box(need, shapes[0])
        x = sub_tensor(inputs[0], have[0], inner)
        if self.pad_t:
            prev = ctx.cached(self, inner, x.device)
            if prev is None:
                shape = (x.shape[0], x.shape[1], self.pad_t, *x.shape[3:])
                prev = x[:, :, :1].expand(shape) if self.fill == "first" else x.new_zeros(shape)
            x = torch.cat([prev, x], dim=2)
            del prev  # (what is made here dies as soon as the next copy is made: nothing holds it)
            ctx.keep(self, inner, x[:, :, -self.pad_t:] if self.stride_t == 1 else x[:, :, self._read(x):])
        if self.pad_end:
            end = (x[:, :, -1:].expand(-1, -1, self.pad_end, -1, -1) if self.fill_end == "last"
                   else x.new_zeros((*x.shape[:2], self.pad_end, *x.shape[3:])))
            x = torch.cat([x, end], dim=2)
            del end  # (a view of the copy before: it would hold it through the convolution)
        pad = (inner[2] - need[2], need[3] - inner[3], inner[0] - need[0], need[1] - inner[1])
        if any(pad):  # (at the image's border only: a replicated crop there is the image's own padding)
            x = F.pad(x, pad) if self.padding_mode == "zeros" else F.pad(x, (*pad, 0, 0),
                                                                          mode=self.padding_mode)
        return F.conv3d(x, self.weight, self.bias, (self.stride_t, *self.stride), 0, (self.dilation_t, 1, 1),
                        self.groups)

    def _read(self, x) -> int:
        """The frames of a padded step input a strided convolution is done with: up to its next window's
        start (the cache the next step reads: KVAE's stride-2 causal convolution over calls of odd and
        even frames; `frames` counts pad_t of them, exact where the count of outputs is the same)."""
        ext = self.dilation_t * (int(self.weight.shape[2]) - 1) + 1
        return max((x.shape[2] - ext) // self.stride_t + 1, 0) * self.stride_t

    def describe(self):
        kt, (kh, kw) = int(self.weight.shape[2]), self.kernel
        cache = f" cache {self.pad_t}" if self.pad_t else ""
        mode = "" if self.padding_mode == "zeros" else f" {self.padding_mode}"
        return f"conv3d {kt}x{kh}x{kw} s{self.stride_t},{self.stride[0]} pad{self.padding}{mode}{cache}"


@dataclass
class FrameConv(Op):
    """A 2-D convolution on every frame (WanResample's nn.Conv2d; the conv2d of a video value's frames in
    the batch, `trace.video_batch`), its padding (zeros, or the border replicated or reflected with
    padding_mode) made explicit per tile."""

    weight: Any = None
    bias: Any = None
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)
    groups: int = 1
    padding_mode: str = "zeros"
    kind = OpKind.FRAME_CONV

    @property
    def kernel(self) -> tuple[int, int]:
        return int(self.weight.shape[-2]), int(self.weight.shape[-1])

    out_shape = CausalConv3d.out_shape
    out_channels = CausalConv3d.out_channels
    input_boxes = CausalConv3d.input_boxes

    def run(self, ctx, inputs, have, box, shapes):
        need = self.input_boxes(box)[0]
        inner = clip_box(need, shapes[0])
        x = sub_tensor(inputs[0], have[0], inner)
        b, t = x.shape[0], x.shape[2]
        x = fold(x)
        pad = (inner[2] - need[2], need[3] - inner[3], inner[0] - need[0], need[1] - inner[1])
        if any(pad):  # (at the image's border only, as CausalConv3d's)
            x = F.pad(x, pad) if self.padding_mode == "zeros" else F.pad(x, pad, mode=self.padding_mode)
        return unfold(F.conv2d(x, self.weight, self.bias, self.stride, 0, 1, self.groups), b, t)

    def describe(self):
        (kh, kw) = self.kernel
        mode = "" if self.padding_mode == "zeros" else f" {self.padding_mode}"
        return f"conv {kh}x{kw} per frame s{self.stride[0]} pad{self.padding}{mode}"


@dataclass
class FrameUpsample(Op):
    """Nearest upsampling of every frame by an integer factor (WanUpsample, nearest-exact x2: for an
    integer factor output pixel i reads input pixel i // scale, so a crop upsamples to the crop)."""

    scale: int = 2
    module: Any = None  # the upsampling module, run on folded frames
    kind = OpKind.UPSAMPLE

    out_shape = Resample.out_shape
    input_boxes = Resample.input_boxes

    def run(self, ctx, inputs, have, box, shapes):
        need = self.input_boxes(box)[0]
        x = sub_tensor(inputs[0], have[0], need)
        b, t, s = x.shape[0], x.shape[2], self.scale
        y = unfold(self.module(fold(x)), b, t)
        return sub_tensor(y, (need[0] * s, need[1] * s, need[2] * s, need[3] * s), box)

    def describe(self):
        return f"upsample x{self.scale} per frame"


@dataclass
class TimeUp(Op):
    """Wan's temporal x2 upsampling (WanResample "upsample3d"): a causal (3, 1, 1) convolution to 2C
    channels makes two frames of every frame after the first step; the first step's frames pass as they
    are (diffusers' "Rep" cache marker), and the step after it pads with zeros."""

    weight: Any = None
    bias: Any = None
    kind = OpKind.TIME_UP

    def frames(self, ts, step):
        return ts[0] if step == 0 else 2 * ts[0]

    def cache_elems(self, box, shapes, channels: int, step: int) -> int:
        """Elements (per batch item) of the cache held after `step` (none before the second step)."""
        return 2 * channels * box_area(box) if step >= 1 else 0

    def run(self, ctx, inputs, have, box, shapes):
        x = sub_tensor(inputs[0], have[0], box)
        if ctx.step == 0:
            return x
        b, c, t, h, w = x.shape
        prev = ctx.cached(self, box, x.device)
        x = torch.cat([x.new_zeros((b, c, 2, h, w)) if prev is None else prev, x], dim=2)
        ctx.keep(self, box, x[:, :, -2:])
        y = F.conv3d(x, self.weight, self.bias).reshape(b, 2, c, t, h, w)
        return torch.stack((y[:, 0], y[:, 1]), 3).reshape(b, c, t * 2, h, w)

    def describe(self):
        return "time x2 (causal conv 3x1x1, cache 2)"


@dataclass
class TimeDown(Op):
    """Wan's temporal /2 downsampling (WanResample "downsample3d"): after the first step a (3, 1, 1)
    convolution with stride 2 over the cached last frame of the step before and the step's frames."""

    weight: Any = None
    bias: Any = None
    kind = OpKind.TIME_DOWN

    def frames(self, ts, step):
        return ts[0] if step == 0 else (ts[0] + 1 - 3) // 2 + 1

    def cache_elems(self, box, shapes, channels: int, step: int) -> int:
        """Elements (per batch item) of the cache held after `step`: the last frame."""
        return channels * box_area(box)

    def run(self, ctx, inputs, have, box, shapes):
        x = sub_tensor(inputs[0], have[0], box)
        prev = ctx.cached(self, box, x.device)
        ctx.keep(self, box, x[:, :, -1:])
        if ctx.step == 0:
            return x
        return F.conv3d(torch.cat([prev, x], dim=2), self.weight, self.bias, (2, 1, 1))

    def describe(self):
        return "time /2 (conv 3x1x1 s2, cache 1)"


@dataclass
class Rearrange(Op):
    """A block rearrangement between space, time and channels (patchify, AvgDown3D, DupUp3D, pixel
    (un)shuffles): with `down` d an output pixel reads the d x d input pixels it packs, with `up` u it
    reads input pixel y // u. fn(x, ctx) is the module's own code, run on a crop aligned to the blocks."""

    fn: Callable | None = None
    down: int = 1
    up: int = 1
    channels: int | None = None
    frames_fn: Callable | None = None  # (t, step) -> frames made; None keeps them
    label: str = ""
    kind = OpKind.REARRANGE

    @property
    def stride(self) -> tuple[int, int]:
        return self.down, self.down

    def out_shape(self, shapes):
        h, w = shapes[0]
        return h // self.down * self.up, w // self.down * self.up

    def out_channels(self, channels):
        return channels[0] if self.channels is None else self.channels

    def frames(self, ts, step):
        return ts[0] if self.frames_fn is None else self.frames_fn(ts[0], step)

    def input_boxes(self, box):
        y0, y1, x0, x1 = box
        d, u = self.down, self.up
        return [(y0 * d // u, -(-y1 * d // u), x0 * d // u, -(-x1 * d // u))]

    def run(self, ctx, inputs, have, box, shapes):
        need = self.input_boxes(box)[0]
        y = self.fn(sub_tensor(inputs[0], have[0], need), ctx)
        u = self.up
        if u == 1:
            return y
        return sub_tensor(y, (need[0] * u, need[1] * u, need[2] * u, need[3] * u), box)

    def describe(self):
        return self.label or "rearrange"


@dataclass
class FrameAttention(Op):
    """Wan / Qwen-Image attention block after its RMS norm: one head over the tokens of each frame
    (to_qkv 1x1, softmax attention, proj 1x1) plus the residual. src = (normed, residual). A sync op:
    every query attends to every token of its frame."""

    to_qkv: Any = None
    proj: Any = None
    sync = True
    kind = OpKind.ATTENTION

    def _project(self, n, part: int):
        """Queries (0), keys (1) or values (2) of n (B, C, t, h, w) as (B t, 1, h w, C): to_qkv's rows."""

        c = n.shape[1]
        rows = slice(part * c, (part + 1) * c)
        w, b = self.to_qkv.weight[rows], self.to_qkv.bias
        y = F.conv2d(fold(n), w, None if b is None else b[rows])
        return y.flatten(2).transpose(1, 2).unsqueeze(1)

    def keys_values(self, n):
        """(B t, 1, N, C) keys and values of the tokens of n, frame by frame."""
        return self._project(n, 1), self._project(n, 2)

    def attend(self, n, k, v, chunk: int = 4096):
        """Queries of n (B, C, t, h, w) attend to k, v of their frame in query chunks; proj(attn)."""

        b, c, t, h, w = n.shape
        q = self._project(n, 0)
        outs = [F.scaled_dot_product_attention(q[:, :, i : i + chunk], k, v)
                for i in range(0, q.shape[2], chunk)]
        o = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
        o = o.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w)
        return unfold(self.proj(o), b, t)

    def run(self, ctx, inputs, have, box, shapes):
        n = sub_tensor(inputs[0], have[0], box)
        k, v = ctx.attention_kv(self, n, box)
        return self.attend(n, k, v, ctx.query_chunk) + sub_tensor(inputs[1], have[1], box)

    def describe(self):
        return "attention per frame, 1 head"
