"""The lowerings of modules a traced lowering takes whole (its units), and of single layers.

- `attention`: diffusers' `Attention` (AttnProcessor / AttnProcessor2_0, FusedAttnProcessor2_0): its
  GroupNorm and an `AttentionCore`, whose queries run in the tiles and whose keys and values are those of
  every token (global attention, exact).
- `conv`, `group_norm`: one nn.Conv2d with zero padding, one nn.GroupNorm.

diffusers' classes are imported inside `attention` (importing diffusers takes ~4 s).
"""

from __future__ import annotations

import torch.nn as nn

from .build import Builder, unsupported
from .ops import AttentionCore, Conv, GroupNorm


def conv(b: Builder, layer, x: str, where: str, padding: tuple[int, int, int, int] | None = None) -> str:
    """nn.Conv2d with zero padding (or the explicit asymmetric padding given)."""
    if type(layer) is not nn.Conv2d or layer.padding_mode != "zeros" or isinstance(layer.padding, str):
        raise unsupported(layer, where)
    if padding is None:
        ph, pw = layer.padding
        padding = (ph, ph, pw, pw)
    return b.emit(Conv, (x,), where, weight=layer.weight, bias=layer.bias, stride=tuple(layer.stride),
                  dilation=tuple(layer.dilation), padding=padding, groups=layer.groups)


def group_norm(b: Builder, norm, x: str, where: str) -> str:
    if type(norm) is not nn.GroupNorm:
        raise unsupported(norm, where)
    return b.emit(GroupNorm, (x,), where, groups=norm.num_groups, eps=norm.eps,
                  weight=norm.weight if norm.affine else None, bias=norm.bias if norm.affine else None)


def check_attention(a) -> str:
    """Why diffusers Attention `a` is not one `attention` lowers (its processor, q / k norms, cross
    attention, a scale other than d^-1/2), or ""."""
    from diffusers.models.attention_processor import (
        Attention,
        AttnProcessor,
        AttnProcessor2_0,
        FusedAttnProcessor2_0,
    )

    if type(a) is not Attention or type(a.processor) not in (AttnProcessor, AttnProcessor2_0,
                                                              FusedAttnProcessor2_0):
        return f"an Attention with processor {type(getattr(a, 'processor', a)).__name__}"
    if a.norm_q is not None or a.norm_k is not None or a.is_cross_attention:
        return "an Attention with query / key norms or cross attention"
    if abs(a.scale - (a.inner_dim // a.heads) ** -0.5) > 1e-12:
        return f"an Attention with scale {a.scale} (not head_dim^-1/2)"
    if a.spatial_norm is not None:
        return "an Attention with a spatial norm"
    return ""


def attention(b: Builder, a, x: str, where: str, normed: str | None = None) -> str:
    """diffusers Attention (AttnProcessor / AttnProcessor2_0, self-attention over spatial tokens; with
    FusedAttnProcessor2_0 the same attention from one fused projection: its to_q / to_k / to_v remain).
    `normed`: its spatial norm's output, lowered by the caller (None: it has none)."""
    from diffusers.models.attention_processor import (
        Attention,
        AttnProcessor,
        AttnProcessor2_0,
        FusedAttnProcessor2_0,
    )

    if type(a) is not Attention or type(a.processor) not in (AttnProcessor, AttnProcessor2_0,
                                                              FusedAttnProcessor2_0):
        raise unsupported(a.processor if type(a) is Attention else a, where)
    if (a.spatial_norm is not None) != (normed is not None):
        raise unsupported(a, where, "its spatial norm needs the latent it is conditioned on")
    if a.norm_q is not None or a.norm_k is not None or a.is_cross_attention:
        raise unsupported(a, where)
    if abs(a.scale - (a.inner_dim // a.heads) ** -0.5) > 1e-12:
        raise unsupported(a, where)
    n = normed or x
    if a.group_norm is not None:
        n = group_norm(b, a.group_norm, x, f"{where}.group_norm")
    return b.emit(AttentionCore, (n, x), where, heads=a.heads, to_q=a.to_q, to_k=a.to_k, to_v=a.to_v,
                  to_out=a.to_out, residual=bool(a.residual_connection),
                  rescale=float(a.rescale_output_factor))
