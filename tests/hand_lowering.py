"""The hand lowering of AutoencoderKL's and AutoencoderTiny's encoders and decoders, block by block, as
tilewise lowered them before its traced lowering (`tilewise.locality.trace`): kept here as the oracle of
the traced programs' structure (`tests/test_traced.py`), not used by the library."""

from __future__ import annotations

import torch.nn as nn

from tilewise.locality.build import Activation, Builder, activation, mid_block, pointwise, unsupported
from tilewise.locality.ops import Add, AttentionCore, Conv, GroupNorm, Resample
from tilewise.locality.program import Program


def _conv(b: Builder, conv, x: str, where: str, padding: tuple[int, int, int, int] | None = None) -> str:
    """nn.Conv2d with zero padding (or the explicit asymmetric padding given)."""

    if type(conv) is not nn.Conv2d or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        raise unsupported(conv, where)
    if padding is None:
        ph, pw = conv.padding
        padding = (ph, ph, pw, pw)
    return b.emit(Conv, (x,), where, weight=conv.weight, bias=conv.bias, stride=tuple(conv.stride),
                  dilation=tuple(conv.dilation), padding=padding, groups=conv.groups)


def _group_norm(b: Builder, norm, x: str, where: str) -> str:

    if type(norm) is not nn.GroupNorm:
        raise unsupported(norm, where)
    return b.emit(GroupNorm, (x,), where, groups=norm.num_groups, eps=norm.eps,
                  weight=norm.weight if norm.affine else None, bias=norm.bias if norm.affine else None)


def _resnet(b: Builder, r, x: str, where: str) -> str:
    """diffusers ResnetBlock2D without time embedding: norm, act, conv, norm, act, conv, + shortcut."""
    from diffusers.models.resnet import ResnetBlock2D

    if type(r) is not ResnetBlock2D or r.upsample is not None or r.downsample is not None:
        raise unsupported(r, where)
    if r.time_emb_proj is not None or r.time_embedding_norm not in ("default", "group"):
        raise unsupported(r, where)
    act = activation(r.nonlinearity, f"{where}.nonlinearity")
    # the shortcut projection first: the block input then dies at norm1 (which may reuse its memory)
    # instead of living through both convolutions
    s = _conv(b, r.conv_shortcut, x, f"{where}.conv_shortcut") if r.conv_shortcut is not None else x
    h = _group_norm(b, r.norm1, x, f"{where}.norm1")
    h = pointwise(b, act, h, f"{where}.nonlinearity")
    h = _conv(b, r.conv1, h, f"{where}.conv1")
    h = _group_norm(b, r.norm2, h, f"{where}.norm2")
    h = pointwise(b, act, h, f"{where}.nonlinearity")
    h = _conv(b, r.conv2, h, f"{where}.conv2")
    return b.emit(Add, (s, h), f"{where}.add", scale=float(r.output_scale_factor))


def _attention(b: Builder, a, x: str, where: str) -> str:
    """diffusers Attention (AttnProcessor / AttnProcessor2_0, self-attention over spatial tokens; with
    FusedAttnProcessor2_0 the same attention from one fused projection: its to_q / to_k / to_v remain)."""
    from diffusers.models.attention_processor import (
        Attention,
        AttnProcessor,
        AttnProcessor2_0,
        FusedAttnProcessor2_0,
    )

    if type(a) is not Attention or type(a.processor) not in (AttnProcessor, AttnProcessor2_0,
                                                              FusedAttnProcessor2_0):
        raise unsupported(a.processor if type(a) is Attention else a, where)
    if a.spatial_norm is not None or a.norm_q is not None or a.norm_k is not None or a.is_cross_attention:
        raise unsupported(a, where)
    if abs(a.scale - (a.inner_dim // a.heads) ** -0.5) > 1e-12:
        raise unsupported(a, where)
    n = x
    if a.group_norm is not None:
        n = _group_norm(b, a.group_norm, x, f"{where}.group_norm")
    return b.emit(AttentionCore, (n, x), where, heads=a.heads, to_q=a.to_q, to_k=a.to_k, to_v=a.to_v,
                  to_out=a.to_out, residual=bool(a.residual_connection),
                  rescale=float(a.rescale_output_factor))


def _mid_block(b: Builder, m, x: str, where: str) -> str:
    """UNetMidBlock2D: resnet, then (attention, resnet) pairs."""
    from diffusers.models.unets.unet_2d_blocks import UNetMidBlock2D

    if type(m) is not UNetMidBlock2D:
        raise unsupported(m, where)
    return mid_block(b, m, x, where, _resnet, _attention)


def _downsample(b: Builder, d, x: str, where: str) -> str:
    """Downsample2D with conv; padding 0 means diffusers' asymmetric F.pad (0, 1, 0, 1) then a valid conv."""
    from diffusers.models.downsampling import Downsample2D

    if type(d) is not Downsample2D or not d.use_conv or d.norm is not None:
        raise unsupported(d, where)
    pad = (0, 1, 0, 1) if d.padding == 0 else None
    return _conv(b, d.conv, x, f"{where}.conv", padding=pad)


def _upsample(b: Builder, u, x: str, where: str) -> str:
    """Upsample2D: nearest x2 interpolation then conv."""
    from diffusers.models.upsampling import Upsample2D

    if type(u) is not Upsample2D or u.use_conv_transpose or u.norm is not None or not u.interpolate:
        raise unsupported(u, where)
    x = b.emit(Resample, (x,), f"{where}.interpolate", scale=2)
    if u.use_conv:
        x = _conv(b, u.conv if u.name == "conv" else u.Conv2d_0, x, f"{where}.conv")
    return x


def _encoder(b: Builder, e, x: str) -> str:
    """diffusers Encoder: conv_in, down blocks, mid block, norm, act, conv_out."""
    from diffusers.models.unets.unet_2d_blocks import DownEncoderBlock2D

    x = _conv(b, e.conv_in, x, "conv_in")
    for i, blk in enumerate(e.down_blocks):
        if type(blk) is not DownEncoderBlock2D:
            raise unsupported(blk, f"down_blocks.{i}")
        for j, r in enumerate(blk.resnets):
            x = _resnet(b, r, x, f"down_blocks.{i}.resnets.{j}")
        for j, d in enumerate(blk.downsamplers or []):
            x = _downsample(b, d, x, f"down_blocks.{i}.downsamplers.{j}")
    x = _mid_block(b, e.mid_block, x, "mid_block")
    return _tail(b, e, x)


def _decoder(b: Builder, d, x: str) -> str:
    """diffusers Decoder: conv_in, mid block, up blocks, norm, act, conv_out."""
    from diffusers.models.unets.unet_2d_blocks import UpDecoderBlock2D

    x = _conv(b, d.conv_in, x, "conv_in")
    x = _mid_block(b, d.mid_block, x, "mid_block")
    for i, blk in enumerate(d.up_blocks):
        if type(blk) is not UpDecoderBlock2D:
            raise unsupported(blk, f"up_blocks.{i}")
        for j, r in enumerate(blk.resnets):
            x = _resnet(b, r, x, f"up_blocks.{i}.resnets.{j}")
        for j, u in enumerate(blk.upsamplers or []):
            x = _upsample(b, u, x, f"up_blocks.{i}.upsamplers.{j}")
    return _tail(b, d, x)


def _tail(b: Builder, m, x: str) -> str:
    x = _group_norm(b, m.conv_norm_out, x, "conv_norm_out")
    act = activation(m.conv_act, "conv_act")
    x = pointwise(b, act, x, "conv_act")
    return _conv(b, m.conv_out, x, "conv_out")


def _tiny_block(b: Builder, blk, x: str, where: str) -> str:
    """AutoencoderTinyBlock: fuse(conv(x) + skip(x))."""

    h = x
    for k, layer in enumerate(blk.conv):
        if type(layer) is nn.Conv2d:
            h = _conv(b, layer, h, f"{where}.conv.{k}")
        else:
            act = activation(layer, f"{where}.conv.{k}")
            h = pointwise(b, act, h, f"{where}.conv.{k}")
    s = x if type(blk.skip) is nn.Identity else _conv(b, blk.skip, x, f"{where}.skip")
    y = b.emit(Add, (h, s), f"{where}.add")
    act = activation(blk.fuse, f"{where}.fuse")
    return pointwise(b, act, y, f"{where}.fuse")


def _tiny_layers(b: Builder, layers, x: str) -> str:
    """nn.Sequential of TAESD layers: Conv2d, AutoencoderTinyBlock, activations, nearest nn.Upsample."""
    from diffusers.models.unets.unet_2d_blocks import AutoencoderTinyBlock

    for i, layer in enumerate(layers):
        where = f"layers.{i}"
        if type(layer) is nn.Conv2d:
            x = _conv(b, layer, x, where)
        elif type(layer) is AutoencoderTinyBlock:
            x = _tiny_block(b, layer, x, where)
        elif type(layer) is nn.Upsample:
            sf = layer.scale_factor
            if layer.mode != "nearest" or layer.size is not None or float(sf) != int(sf):
                raise unsupported(layer, where)
            x = b.emit(Resample, (x,), where, scale=int(sf))
        else:
            act = activation(layer, where)
            x = pointwise(b, act, x, where)
    return x


def hand_lower(module) -> Program:
    """A diffusers VAE Encoder, Decoder, EncoderTiny or DecoderTiny lowered block by block."""
    from diffusers.models.autoencoders.vae import Decoder, DecoderTiny, Encoder, EncoderTiny

    b = Builder()
    x = "input"
    kind = type(module)
    if kind is Encoder:
        out, cin = _encoder(b, module, x), module.conv_in.in_channels
    elif kind is Decoder:
        if type(module.conv_norm_out).__name__ == "SpatialNorm":
            raise unsupported(module.conv_norm_out, "conv_norm_out")
        out, cin = _decoder(b, module, x), module.conv_in.in_channels
    elif kind is EncoderTiny:
        x = pointwise(b, Activation(lambda t: t.add(1).div(2), "(x + 1) / 2", 2), x, "scale_in")
        out, cin = _tiny_layers(b, module.layers, x), module.layers[0].in_channels
    elif kind is DecoderTiny:
        x = pointwise(b, Activation(lambda t: (t / 3).tanh() * 3, "tanh(x / 3) * 3", 3), x, "clamp")
        x = _tiny_layers(b, module.layers, x)
        out = pointwise(b, Activation(lambda t: t.mul(2).sub(1), "2x - 1", 2), x, "scale_out")
        cin = module.layers[0].in_channels
    else:
        raise unsupported(module, "")
    return Program(ops=b.ops, input="input", output=out, in_channels=cin, name=kind.__name__)
