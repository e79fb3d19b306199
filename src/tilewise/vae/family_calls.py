"""The calls of the 3-D VAE families (`families.FAMILIES`): what each decode and encode traces (the
wrapped class's own calls), their per-call inputs, the configurations refused and the notes on how a
call's result differs from the wrapped VAE's own (LTX-Video / LTX-2, HunyuanVideo, Mochi, SVD's temporal
decoder, CogVideoX)."""

from __future__ import annotations

import torch

from ..locality.lowering import EXAMPLE_FRAMES
from .settings import Kind


def ltx_decode(vae, z, temb=None):
    return vae.decode(z, temb, return_dict=False)[0]


def ltx_inputs(vae) -> dict:
    """LTX-Video 0.9.5+ / LTX-2 decoders conditioned on the decode's timestep (decode(z, temb)): its
    embedding gives per-channel scales and shifts of the norms, computed once per call (`trace.percall`)."""
    if not vae.config.get("timestep_conditioning"):
        return {}
    p = next(vae.parameters())
    return {"temb": torch.full((1,), 0.05, dtype=p.dtype, device=p.device)}


def ltx_check(vae) -> str:
    """LTX-Video 0.9.1's (and any LTX-2 config's) noise injection: fresh noise drawn per call."""
    noise = vae.config.get("decoder_inject_noise")
    if noise is True or isinstance(noise, list | tuple) and any(noise):
        given = tuple(noise) if noise is not True else True
        return (f"its decoder injects noise (decoder_inject_noise={given}: torch.randn of a layer's whole "
                "frame per call, from the global generator), which the tiled path does not draw yet; use the "
                "wrapped VAE")
    return ""


def hunyuan_note(vae, kind: Kind, shape) -> str:
    """Where HunyuanVideo's own decode / encode would run framewise (its temporal tiling with blending,
    on by default past 16 video frames), what the tiled path computes instead."""
    t, frames = int(shape[2]), int(vae.tile_sample_min_num_frames)
    if kind is Kind.DECODE:
        flag, past, what = "use_framewise_decoding", frames // int(vae.temporal_compression_ratio), "latent"
    else:
        flag, past, what = "use_framewise_encoding", frames, "video"
    if not getattr(vae, flag) or t <= past:
        return ""
    return (f"the wrapped VAE would {kind.value} these {t} {what} frames framewise ({flag} past {past}: a "
            f"temporal tiling with blending, approximate); TiledVAE {kind.value}s them in one pass, exactly "
            f"(as the wrapped VAE with {flag} = False)")


def mochi_decode(vae, z):
    """Mochi's decode without its own tiling and framewise branches (one pass: its decoder's frames are
    causal, its GroupNorms of each frame and its framewise decoding's caches exact), the first frames
    dropped as `_decode` drops them."""
    dec = vae.decoder(z)[0]
    r = int(vae.temporal_compression_ratio)
    return dec[:, :, r - 1 :] if vae.drop_last_temporal_frames and dec.size(2) >= r else dec


def mochi_state(vae) -> tuple:
    """What Mochi's programs follow besides its parameters: the first frames dropped or not."""
    return (bool(vae.drop_last_temporal_frames),)


def mochi_check(vae) -> str:
    """Mochi's causal convolutions padding with pad_mode "constant" (`_enable_framewise_decoding` /
    `_enable_framewise_encoding` set it): built for replicate padding, they then pad no pixel in space."""
    modes = sorted({m.pad_mode for m in vae.modules() if hasattr(m, "pad_mode") and hasattr(m, "time_pad")})
    if modes != ["replicate"]:
        return (f"its causal convolutions pad with pad_mode {modes} (the framewise modes set 'constant': "
                "built for 'replicate', the convolutions then pad no pixel in space, and the wrapped VAE's "
                "framewise decode fails on them); TiledVAE tiles Mochi with its default replicate padding")
    return ""


def mochi_channels(vae) -> int:
    """The video channels Mochi's encoder takes: its in_channels count its Fourier features too (3 -> 15
    with the default two frequencies)."""
    ff = vae.encoder.fourier_features
    return int(vae.config.in_channels) // (1 + 2 * ((ff.stop - ff.start) // ff.step))


def mochi_note(vae, kind: Kind, shape) -> str:
    """Where Mochi's own decode / encode would tile in space (use_tiling, past its minimum tile), decode
    framewise (chunks of latent frames each padded on its own) or refuse (framewise encoding), what the
    tiled path computes instead."""
    f = int(vae.spatial_compression_ratio) if kind is Kind.DECODE else 1
    t, h, w, chunk = int(shape[2]), int(shape[3]), int(shape[4]), int(vae.num_latent_frames_batch_size)
    if kind is Kind.DECODE and vae.use_framewise_decoding and t > chunk:
        return (f"the wrapped VAE would decode these {t} latent frames framewise (use_framewise_decoding: "
                f"chunks of {chunk}, each padded on its own, approximate); TiledVAE decodes them in one "
                "pass, exactly (as the wrapped VAE with use_framewise_decoding = False)")
    if vae.use_tiling and (h > vae.tile_sample_min_height // f or w > vae.tile_sample_min_width // f):
        return (f"the wrapped VAE would {kind.value} these {h} x {w} {'latent ' if f > 1 else ''}pixels with "
                f"its own spatial tiling (use_tiling: tiles of {vae.tile_sample_min_height} x "
                f"{vae.tile_sample_min_width} px blended, approximate); TiledVAE {kind.value}s them in one "
                "pass, exactly (as the wrapped VAE with use_tiling = False)")
    if kind is Kind.ENCODE and vae.use_framewise_encoding:
        return ("the wrapped VAE refuses framewise encoding (use_framewise_encoding: its attention mixes "
                "frames); TiledVAE encodes in one pass, exactly (as the wrapped VAE with "
                "use_framewise_encoding = False)")
    return ""


def svd_decode(vae, z, image_only_indicator):
    """SVD's temporal decoder on a (B, C, T, H, W) latent: its frames folded into the batch as
    decode(z, num_frames=T) takes them, the decoder called as decode calls it, the frames unfolded."""
    b, t = z.shape[0], z.shape[2]
    x = vae.decoder(z.permute(0, 2, 1, 3, 4).flatten(0, 1), image_only_indicator=image_only_indicator,
                    num_frames=t)
    return x.unflatten(0, (b, t)).permute(0, 2, 1, 3, 4)


def svd_inputs(vae) -> dict:
    """SVD's decode makes image_only_indicator, zeros of (B, T) (its AlphaBlenders' weights, per frame):
    a per-call input, so that the weights follow each call's frames (`trace.percall`)."""
    p = next(vae.parameters())
    return {"image_only_indicator": torch.zeros(1, EXAMPLE_FRAMES[0], dtype=p.dtype, device=p.device)}


def cog_decode(vae, z):
    """One call of CogVideoX's `_decode` loop: post_quant_conv (if any), the decoder."""
    return vae.decoder(z if vae.post_quant_conv is None else vae.post_quant_conv(z))[0]


def cog_encode(vae, x):
    """One call of CogVideoX's `_encode` loop: the encoder, quant_conv (if any): the posterior's moments."""
    h = vae.encoder(x)[0]
    return h if vae.quant_conv is None else vae.quant_conv(h)


def cog_chunk(vae, kind: Kind) -> int:
    """The frames a call of CogVideoX's loop takes (its frame_batch_size; the first call also the rest)."""
    return vae.num_latent_frames_batch_size if kind is Kind.DECODE else vae.num_sample_frames_batch_size


def cog_note(vae, kind: Kind, shape) -> str:
    """Where CogVideoX's own decode / encode would tile in space (use_tiling: tiles blended), what the
    tiled path computes instead."""
    h, w, latent = int(shape[3]), int(shape[4]), kind is Kind.DECODE
    side = "latent" if latent else "sample"
    th, tw = getattr(vae, f"tile_{side}_min_height"), getattr(vae, f"tile_{side}_min_width")
    if vae.use_tiling and (h > th or w > tw):
        return (f"the wrapped VAE would {kind.value} these {h} x {w} {'latent ' if latent else ''}pixels "
                "with "
                f"its own spatial tiling (use_tiling: tiles blended, approximate); TiledVAE {kind.value}s "
                "them exactly (as the wrapped VAE with use_tiling = False)")
    return ""
