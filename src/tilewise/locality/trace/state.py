"""The state one traced lowering shares between its rules and its measured fallback, and the small
helpers they read calls with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..build import Builder, LoweringError
from ..units import CHANNEL_ATTENTION, FRAME_ATTENTION
from .capture import Call, Capture, Ref


@dataclass
class Value:
    """What the lowering knows of a captured node: its value name in the program, if spatial."""

    name: str | None = None
    channels: int = 0


@dataclass
class Lowering:
    """The state of one traced lowering."""

    cap: Capture
    root: torch.nn.Module
    b: Builder = field(default_factory=Builder)
    values: dict[int, Value] = field(default_factory=dict)  # node -> what it is
    pads: dict[int, tuple] = field(default_factory=dict)  # F.pad's output -> (input, pad, mode)
    tainted: set[int] = field(default_factory=set)  # nodes that depend on the input
    readers: dict[int, int] = field(default_factory=dict)  # node -> calls reading it
    # video values (B, C, T, H, W): node -> (source node, start, stop, repeats): frames [start:stop] of the
    # source repeated; node -> (source node, front, back): the source with its first frame repeated front
    # times before it and its last back times after it (a causal convolution's padding, `trace.video`)
    frame_refs: dict[int, tuple] = field(default_factory=dict)
    tpads: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    # node -> (source node, n): the source with n frames an earlier call of a causal loop cached in front
    # (a convolution's causal padding read from the step before, `trace.video_caches`)
    caches: dict[int, tuple[int, int]] = field(default_factory=dict)
    # node -> (source node, k, parts): part k of a split of the source's frames (its first frame and the
    # others), kept through calls that keep it a part (`trace.video`: such parts concatenate back)
    frame_parts: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    # node -> (layout, video value name, first row, end row, the permuted shape, the fold): a video value
    # with axes folded into the batch on its way to and from a row computation, "first" (permuted: (B, T,
    # C, H, W), ...) or "batch" (rows [first, end) of (B T, C, H, W), ...); a row computation's key -> the
    # output of its op (a FrameGroupNorm, a ColumnAttention: `trace.video_fold`)
    folds: dict[int, tuple] = field(default_factory=dict)
    row_ops: dict[tuple, str] = field(default_factory=dict)
    # node -> (padded node, start, stop): frames of a padded video value; node -> (conv3d call, source node,
    # start, stop): a convolution of such a window, or of a slice of a video value (`trace.video_windows`)
    windows: dict[int, tuple] = field(default_factory=dict)
    window_convs: dict[int, tuple] = field(default_factory=dict)
    # node -> (padded node, n): a padded video value's first frame repeated n times (expanded); (padded
    # node, n) -> the node of that value with them in front, a padding in time (`trace.video_writes`);
    # node -> [(start, stop, node)]: a buffer (torch.empty) of video frames written in part
    fronts: dict[int, tuple[int, int]] = field(default_factory=dict)
    fronted: dict[tuple[int, int], int] = field(default_factory=dict)
    writes: dict[int, list] = field(default_factory=dict)
    # node -> (batched node, g): its channels viewed in groups of g; node -> (video value name, layout): its
    # positions in the batch, each position's frames a row (`trace.video_pools`)
    groups: dict[int, tuple[int, int]] = field(default_factory=dict)
    columns: dict[int, tuple[str, str]] = field(default_factory=dict)
    squeezed: set[int] = field(default_factory=set)  # one-frame video values squeezed to (B, C, H, W)
    # node -> video value name: the traced batch's one sample of it, (C, T, H, W) (`trace.video_samples`)
    samples: dict[int, str] = field(default_factory=dict)
    # node -> (B, T): a video value's frames folded into the batch ((B T, C, H, W) as captured, carried as
    # the (B, C, T, H, W) value) for a 2-D computation of each frame (`trace.video_batch`); an F.pad's
    # output of one too
    batched: dict[int, tuple[int, int]] = field(default_factory=dict)
    # node -> (video value name, layout): a video value's tokens, "channels_last" (B, T, H, W, C) or
    # "flat" (B, T H W, C), on their way to and from an Attention unit (`trace.video_tokens`)
    tokens: dict[int, tuple[str, str]] = field(default_factory=dict)
    # node -> (video value name, its axes as groups of (B, C, T, H, W, N, D), their sizes): a video value's
    # tokens on their way to and from a scaled_dot_product_attention (`trace.video_sdpa`)
    sdpa: dict[int, tuple] = field(default_factory=dict)
    # one-frame values of a 2-D program ((B, C, 1, H, W) as captured, carried as (B, C, H, W): an image VAE
    # in a video's layout, `trace.frames`)
    framed: set[int] = field(default_factory=set)
    live: set[int] = field(default_factory=set)  # the calls the output depends on (`capture.needed`)
    skip: set[int] = field(default_factory=set)  # calls an op placed already placed (`trace.video_rows`)
    per_call: Any = None  # values the call computes from its other inputs (`percall.CallValues`), or None

    def spatial(self, node: int) -> str | None:
        v = self.values.get(node)
        return v.name if v is not None else None

    def set(self, node: int, name: str) -> None:
        self.values[node] = Value(name, int(self.cap.values[node].shape[1]))
        if self.one_frame(self.cap.values[node]):
            self.framed.add(node)  # (a 2-D program's value with its one frame: carried without it)

    def value(self, node: int) -> torch.Tensor:
        """A non-spatial node's tensor when an op runs: a per-call value of the running call, or the
        captured constant."""
        pc = self.per_call
        if pc is not None and node in pc.nodes:
            return pc.value(node)
        t = self.cap.values[node]
        return self._computed(node) if t.device.type == "meta" and node in self.cap.producer else t

    def _computed(self, node: int) -> torch.Tensor:
        """A constant a recorded call made from parameters and buffers (`sigmoid(mix_factor)`: no value
        of it was recorded, the trace ran on meta tensors): its calls replayed as the op runs, so it
        follows the parameters (and their gradients) as the module would."""
        call = self.cap.calls[self.cap.producer[node]]
        device = next((p.device for p in self.root.parameters()), torch.device("cpu"))

        def bind(obj):
            if isinstance(obj, Ref):
                return self.value(obj.node)
            if isinstance(obj, torch.device) and obj.type == "meta":
                return device
            if isinstance(obj, dict):
                return {k: bind(v) for k, v in obj.items()}
            if isinstance(obj, list | tuple):
                return type(obj)(bind(v) for v in obj)
            return obj

        out = call.func(*bind(call.args), **bind(call.kwargs))
        outs = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
        return outs[call.outs.index(node)]

    def carried(self, node: int) -> torch.Tensor:
        """A node's captured value as the program carries it (a one-frame value without its frame, a video
        value's frames in the batch as that video value)."""
        t = self.cap.values[node]
        if node in self.batched:  # (a video value's frames in the batch: the video value it is)
            (b, f), (_, c, h, w) = self.batched[node], t.shape
            return torch.empty((b, c, f, h, w), device="meta", dtype=t.dtype)
        return t.squeeze(2) if node in self.framed or self.one_frame(t) else t

    def one_frame(self, t: torch.Tensor) -> bool:
        """Whether a captured tensor is a one-frame value (B, C, 1, H, W) of a 2-D program."""
        return t.ndim == 5 and t.shape[2] == 1 and self.cap.values[self.cap.input].ndim == 4


def tainted(cap: Capture) -> set[int]:
    """The nodes that depend on the capture's inputs (the others are constants of the computation)."""
    out = set(cap.inputs)
    for call in cap.calls:
        if out.intersection(call.refs()):
            out.update(call.outs)
    return out


def refused(low: Lowering, call: Call, why: str, final: bool = False) -> LoweringError:
    """The error refusing a call, naming it, its module path and why; `final`: no measurement of the
    module around it may place it either (a random draw), the driver raises it as it is."""
    where = call.where or "(its forward)"
    e = LoweringError(f"cannot lower {type(low.root).__name__}: the call {call.name!r} at {where!r}: {why}. "
                      "Use tilewise.probe_receptive_field(module, example) to measure its locality "
                      "empirically.")
    e.final = final
    return e


def op_name(call: Call, what: str) -> str:
    return f"{call.where}.{what}" if call.where else what


def arg_of(call: Call, i: int, name: str, default=None):
    """Argument i (or keyword `name`) of a call."""
    if len(call.args) > i:
        return call.args[i]
    return call.kwargs.get(name, default)


def permutation(call: Call) -> tuple:
    """The dims of a permute call (given one by one or as a sequence)."""
    dims = tuple(call.args[1:]) if len(call.args) > 2 else arg_of(call, 1, "dims")
    return tuple(dims or ())


def const_value(low: Lowering, a):
    """A non-spatial argument's value: a constant's tensor, or the plain value (LoweringError for a value
    the call computes from its per-call inputs: only ops that replay their call read those)."""
    if isinstance(a, Ref) and low.per_call is not None and a.node in low.per_call.nodes:
        raise LoweringError(f"cannot lower {type(low.root).__name__}: a weight computed from the call's "
                            f"{', '.join(low.per_call.names)} (only elementwise uses of such values are "
                            "placed)")
    return low.cap.values[a.node] if isinstance(a, Ref) else a


def channel_dim(dim, ndim: int) -> bool:
    """Whether `dim` is the channel axis of a value with ndim axes ((B, C, H, W) or (B, C, T, H, W))."""
    return isinstance(dim, int) and dim in (1, 1 - ndim)


def is_attention(m) -> bool:
    """Whether a module is lowered as one unit (`units`): diffusers' Attention, Qwen-Image 2.1's, Wan's and
    Qwen-Image's attention blocks."""
    return type(m).__module__.startswith("diffusers") and (
        type(m).__name__ == "Attention" or type(m).__name__ in CHANNEL_ATTENTION + FRAME_ATTENTION)


def reaches(low: Lowering, i: int, node: int, name: str, depth: int = 4) -> bool:
    """Whether a call named `name` reads node or what the next calls make of it (up to `depth` calls)."""
    nodes = {node}
    for c in low.cap.calls[i + 1 :]:
        if nodes & set(c.refs()):
            if c.name == name:
                return True
            nodes.update(c.outs)
            depth -= 1
            if depth < 0:
                return False
    return False
