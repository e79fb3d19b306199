"""The hand lowering of Qwen-Image's and Wan 2.1 / 2.2's 3-D causal VAEs into video programs, block by
block, as tilewise lowered them before their traced lowering (`tilewise.vae.wan_calls` and
`tilewise.locality.trace.calls` lower them from the traces of their own loop calls): kept here as the
oracle of the traced programs' structure (`tests/test_lowering3d.py`), not used by the library.

These VAEs run their frames in a causal loop, one call per chunk of frames, each call reading the frames
its convolutions cached in the call before (diffusers' `feat_cache`, with markers for the first chunk
that skip the temporal up- and downsampling there); each function here mirrors one block's forward. A
causal 3-D convolution becomes a spatial convolution with its halo plus a temporal window over cached
frames (`CausalConv3d`); the RMS norm normalises over channels, pointwise in space; the mid-block
attention is a sync op over one frame; the resamplers scale the spatial grid (`FrameUpsample`,
`FrameConv` with stride, `Rearrange` for AvgDown3D / DupUp3D / patchify) and the temporal one (`TimeUp`,
`TimeDown`, ops kept in the library for this oracle). `lower_video_vae` lowers a whole decode or encode
as AutoencoderKLWan._decode / _encode run it: post_quant_conv, decoder, unpatchify and the clamp to
[-1, 1]; patchify, encoder, quant_conv; and their causal steps.
"""

from __future__ import annotations

import torch.nn as nn

from tilewise.locality.build import Activation, Builder, activation, mid_block, pointwise, unsupported
from tilewise.locality.ops import Add, Pointwise
from tilewise.locality.ops3d import (
    CausalConv3d,
    FrameAttention,
    FrameConv,
    FrameUpsample,
    Rearrange,
    TimeDown,
    TimeUp,
    fold,
    unfold,
)
from tilewise.locality.program3d import VideoProgram

# AutoencoderKLWan._encode / tiled_encode run the first frame alone, then chunks of this many frames
# (a literal there, whatever the temporal compression), and drop the frames of an incomplete last chunk
WAN_ENCODE_CHUNK = 4


def _classes(name: str) -> tuple[type, ...]:
    """The Wan and Qwen-Image classes of one block kind (Qwen-Image's VAE is Wan 2.1's, renamed)."""
    from diffusers.models.autoencoders import autoencoder_kl_qwenimage as qwen
    from diffusers.models.autoencoders import autoencoder_kl_wan as wan

    return tuple(c for c in (getattr(wan, "Wan" + name, None), getattr(qwen, "QwenImage" + name, None)) if c)


def _causal(b: Builder, conv, x: str, where: str) -> str:
    """WanCausalConv3d: zero padding in space, 2 p_t cached frames before (zeros before the first)."""
    if type(conv) not in _classes("CausalConv3d") or conv.padding_mode != "zeros":
        raise unsupported(conv, where)
    if tuple(conv.dilation) != (1, 1, 1) or conv._padding[5]:
        raise unsupported(conv, where, "dilation or padding after the frames")
    pw, _, ph, _, pt, _ = conv._padding
    return b.emit(CausalConv3d, (x,), where, weight=conv.weight, bias=conv.bias,
                  stride=tuple(conv.stride[1:]), stride_t=conv.stride[0], padding=(ph, ph, pw, pw), pad_t=pt,
                  groups=conv.groups)


def _rms(b: Builder, norm, x: str, where: str) -> str:
    """WanRMS_norm over channels: pointwise in space (the module itself on each box)."""
    if type(norm) not in _classes("RMS_norm") or not norm.channel_first:
        raise unsupported(norm, where)
    if norm.gamma.dim() == 4:  # images=False: (C, 1, 1, 1) broadcasts over frames
        return b.emit(Pointwise, (x,), where, fn=norm, label="rms_norm over channels")
    return b.emit(Pointwise, (x,), where, fn=lambda t: unfold(norm(fold(t)), t.shape[0], t.shape[2]),
                  label="rms_norm over channels (frames folded)")


def _dropout(d, where: str) -> None:
    if d.training and d.p > 0:
        raise unsupported(d, where, "dropout in training mode is random: call vae.eval()")


def _resblock(b: Builder, r, x: str, where: str) -> str:
    """WanResidualBlock: shortcut, norm, act, conv (cached), norm, act, dropout, conv (cached), add."""
    if type(r) not in _classes("ResidualBlock"):
        raise unsupported(r, where)

    act = activation(r.nonlinearity, f"{where}.nonlinearity")
    s = x
    if type(r.conv_shortcut) is not nn.Identity:
        s = _causal(b, r.conv_shortcut, x, f"{where}.conv_shortcut")
    h = _rms(b, r.norm1, x, f"{where}.norm1")
    h = pointwise(b, act, h, f"{where}.nonlinearity")
    h = _causal(b, r.conv1, h, f"{where}.conv1")
    h = _rms(b, r.norm2, h, f"{where}.norm2")
    h = pointwise(b, act, h, f"{where}.nonlinearity")
    _dropout(r.dropout, f"{where}.dropout")
    h = _causal(b, r.conv2, h, f"{where}.conv2")
    return b.emit(Add, (h, s), f"{where}.add")


def _attention(b: Builder, a, x: str, where: str) -> str:
    """WanAttentionBlock: RMS norm per frame, then single-head attention over each frame's tokens."""
    if type(a) not in _classes("AttentionBlock"):
        raise unsupported(a, where)
    n = _rms(b, a.norm, x, f"{where}.norm")
    return b.emit(FrameAttention, (n, x), where, to_qkv=a.to_qkv, proj=a.proj)


def _frame_conv(b: Builder, conv, x: str, where: str, padding=None) -> str:
    if (type(conv) is not nn.Conv2d or conv.padding_mode != "zeros" or tuple(conv.dilation) != (1, 1)
            or conv.groups != 1):
        raise unsupported(conv, where)
    ph, pw = conv.padding
    return b.emit(FrameConv, (x,), where, weight=conv.weight, bias=conv.bias, stride=tuple(conv.stride),
                  padding=padding or (ph, ph, pw, pw))


def _resample(b: Builder, r, x: str, where: str) -> str:
    """WanResample: nearest-exact x2 + conv per frame (after TimeUp in "upsample3d"), or zero pad (0, 1, 0, 1)
    + conv stride 2 per frame (then TimeDown in "downsample3d")."""

    if type(r) not in _classes("Resample"):
        raise unsupported(r, where)
    if r.mode == "none":
        return x
    if r.mode in ("upsample2d", "upsample3d"):
        if r.mode == "upsample3d":
            x = b.emit(TimeUp, (x,), f"{where}.time_conv", weight=r.time_conv.weight, bias=r.time_conv.bias)
        up, conv = r.resample
        if tuple(up.scale_factor) != (2.0, 2.0) or up.mode not in ("nearest", "nearest-exact"):
            raise unsupported(up, f"{where}.resample.0")
        x = b.emit(FrameUpsample, (x,), f"{where}.resample.0", scale=2, module=up)
        return _frame_conv(b, conv, x, f"{where}.resample.1")
    if r.mode in ("downsample2d", "downsample3d"):
        pad, conv = r.resample
        if type(pad) is not nn.ZeroPad2d:
            raise unsupported(pad, f"{where}.resample.0")
        left, right, top, bottom = pad.padding
        if any(conv.padding):
            raise unsupported(conv, f"{where}.resample.1", "padding on top of the ZeroPad2d")
        x = _frame_conv(b, conv, x, f"{where}.resample.1", padding=(top, bottom, left, right))
        if r.mode == "downsample3d":
            x = b.emit(TimeDown, (x,), f"{where}.time_conv", weight=r.time_conv.weight, bias=r.time_conv.bias)
        return x
    raise unsupported(r, where, f"mode {r.mode!r}")


def _mid(b: Builder, m, x: str, where: str) -> str:
    """WanMidBlock: resnet, then (attention, resnet) pairs."""
    if type(m) not in _classes("MidBlock"):
        raise unsupported(m, where)
    return mid_block(b, m, x, where, _resblock, _attention, strict=False)


def _dup_up(b: Builder, d, x: str, where: str) -> str:
    """DupUp3D (Wan 2.2): channels repeated into factor_t frames and factor_s^2 pixels; the first step
    keeps its last frame only (first_chunk)."""
    ft = d.factor_t
    return b.emit(Rearrange, (x,), where, fn=lambda t, ctx: d(t, first_chunk=ctx.step == 0), up=d.factor_s,
                  channels=d.out_channels, frames_fn=lambda t, step: t * ft - (ft - 1 if step == 0 else 0),
                  label=f"DupUp3D t x{ft} s x{d.factor_s}")


def _avg_down(b: Builder, d, x: str, where: str) -> str:
    """AvgDown3D (Wan 2.2): factor_t frames (zero-padded in front) and factor_s^2 pixels averaged into
    channels."""
    ft = d.factor_t
    return b.emit(Rearrange, (x,), where, fn=lambda t, ctx: d(t), down=d.factor_s, channels=d.out_channels,
                  frames_fn=lambda t, step: -(-t // ft), label=f"AvgDown3D t /{ft} s /{d.factor_s}")


def _up_block(b: Builder, blk, x: str, where: str) -> str:
    """WanUpBlock (resnets, upsampler) or Wan 2.2's WanResidualUpBlock (+ DupUp3D shortcut)."""
    residual = type(blk) in _classes("ResidualUpBlock")
    if type(blk) not in _classes("UpBlock") and not residual:
        raise unsupported(blk, where)
    x0 = x
    for j, r in enumerate(blk.resnets):
        x = _resblock(b, r, x, f"{where}.resnets.{j}")
    if residual:
        if blk.upsampler is not None:
            x = _resample(b, blk.upsampler, x, f"{where}.upsampler")
        if blk.avg_shortcut is not None:
            s = _dup_up(b, blk.avg_shortcut, x0, f"{where}.avg_shortcut")
            x = b.emit(Add, (x, s), f"{where}.add")
    elif blk.upsamplers is not None:
        x = _resample(b, blk.upsamplers[0], x, f"{where}.upsamplers.0")
    return x


def _down_block(b: Builder, blk, x: str, where: str) -> str:
    """One entry of WanEncoder3d.down_blocks: a residual block, attention, resample, or Wan 2.2's
    WanResidualDownBlock (resnets, downsampler, + AvgDown3D shortcut)."""
    kind = type(blk)
    if kind in _classes("ResidualBlock"):
        return _resblock(b, blk, x, where)
    if kind in _classes("AttentionBlock"):
        return _attention(b, blk, x, where)
    if kind in _classes("Resample"):
        return _resample(b, blk, x, where)
    if kind in _classes("ResidualDownBlock"):
        x0 = x
        for j, r in enumerate(blk.resnets):
            x = _resblock(b, r, x, f"{where}.resnets.{j}")
        if blk.downsampler is not None:
            x = _resample(b, blk.downsampler, x, f"{where}.downsampler")
        s = _avg_down(b, blk.avg_shortcut, x0, f"{where}.avg_shortcut")
        return b.emit(Add, (x, s), f"{where}.add")
    raise unsupported(blk, where)


def _head(b: Builder, m, x: str) -> str:
    """norm_out, act, conv_out."""
    x = _rms(b, m.norm_out, x, "norm_out")
    act = activation(m.nonlinearity, "nonlinearity")
    x = pointwise(b, act, x, "nonlinearity")
    return _causal(b, m.conv_out, x, "conv_out")


def _decoder(b: Builder, d, x: str) -> str:
    """WanDecoder3d: conv_in, mid block, up blocks, head."""
    x = _causal(b, d.conv_in, x, "conv_in")
    x = _mid(b, d.mid_block, x, "mid_block")
    for i, blk in enumerate(d.up_blocks):
        x = _up_block(b, blk, x, f"up_blocks.{i}")
    return _head(b, d, x)


def _encoder(b: Builder, e, x: str) -> str:
    """WanEncoder3d: conv_in, down blocks, mid block, head."""
    x = _causal(b, e.conv_in, x, "conv_in")
    for i, blk in enumerate(e.down_blocks):
        x = _down_block(b, blk, x, f"down_blocks.{i}")
    x = _mid(b, e.mid_block, x, "mid_block")
    return _head(b, e, x)


def _patch(b: Builder, x: str, p: int, channels: int, inverse: bool) -> str:
    """AutoencoderKLWan's patchify (p x p pixels into channels) or unpatchify."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify, unpatchify

    if inverse:
        return b.emit(Rearrange, (x,), "unpatchify", fn=lambda t, ctx: unpatchify(t, p), up=p,
                      channels=channels // (p * p), label=f"unpatchify {p}")
    return b.emit(Rearrange, (x,), "patchify", fn=lambda t, ctx: patchify(t, p), down=p,
                  channels=channels * p * p, label=f"patchify {p}")


def lower3d(module) -> VideoProgram:
    """Lower a Wan / Qwen-Image encoder or decoder into a video program (its own steps)."""
    b = Builder()
    if type(module) in _classes("Decoder3d"):
        out, steps = _decoder(b, module, "input"), (1, 1, False)
    elif type(module) in _classes("Encoder3d"):
        out, steps = _encoder(b, module, "input"), (1, WAN_ENCODE_CHUNK, True)
    else:
        raise unsupported(module, "")
    cin = module.conv_in.in_channels
    return VideoProgram(ops=b.ops, input="input", output=out, in_channels=cin, name=type(module).__name__,
                        first=steps[0],
                        every=steps[1], drop=steps[2])


def lower_video_vae(vae, kind: str) -> VideoProgram:
    """The whole decode ("decode") or encode ("encode") of a Wan / Qwen-Image VAE as its decode / _encode
    runs it."""
    name = type(vae).__name__
    if name not in ("AutoencoderKLWan", "AutoencoderKLQwenImage"):
        raise unsupported(vae, "")
    p = getattr(vae.config, "patch_size", None)
    b = Builder()
    if kind == "decode":
        x = _causal(b, vae.post_quant_conv, "input", "post_quant_conv")
        x = _decoder(b, vae.decoder, x)
        if p is not None:
            x = _patch(b, x, p, vae.decoder.conv_out.out_channels, inverse=True)
        x = pointwise(b, Activation(lambda t: t.clamp(-1.0, 1.0), "clamp [-1, 1]"), x, "clamp")
        cin, steps = vae.post_quant_conv.in_channels, (1, 1, False)
    elif kind == "encode":
        cin = vae.encoder.conv_in.in_channels
        x = "input"
        if p is not None:
            x, cin = _patch(b, x, p, cin // (p * p), inverse=False), cin // (p * p)
        x = _encoder(b, vae.encoder, x)
        x = _causal(b, vae.quant_conv, x, "quant_conv")
        steps = (1, WAN_ENCODE_CHUNK, True)
    else:
        raise ValueError(f"kind must be 'decode' or 'encode', got {kind!r}")
    return VideoProgram(ops=b.ops, input="input", output=x, in_channels=cin, name=f"{name}.{kind}",
                        first=steps[0], every=steps[1], drop=steps[2])
