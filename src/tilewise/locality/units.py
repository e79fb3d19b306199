"""The lowerings of modules a traced lowering takes whole (its units), and of single layers.

- `attention`: diffusers' `Attention` (AttnProcessor / AttnProcessor2_0, FusedAttnProcessor2_0): its
  GroupNorm and an `AttentionCore`, whose queries run in the tiles and whose keys and values are those of
  every token (global attention, exact).
- `channel_attention`: Qwen-Image 2.1's `QwenImage21AttentionBlock` on its one frame (an RMS norm over
  channels, one head, q / k / v from one 1x1 convolution, a 1x1 output projection, the residual): the
  same `AttentionCore`.
- `frame_attention`: Wan's / Qwen-Image's `WanAttentionBlock` / `QwenImageAttentionBlock` on a video value
  (the same block over each frame's tokens, its RMS norm of each frame): a `FrameAttention` (a sync op
  over one frame).
- `conv`, `group_norm`: one nn.Conv2d with zero padding, one nn.GroupNorm.

diffusers' classes are imported inside `attention` (importing diffusers takes ~4 s).
"""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from .build import Builder, unsupported
from .ops import AttentionCore, Conv, GroupNorm, Pointwise
from .ops3d import FrameAttention, fold, unfold

CHANNEL_ATTENTION = ("QwenImage21AttentionBlock",)  # the blocks `channel_attention` lowers
FRAME_ATTENTION = ("WanAttentionBlock", "QwenImageAttentionBlock")  # the blocks `frame_attention` lowers


class ChannelSlice(nn.Module):
    """Channels [a, b) of a 1x1 convolution as a projection of (B, N, C) tokens (its weights read when
    called: moves and casts of the model follow)."""

    def __init__(self, conv: nn.Conv2d, a: int, b: int):
        super().__init__()
        self.conv, self.a, self.b = conv, a, b

    def forward(self, t):
        w, bias = self.conv.weight[self.a : self.b, :, 0, 0], self.conv.bias
        return F.linear(t, w, None if bias is None else bias[self.a : self.b])


def channel_attention(b: Builder, a, x: str, where: str) -> str:
    """QwenImage21AttentionBlock (module docstring) on a (B, C, H, W) value: its norm, then an
    AttentionCore (global: queries tiled, keys and values of every token)."""
    c = a.dim
    qkv, proj = a.to_qkv, a.proj
    ok = (type(a).__name__ in CHANNEL_ATTENTION and a.norm.channel_first and a.norm.gamma.dim() == 3
          and all(type(m) is nn.Conv2d and tuple(m.kernel_size) == (1, 1) and m.groups == 1
                  and tuple(m.stride) == (1, 1) for m in (qkv, proj)) and qkv.out_channels == 3 * c)
    if not ok:
        raise unsupported(a, where)
    n = b.emit(Pointwise, (x,), f"{where}.norm", fn=a.norm, label="rms_norm over channels")
    return b.emit(AttentionCore, (n, x), where, heads=1, to_q=ChannelSlice(qkv, 0, c),
                  to_k=ChannelSlice(qkv, c, 2 * c), to_v=ChannelSlice(qkv, 2 * c, 3 * c),
                  to_out=nn.ModuleList([ChannelSlice(proj, 0, c), nn.Identity()]), residual=True, rescale=1.0)


def frame_attention(b: Builder, a, x: str, where: str) -> str:
    """WanAttentionBlock / QwenImageAttentionBlock (module docstring) on a (B, C, T, H, W) value: its RMS
    norm of each frame, then one head over each frame's tokens (`FrameAttention`, the residual added)."""
    c, qkv, proj, norm = a.dim, a.to_qkv, a.proj, a.norm
    ok = (type(a).__name__ in FRAME_ATTENTION and norm.channel_first and norm.gamma.dim() == 3
          and all(type(m) is nn.Conv2d and tuple(m.kernel_size) == (1, 1) and m.groups == 1
                  and tuple(m.stride) == (1, 1) for m in (qkv, proj)) and qkv.out_channels == 3 * c)
    if not ok:
        raise unsupported(a, where)
    n = b.emit(Pointwise, (x,), f"{where}.norm", fn=lambda t: unfold(norm(fold(t)), t.shape[0], t.shape[2]),
               label="rms_norm over channels (frames folded)")
    return b.emit(FrameAttention, (n, x), where, to_qkv=qkv, proj=proj)


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
