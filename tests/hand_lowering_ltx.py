"""The hand lowering of LTX-Video's VAE (AutoencoderKLLTXVideo 0.9.0 and the 0.9.5 down blocks) into video
programs, block by block, as tilewise lowered it before its traced lowering (`tilewise.locality.trace`
lowers these families from what they compute): kept here as the oracle of the traced programs'
structure (`tests/test_lowering3d.py`), not used by the library.

LTX-Video normalises with an RMS "pixel norm" over channels (and a LayerNorm over channels in channel-
changing shortcuts): pointwise in space, so nothing in it needs the whole frame; its programs have no
sync op and tile exactly with a finite halo. Its causal convolutions repeat the first frame in front
(the decoder, non-causal, also the last behind), and the VAE runs every frame in one call: its program
is one step holding every frame (space is tiled; time is the model's single step). The space <-> channel
rearrangements (patchify, the 0.9.5 downsamplers, the upsamplers' depth-to-space) are `Rearrange` ops
that run the module's own code on aligned crops. Refused with a reason: timestep conditioning (its
per-call embedding) and noise injection (fresh random noise per call: not reproducible, so nothing to
be exact to).

diffusers' module is imported inside the function that checks for it (importing diffusers takes ~4 s).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tilewise.locality.build import Builder, activation, pointwise, unsupported
from tilewise.locality.ops import Add, Pointwise
from tilewise.locality.ops3d import CausalConv3d, Rearrange
from tilewise.locality.program3d import VideoProgram


def _ltx():
    from diffusers.models.autoencoders import autoencoder_kl_ltx

    return autoencoder_kl_ltx


def _conv(b: Builder, c, x: str, where: str) -> str:
    """LTXVideoCausalConv3d: spatial zero padding; the first frame repeated kt - 1 times in front (causal)
    or (kt - 1) / 2 in front and the last behind (non-causal)."""
    conv = getattr(c, "conv", None)
    if type(c) is not _ltx().LTXVideoCausalConv3d or conv.padding_mode != "zeros" or conv.padding[0]:
        raise unsupported(c, where)
    kt = c.kernel_size[0]
    _, ph, pw = conv.padding
    front, back = (kt - 1, 0) if c.is_causal else ((kt - 1) // 2, (kt - 1) // 2)
    if tuple(conv.dilation[1:]) != (1, 1):
        raise unsupported(c, where, "spatial dilation")
    return b.emit(CausalConv3d, (x,), where, weight=conv.weight, bias=conv.bias,
                  stride=tuple(conv.stride[1:]), stride_t=conv.stride[0], dilation_t=conv.dilation[0],
                  padding=(ph, ph, pw, pw), pad_t=front, pad_end=back, fill="first", groups=conv.groups)


def _channel_norm(b: Builder, norm, x: str, where: str, label: str) -> str:
    """RMSNorm / LayerNorm over channels (diffusers moves channels last for it): pointwise in space."""
    return b.emit(Pointwise, (x,), where, fn=lambda t: norm(t.movedim(1, -1)).movedim(-1, 1), label=label)


def _resnet(b: Builder, r, x: str, where: str) -> str:
    """LTXVideoResnetBlock3d: pixel norm, act, conv, pixel norm, act, conv, + the shortcut (LayerNorm,
    1x1x1 conv) when channels change."""

    if type(r) is not _ltx().LTXVideoResnetBlock3d:
        raise unsupported(r, where)
    if r.scale_shift_table is not None:
        raise unsupported(r, where, "timestep_conditioning: the decode's per-call timestep embedding")
    if r.per_channel_scale1 is not None or r.per_channel_scale2 is not None:
        raise unsupported(r, where, "inject_noise: fresh random noise per call is not reproducible")
    if r.dropout.training and r.dropout.p > 0:
        raise unsupported(r.dropout, where, "dropout in training mode is random: call vae.eval()")
    s = x
    if r.norm3 is not None:
        if type(r.norm3) is not nn.LayerNorm:
            raise unsupported(r.norm3, f"{where}.norm3")
        s = _channel_norm(b, r.norm3, s, f"{where}.norm3", "layer_norm over channels")
    if r.conv_shortcut is not None:
        s = _conv(b, r.conv_shortcut, s, f"{where}.conv_shortcut")
    act = activation(r.nonlinearity, f"{where}.nonlinearity")
    h = _channel_norm(b, r.norm1, x, f"{where}.norm1", "rms_norm over channels")
    h = pointwise(b, act, h, f"{where}.nonlinearity")
    h = _conv(b, r.conv1, h, f"{where}.conv1")
    h = _channel_norm(b, r.norm2, h, f"{where}.norm2", "rms_norm over channels")
    h = pointwise(b, act, h, f"{where}.nonlinearity")
    h = _conv(b, r.conv2, h, f"{where}.conv2")
    return b.emit(Add, (h, s), f"{where}.add")


def _space_to_depth(t, st: tuple[int, int, int]):
    """LTXVideoDownsampler3d's packing of (st_t, st_h, st_w) blocks into channels."""
    return (t.unflatten(4, (-1, st[2])).unflatten(3, (-1, st[1])).unflatten(2, (-1, st[0]))
            .permute(0, 1, 3, 5, 7, 2, 4, 6).flatten(1, 4))


def _downsampler(b: Builder, d, x: str, where: str) -> str:
    """LTXVideoDownsampler3d (0.9.5): first st_t - 1 frames repeated in front, conv, packed into channels,
    + the packed input averaged over channel groups."""
    st = d.stride
    if st[1] != st[2]:
        raise unsupported(d, where, "unequal spatial strides")
    cin = d.conv.in_channels
    x = b.emit(Rearrange, (x,), f"{where}.pad", fn=lambda t, ctx: _cat_front(t, st[0] - 1),
               frames_fn=lambda t, step: t + st[0] - 1, label=f"first {st[0] - 1} frames again in front")
    g = d.group_size
    r = b.emit(Rearrange, (x,), f"{where}.residual",
               fn=lambda t, ctx: _space_to_depth(t, st).unflatten(1, (-1, g)).mean(dim=2), down=st[1],
               channels=cin * st[0] * st[1] * st[2] // g,
               frames_fn=lambda t, step: t // st[0], label=f"pack {st} + mean of {g}")
    h = _conv(b, d.conv, x, f"{where}.conv")
    h = b.emit(Rearrange, (h,), f"{where}.pack", fn=lambda t, ctx: _space_to_depth(t, st), down=st[1],
               channels=d.conv.out_channels * st[0] * st[1] * st[2], frames_fn=lambda t, step: t // st[0],
               label=f"pack {st}")
    return b.emit(Add, (h, r), f"{where}.add")


def _cat_front(t, n: int):
    return torch.cat([t[:, :, :n], t], dim=2) if n else t


def _depth_to_space(t, st: tuple[int, int, int]):
    """LTXVideoUpsampler3d's unpacking of channels into (st_t, st_h, st_w) blocks, the first st_t - 1
    frames dropped."""
    b, _, f, h, w = t.shape
    t = t.reshape(b, -1, st[0], st[1], st[2], f, h, w)
    return t.permute(0, 1, 5, 2, 6, 3, 7, 4).flatten(6, 7).flatten(4, 5).flatten(2, 3)[:, :, st[0] - 1 :]


def _upsampler(b: Builder, u, x: str, where: str) -> str:
    """LTXVideoUpsampler3d: conv, channels unpacked into (st_t, st_h, st_w) blocks (+ the unpacked input
    repeated, with upsample_residual)."""
    st = u.stride
    if st[1] != st[2]:
        raise unsupported(u, where, "unequal spatial strides")
    frames = lambda t, step: t * st[0] - (st[0] - 1)  # noqa: E731
    n = st[0] * st[1] * st[2]
    h = _conv(b, u.conv, x, f"{where}.conv")
    h = b.emit(Rearrange, (h,), f"{where}.unpack", fn=lambda t, ctx: _depth_to_space(t, st), up=st[1],
               channels=u.conv.out_channels // n, frames_fn=frames, label=f"unpack {st}")
    if not u.residual:
        return h
    repeats = n // u.upscale_factor
    r = b.emit(Rearrange, (x,), f"{where}.residual",
               fn=lambda t, ctx: _residual_up(t, st, repeats), up=st[1],
               channels=u.conv.in_channels // n * repeats, frames_fn=frames, label=f"unpack {st} x{repeats}")
    return b.emit(Add, (h, r), f"{where}.add")


def _residual_up(t, st, repeats: int):
    b, _, f, h, w = t.shape
    t = t.reshape(b, -1, st[0], st[1], st[2], f, h, w)
    t = t.permute(0, 1, 5, 2, 6, 3, 7, 4).flatten(6, 7).flatten(4, 5).flatten(2, 3)
    return t.repeat(1, repeats, 1, 1, 1)[:, :, st[0] - 1 :]


def _down_block(b: Builder, blk, x: str, where: str) -> str:
    """LTXVideoDownBlock3D / LTXVideo095DownBlock3D: resnets, downsamplers, conv_out resnet."""
    m = _ltx()
    if type(blk) not in (m.LTXVideoDownBlock3D, m.LTXVideo095DownBlock3D):
        raise unsupported(blk, where)
    for j, r in enumerate(blk.resnets):
        x = _resnet(b, r, x, f"{where}.resnets.{j}")
    for j, d in enumerate(blk.downsamplers or []):
        w = f"{where}.downsamplers.{j}"
        x = _downsampler(b, d, x, w) if type(d) is m.LTXVideoDownsampler3d else _conv(b, d, x, w)
    if getattr(blk, "conv_out", None) is not None:
        x = _resnet(b, blk.conv_out, x, f"{where}.conv_out")
    return x


def _mid(b: Builder, mid, x: str, where: str) -> str:
    if type(mid) is not _ltx().LTXVideoMidBlock3d or mid.time_embedder is not None:
        raise unsupported(mid, where, "timestep_conditioning" if mid.time_embedder is not None else "")
    for j, r in enumerate(mid.resnets):
        x = _resnet(b, r, x, f"{where}.resnets.{j}")
    return x


def _up_block(b: Builder, blk, x: str, where: str) -> str:
    """LTXVideoUpBlock3d: conv_in resnet, upsamplers, resnets."""
    if type(blk) is not _ltx().LTXVideoUpBlock3d or blk.time_embedder is not None:
        raise unsupported(blk, where)
    if blk.conv_in is not None:
        x = _resnet(b, blk.conv_in, x, f"{where}.conv_in")
    for j, u in enumerate(blk.upsamplers or []):
        x = _upsampler(b, u, x, f"{where}.upsamplers.{j}")
    for j, r in enumerate(blk.resnets):
        x = _resnet(b, r, x, f"{where}.resnets.{j}")
    return x


def _patchify(t, p: int, pt: int):
    """LTXVideoEncoder3d's patching: (pt, p, p) blocks into channels, in its own channel order."""
    bsz, c, f, h, w = t.shape
    t = t.reshape(bsz, c, f // pt, pt, h // p, p, w // p, p)
    return t.permute(0, 1, 3, 7, 5, 2, 4, 6).flatten(1, 4)


def _unpatchify(t, p: int, pt: int):
    """LTXVideoDecoder3d's unpatching: channels back into (pt, p, p) blocks."""
    bsz, _, f, h, w = t.shape
    t = t.reshape(bsz, -1, pt, p, p, f, h, w)
    return t.permute(0, 1, 5, 2, 6, 4, 7, 3).flatten(6, 7).flatten(4, 5).flatten(2, 3)


def _encoder(b: Builder, e, x: str) -> tuple[str, int]:
    """LTXVideoEncoder3d: patchify, conv_in, down blocks, mid block, pixel norm, act, conv_out, the last
    channel repeated (the log-variance)."""

    p, pt = e.patch_size, e.patch_size_t
    cin = e.in_channels // (p * p)
    x = b.emit(Rearrange, (x,), "patchify", fn=lambda t, ctx: _patchify(t, p, pt), down=p,
               channels=cin * pt * p * p, frames_fn=lambda t, step: t // pt, label=f"patchify {pt}x{p}x{p}")
    x = _conv(b, e.conv_in, x, "conv_in")
    for i, blk in enumerate(e.down_blocks):
        x = _down_block(b, blk, x, f"down_blocks.{i}")
    x = _mid(b, e.mid_block, x, "mid_block")
    x = _channel_norm(b, e.norm_out, x, "norm_out", "rms_norm over channels")
    act = activation(e.conv_act, "conv_act")
    x = pointwise(b, act, x, "conv_act")
    x = _conv(b, e.conv_out, x, "conv_out")
    c = e.conv_out.out_channels

    def logvar(t):
        return torch.cat([t, t[:, -1:].repeat(1, t.size(1) - 2, 1, 1, 1)], dim=1)

    x = b.emit(Pointwise, (x,), "logvar", fn=logvar, channels=2 * c - 2, label="last channel repeated")
    return x, cin


def _decoder(b: Builder, d, x: str) -> str:
    """LTXVideoDecoder3d: conv_in, mid block, up blocks, pixel norm, act, conv_out, unpatchify."""
    if d.time_embedder is not None:
        raise unsupported(d, "", "timestep_conditioning: the decode's per-call timestep embedding")
    x = _conv(b, d.conv_in, x, "conv_in")
    x = _mid(b, d.mid_block, x, "mid_block")
    for i, blk in enumerate(d.up_blocks):
        x = _up_block(b, blk, x, f"up_blocks.{i}")
    x = _channel_norm(b, d.norm_out, x, "norm_out", "rms_norm over channels")
    act = activation(d.conv_act, "conv_act")
    x = pointwise(b, act, x, "conv_act")
    x = _conv(b, d.conv_out, x, "conv_out")
    p, pt = d.patch_size, d.patch_size_t
    return b.emit(Rearrange, (x,), "unpatchify", fn=lambda t, ctx: _unpatchify(t, p, pt), up=p,
                  channels=d.conv_out.conv.out_channels // (p * p * pt), frames_fn=lambda t, step: t * pt,
                  label=f"unpatchify {pt}x{p}x{p}")


def lower_ltx(module):
    """Lower an LTXVideoEncoder3d or LTXVideoDecoder3d into a one-step video program."""
    m = _ltx()
    b = Builder()
    if type(module) is m.LTXVideoEncoder3d:
        out, cin = _encoder(b, module, "input")
    elif type(module) is m.LTXVideoDecoder3d:
        out, cin = _decoder(b, module, "input"), module.conv_in.in_channels
    else:
        raise unsupported(module, "")
    return VideoProgram(ops=b.ops, input="input", output=out, in_channels=cin, name=type(module).__name__,
                        first=0, every=0)
