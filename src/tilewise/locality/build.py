"""What every lowering shares: the op builder, the error for unknown module types, activation functions.

`units` (the layers a traced lowering takes whole) and the hand lowerings the tests keep as oracles
build their ops with these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch.nn as nn
import torch.nn.functional as F

from .ops import Op, Pointwise

KNOWN = ("the layers a traced lowering takes whole (diffusers' Attention, the Qwen-Image and Wan attention "
         "blocks, nn.Conv2d, nn.GroupNorm); everything else is traced from what it computes")


class LoweringError(ValueError):
    """The module contains a type this lowering does not know."""


class Builder:
    """Accumulates ops and hands out fresh value names."""

    def __init__(self):
        self.ops: list[Op] = []
        self.count = 0

    def emit(self, cls, src: tuple[str, ...], name: str, **kw) -> str:
        self.count += 1
        dst = f"v{self.count}"
        self.ops.append(cls(src=src, dst=dst, name=name, **kw))
        return dst


def unsupported(module, where: str, why: str = "") -> LoweringError:
    """The error for a module type (or a setting of one) no lowering knows."""
    because = f" ({why})" if why else ""
    return LoweringError(
        f"cannot lower {type(module).__name__} at {where!r} into a tile program{because}; known types: "
        f"{KNOWN}. Use tilewise.probe_receptive_field(module, example) to measure its locality empirically."
    )


class Activation(NamedTuple):
    """A per-position function, its label in the analysis table, and the kernels one call launches (a
    plan counts them: `vae.plan.counts`)."""

    fn: Callable
    label: str
    kernels: int = 1


def activation(module, where: str) -> Activation:
    """Map an activation module to a function."""
    table = {nn.SiLU: Activation(F.silu, "silu"), nn.ReLU: Activation(F.relu, "relu"),
             nn.Mish: Activation(F.mish, "mish"), nn.GELU: Activation(F.gelu, "gelu"),
             nn.Identity: Activation(lambda x: x, "identity", kernels=0)}
    for cls, act in table.items():
        if type(module) is cls:
            if cls is nn.GELU and module.approximate != "none":
                return Activation(lambda x: F.gelu(x, approximate=module.approximate), "gelu tanh")
            return act
    raise unsupported(module, where)


def in_place(fn: Callable) -> Callable | None:
    """The in-place form of an activation function (same values), or None when torch has none."""
    if fn in (F.silu, F.relu, F.mish):
        return lambda x: fn(x, inplace=True)
    return None


def pointwise(b: Builder, act: Activation, x: str, where: str) -> str:
    """A per-position function (with its in-place form when torch has one)."""
    return b.emit(Pointwise, (x,), where, fn=act.fn, label=act.label, kernels=act.kernels,
                  fn_=in_place(act.fn))


def mid_block(b: Builder, m, x: str, where: str, resnet: Callable, attention: Callable,
              strict: bool = True) -> str:
    """A diffusers mid block (UNetMidBlock2D, WanMidBlock): resnet, then (attention, resnet) pairs; an
    attention of None is skipped, as their forwards do (strict=False: as many pairs as zip makes)."""
    x = resnet(b, m.resnets[0], x, f"{where}.resnets.0")
    for i, (attn, res) in enumerate(zip(m.attentions, m.resnets[1:], strict=strict)):
        if attn is not None:
            x = attention(b, attn, x, f"{where}.attentions.{i}")
        x = resnet(b, res, x, f"{where}.resnets.{i + 1}")
    return x
