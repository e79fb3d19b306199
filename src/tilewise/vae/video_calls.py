"""The computations of the video VAE families' table entries (`families.FAMILIES`) beyond a plain decode
and encode: what LTX-Video's, Mochi's, SVD's and Magvit's decode and encode trace, their per-call inputs,
the settings they follow, the configurations and frame counts refused and the notes a call logs where
the wrapped VAE's own path would differ (its own tiling, framewise decoding)."""

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


def magvit_upsamplers(vae) -> list:
    """Magvit's decoder's temporal upsamplers (their `prev_features`: set once a chunk has run)."""
    return [m for m in vae.decoder.modules() if type(m).__name__ == "EasyAnimateUpsampler3D"
            and m.temporal_upsample]


def magvit_decode(vae, z):
    """Magvit's decode in one pass. Its own `_decode` runs the decoder on the first latent frame, then on
    each next chunk of `num_latent_frames_batch_size`, every causal convolution carrying its last input
    frames over (its cache: one convolution over every frame, chunk by chunk) and each temporal upsampler
    doubling the frames of every chunk but the first. That is the decoder on every frame at once with its
    upsamplers as after the first chunk (every frame doubled), less the frames its first frame makes in
    excess (causal, replicate-padded convolutions: a first frame repeated stays repeated), its GroupNorms
    of each frame (`magvit_check`). The caches are cleared before and after, as `decode` clears them."""
    vae._clear_conv_cache()
    try:
        for m in magvit_upsamplers(vae):
            m.prev_features = True  # (as after the first chunk: what its forward reads of the cache)
        dec = vae.decoder(vae.post_quant_conv(z))
    finally:
        vae._clear_conv_cache()
    return dec[:, :, int(vae.temporal_compression_ratio) - 1 :]


def magvit_encode(vae, x):
    """Magvit's encode in one pass: its own `_encode` runs the encoder on the first frame, then on each
    next chunk of `num_sample_frames_batch_size` frames, every causal convolution carrying its last input
    frames over: one convolution over every frame, chunk by chunk (`magvit_frames`: the counts where
    its chunks are whole at every temporal downsampling)."""
    vae._clear_conv_cache()
    try:
        return vae.quant_conv(vae.encoder(x))
    finally:
        vae._clear_conv_cache()


def magvit_check(vae) -> str:
    """Magvit with spatial_group_norm=False: its GroupNorms over each chunk's frames (the first frame, then
    each chunk of its decode / encode loop), and its temporal upsamplers trilinear."""
    if not vae.config.spatial_group_norm:
        return ("its GroupNorms (spatial_group_norm=False) reduce over the frames of each chunk its decode / "
                "encode loop runs (the first frame, then chunks of num_latent_frames_batch_size / "
                "num_sample_frames_batch_size) and its temporal upsamplers are trilinear: TiledVAE tiles "
                "Magvit with GroupNorms of each frame (spatial_group_norm=True, its default)")
    return ""


def magvit_frames(vae, kind: Kind, t: int) -> str:
    """Why the wrapped VAE's encode fails on t frames ("" where it takes them): after the first frame, its
    chunks of num_sample_frames_batch_size frames (and the last) must each halve to whole frames at every
    temporal downsampling (1 + r k frames, r its temporal compression)."""
    r, n = int(vae.temporal_compression_ratio), int(vae.num_sample_frames_batch_size)
    if kind is Kind.DECODE or (t - 1) % r == 0 and (n % r == 0 or t - 1 <= n):
        return ""
    return (f"AutoencoderKLMagvit encodes 1 + {r} k frames in chunks of num_sample_frames_batch_size = {n} "
            f"after the first (its own encode fails on {t} frames: a chunk that does not halve to whole "
            f"frames at each temporal downsampling); give 1 + {r} k frames")


def magvit_note(vae, kind: Kind, shape) -> str:
    """Where Magvit's own decode / encode would tile in space and time (use_tiling, enable_tiling), what
    the tiled path computes instead."""
    f = int(vae.spatial_compression_ratio) if kind is Kind.DECODE else 1
    h, w = int(shape[3]), int(shape[4])
    if vae.use_tiling and (h > vae.tile_sample_min_height // f or w > vae.tile_sample_min_width // f):
        return (f"the wrapped VAE would {kind.value} these {h} x {w} {'latent ' if f > 1 else ''}pixels with "
                f"its own tiling (use_tiling: tiles of {vae.tile_sample_min_height} x "
                f"{vae.tile_sample_min_width} px blended, approximate); TiledVAE {kind.value}s them in one "
                "pass, exactly (as the wrapped VAE with use_tiling = False)")
    return ""


def hunyuan15_frames(vae, kind: Kind, t: int) -> str:
    """Why HunyuanVideo 1.5's encoder fails on t frames ("" where it takes them): each temporal
    downsampler takes the first frame apart and pairs of the others (1 + r k frames, r its temporal
    compression)."""
    r = int(vae.temporal_compression_ratio)
    if kind is Kind.DECODE or (t - 1) % r == 0:
        return ""
    return (f"AutoencoderKLHunyuanVideo15 encodes 1 + {r} k frames (its temporal downsamplers take the first "
            f"frame apart and pairs of the others; its own encode fails on {t} frames)")


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


def kvae_decode(vae, z):
    """One call of KVAE video's `_decode` loop: its decoder on a fresh cache (the first call's: the first
    frame replicated before its causal convolutions and taken apart by its norms and upsamplers; the
    later calls are the program's causal steps, their caches the steps')."""
    return vae.decoder(z, vae._make_decoder_cache())


def kvae_encode(vae, x):
    """One call of KVAE video's `_encode` loop: its encoder on a fresh cache, the first half of its
    channels (the latent; `encode` returns a posterior of it with log-variance 0, `ENCODED["mean"]`)."""
    return torch.chunk(vae.encoder(x, vae._make_encoder_cache()), 2, dim=1)[0]


def kvae_chunk(vae, kind: Kind) -> tuple[int, int]:
    """(lead, every) of KVAE video's loops (seg_len 16 video frames): decode's calls of ceil(17 / r), then
    16 / r latent frames (r its temporal compression), encode's of 17, then 16 video frames; the last
    call the remainder."""
    r = int(vae.config.temporal_compress_times)
    return (-(-17 // r), 16 // r) if kind is Kind.DECODE else (17, 16)


def kvae_check(vae) -> str:
    """KVAE video with a temporal compression that does not divide its 16-frame segments."""
    r = int(vae.config.temporal_compress_times)
    if 16 % r:
        return (f"its temporal_compress_times={r} does not divide the 16 frames of its decode's segments "
                "(its own decode's calls then do not take whole latent frames); TiledVAE tiles KVAE video "
                "with a temporal compression of 1, 2, 4, 8 or 16")
    return ""


def kvae_frames(vae, kind: Kind, t: int) -> str:
    """Why a KVAE video call of t frames is refused ("" where it is not): its own encode fails but on
    1 + r k frames; its own decode's last call of one latent frame (after the first call) makes one video
    frame, not r (its temporal upsamplers do not double a one-frame call), normed over itself alone."""
    r = int(vae.config.temporal_compress_times)
    lead, every = kvae_chunk(vae, kind)
    if kind is Kind.ENCODE and (t - 1) % r:
        return (f"AutoencoderKLKVAEVideo encodes 1 + {r} k frames (its own encode fails on {t} frames: its "
                "temporal downsamplers take the first frame apart and pairs of the others); give 1 + "
                f"{r} k frames")
    if kind is Kind.DECODE and every > 1 and t > lead and (t - lead) % every == 1:
        return (f"AutoencoderKLKVAEVideo decodes {t} latent frames in calls of {lead}, then {every}, the "
                "last of one latent frame, which its temporal upsamplers do not double (that call makes one "
                f"video frame, not {r}: its own decode gives {r * (t - 1) + 1 - (r - 1)} frames); TiledVAE "
                f"does not reproduce that call; give a latent of T frames with (T - {lead}) % {every} != 1")
    return ""


def k6_decode(vae, z):
    """Kandinsky 6 SR's decode in one pass: its own loop runs the decoder on segments of 16 / r latent
    frames (the first one more), each causal convolution carrying the frames the next window reads (its
    cache: one convolution over every frame) and the first segment's upsamplers and spatial norms taking
    its first frame apart; with RMS norms over the channels (no statistic over a segment's frames), that
    is the decoder on every frame at once from a fresh cache."""
    return vae.decoder(z, vae.decoder.make_cache())


def k6_encode(vae, x):
    """Kandinsky 6 SR's encode in one pass (as `k6_decode`): the posterior's moments."""
    return vae.encoder(x, vae.encoder.make_cache())


def k6_frames(vae, kind: Kind, t: int) -> str:
    """Why a Kandinsky 6 SR encode of t frames is refused: it takes 1 + r k frames (its docstring's; its
    own encode fails on some others, and its segments of others pool frames apart)."""
    r = int(vae.temporal_compression_ratio)
    if kind is Kind.DECODE or (t - 1) % r == 0:
        return ""
    return (f"Kandinsky6SRVAE encodes 1 + {r} k frames (its temporal downsamplers take the first frame apart "
            f"and pairs of the others, segment by segment; {t} frames are not such a count); give 1 + {r} k "
            "frames")
