"""VidTok's (`AutoencoderVidTok`) table entry (`families.FAMILIES`): what its decode and encode trace,
the configurations and frame counts refused and the note a call logs where its own use_tiling would run.

Untiled (use_tiling off), its `_decode` / `_encode` run the decoder / encoder once on every frame, each
causal layer's first chunk from an empty cache (`_set_first_chunk(True)`, `_empty_causal_cached`); its
causal decode then drops the first r - 1 frames (r its temporal compression), its non-causal decode
first keeps a multiple of num_latent_frames_batch_size latent frames (`vidtok_kept`). Its layers are
placed by what they compute (`locality.trace`): its resnets' 2-D halves on the frames in the batch, their
LayerNorms over the channels through a permute measured position by position; their 1-D halves on each
position's frames as rows (`trace.video_rows`); its temporal upsampler's trilinear interpolation in time
and its downsampler's avg_pool3d over frames (`trace.video`, `trace.video_pools`; non-causal: nearest
interpolation of each sample of the batch apart, `trace.video_samples`); its mid-block
attention over each frame's tokens (`trace.video_sdpa`). Its FSQ regularizer (regularizer="fsq") is
position by position: encode returns its quantised latent and codebook indices, as its own does.
"""

from __future__ import annotations

from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

from .settings import Kind


def _untiled(vae, coder, t):
    """coder(t) as VidTok's untiled `_decode` / `_encode` run it: every causal layer's first chunk from an
    empty cache (its own methods), the caches emptied after (a trace leaves none behind)."""
    vae._empty_causal_cached(coder)
    vae._set_first_chunk(True)
    try:
        return coder(t)
    finally:
        vae._empty_causal_cached(coder)


def vidtok_decode(vae, z):
    """VidTok's decode with use_tiling off: the decoder on every latent frame; causal, its first r - 1
    frames dropped (r latent frames' worth of its first latent frame's)."""
    dec = _untiled(vae, vae.decoder, z)
    return dec[:, :, vae.temporal_compression_ratio - 1 :] if vae.is_causal else dec


def vidtok_encode(vae, x):
    """VidTok's encode with use_tiling off: the posterior's moments (regularizer "kl"), or the FSQ
    regularizer's quantised latent ("fsq": `FSQRegularizer.quantize` of each position's channels)."""
    h = _untiled(vae, vae.encoder, x)
    if vae.regularizer != "fsq":
        return h
    reg = vae.regularization
    z = h.permute(0, 2, 3, 4, 1)  # (its forward's (B, T H W, C) tokens, one codebook: each position)
    return reg.quantize(z.float()).type(z.dtype).permute(0, 4, 1, 2, 3)


def vidtok_output(vae, h):
    """What VidTok's encode returns of its program's output h: AutoencoderKLOutput(latent_dist=the
    posterior) (regularizer "kl"), or the FSQ latent and its codebook indices, (B, T, H, W) int32, as
    `FSQRegularizer.forward` gives them from its codes ("fsq")."""
    if vae.regularizer != "fsq":
        return AutoencoderKLOutput(latent_dist=DiagonalGaussianDistribution(h))
    codes = h.detach().permute(0, 2, 3, 4, 1).float()  # (one codebook, no projection: the codes)
    return h, vae.regularization.codes_to_indices(codes)


def vidtok_check(vae) -> str:
    """Why a VidTok configuration is refused ("" where it is not)."""
    reg = getattr(vae, "regularization", None)
    if vae.regularizer == "fsq" and (reg.has_projections or reg.num_codebooks != 1):
        return ("its FSQ regularizer projects its codes or splits them into several codebooks, which the "
                "tiled encode does not follow (VidTok's own builds neither); use the wrapped VAE")
    return ""


def vidtok_frames(vae, kind: Kind, t: int) -> str:
    """Why a VidTok call of t frames is refused: each temporal downsampling of an encode pools windows of
    3 frames of its input with its first frame repeated in front (non-causal: a zero frame behind), which
    needs 2 frames (r frames in all);
    a non-causal decode keeps a multiple of n latent frames (`vidtok_kept`) and asserts at least n."""
    r, n = int(vae.temporal_compression_ratio), int(vae.num_latent_frames_batch_size)
    if kind is Kind.DECODE:
        if vae.is_causal or t % n == 0 or t >= n:
            return ""
        return (f"AutoencoderVidTok with is_causal=False decodes a multiple of {n} latent frames "
                f"(num_latent_frames_batch_size; its own decode asserts at least {n}, got {t}); give {n} "
                "latent frames or more")
    if t >= r:
        return ""
    pad = "the first repeated in front" if vae.is_causal else "a zero frame behind"
    return (f"AutoencoderVidTok encodes at least {r} frames (its temporal downsamplers' avg_pool3d of 3 "
            f"frames, {pad}, fails on fewer: its own encode fails on {t}); give {r} frames or more")


def vidtok_kept(vae, kind: Kind, t: int) -> int:
    """The frames of a t-frame input VidTok's own call keeps: a non-causal decode floors them to a
    multiple of num_latent_frames_batch_size (its `_decode` truncates the latent); all of them else."""
    n = int(vae.num_latent_frames_batch_size)
    return t if vae.is_causal or kind is not Kind.DECODE else t // n * n


def vidtok_note(vae, kind: Kind, shape) -> str:
    """Where VidTok's own decode / encode would tile (use_tiling, enable_tiling), what the tiled path
    computes instead."""
    if not vae.use_tiling:
        return ""
    return (f"the wrapped VAE would {kind.value} in temporal chunks and spatial tiles (use_tiling: its "
            f"caches carried over chunks, its tiles blended); TiledVAE {kind.value}s in one pass, exactly "
            "as the wrapped VAE with use_tiling off")
