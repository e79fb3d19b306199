"""VAE families as table entries: the computation a decode and an encode trace (the wrapped class's own
calls), what decode does before its program and what encode returns; and the families no tile program
can reproduce, refused by name with the reason (the reasons in `locality.classes`, which the CLI reads
before diffusers is imported).

A family's programs are its decode and encode traced (`family_programs`: what they compute, whatever the
classes of their blocks); a call the lowering cannot place is refused when the TiledVAE is built
(`family_programs.lower_family`), never at the first call. A class not in the table is traced as an
AutoencoderKL. Calls are bound against the wrapped class's own `decode` / `encode` (`bind`), so positional
and keyword arguments mean what they mean there (VQModel's `force_not_quantize`, ...); an argument the tiled
path does not follow is refused by name. A decode's per-call inputs (LTX-Video 0.9.5+'s / LTX-2's timestep,
`Family.inputs`) are traced with it: what the program reads of them is computed once per call
(`locality.trace.percall`), never baked into the program. Qwen-Image 2.1's image VAE in a video's layout is
traced on a (B, C, H, W) example (`Family.frame`: its face takes (B, C, 1, H, W)); SVD's temporal decoder on
a (B, C, T, H, W) one (`Family.batched`: its decode takes (B T, C, H, W) and num_frames, `vae.video.batch`).
A family may name the settings its programs follow besides the parameters (`Family.state`: Mochi's
drop_last_temporal_frames), the channels its encode takes (`Family.channels`: Mochi's in_channels count its
Fourier features) and the frame counts refused at the call where its own decode / encode fails on them
(`Family.frames`: HunyuanVideo 1.5's and Magvit's encode take 1 + 4 k frames). The video families' own
computations are in `video_calls` (Magvit's chunked loop as the one pass it equals). A chunked family
(`Family.chunk`: CogVideoX's `_decode` / `_encode` loop of calls of 2 latent / 8 video frames, the first
with the remainder) is lowered per kind of first call: that call traced, the calls the program's causal
steps (`VideoProgram.chunked`), their GroupNorms over each call's frames, their causal convolutions'
conv_cache the steps' caches (`lower_family(..., frames)`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
from diffusers.models.autoencoders.autoencoder_tiny import AutoencoderTinyOutput
from diffusers.models.autoencoders.vae import (
    DiagonalGaussianDistribution,
    EncoderOutput,
    IdentityDistribution,
)
from diffusers.models.autoencoders.vq_model import VQEncoderOutput

from ..locality.classes import REFUSED_IMAGE, REFUSED_VIDEO
from .video_allegro import allegro_decode, allegro_encode, allegro_example, allegro_frames, allegro_note
from .video_calls import (
    cog_chunk,
    cog_decode,
    cog_encode,
    cog_note,
    hunyuan15_frames,
    hunyuan_note,
    k6_decode,
    k6_encode,
    k6_frames,
    kvae_check,
    kvae_chunk,
    kvae_decode,
    kvae_encode,
    kvae_frames,
    ltx_check,
    ltx_decode,
    ltx_inputs,
    magvit_check,
    magvit_decode,
    magvit_encode,
    magvit_frames,
    magvit_note,
    mochi_channels,
    mochi_check,
    mochi_decode,
    mochi_note,
    mochi_state,
    svd_decode,
    svd_inputs,
)
from .video_vidtok import (
    vidtok_check,
    vidtok_decode,
    vidtok_encode,
    vidtok_frames,
    vidtok_kept,
    vidtok_note,
    vidtok_output,
)
from .wan_calls import wan_channels, wan_loop


@dataclass(frozen=True)
class Family:
    """How one VAE class runs through tile programs (module docstring). `decode(vae, z)` / `encode(vae, x)`
    are the computations traced into its programs (the wrapped class's own calls)."""

    decode: Callable | None = None
    encode: Callable | None = None
    encoded: str = "posterior"  # what encode returns (`ENCODED`): "posterior", "latents", "tiny", "latent",
    # "identity", "mean"
    quantize: bool = False  # decode quantises first (untiled: the latent is small), unless told not to
    video: bool = False  # a 3-D VAE: (B, C, T, H, W) values
    frame: bool = False  # an image VAE in a video's layout: (B, C, 1, H, W) calls, 2-D programs (`frames`)
    batched: bool = False  # a video's frames in the batch: decode(z, num_frames) of (B T, C, H, W) runs a
    # video program traced on (B, C, T, H, W) (`vae.video.batch`); encode is 2-D (each frame an image)
    inputs: Callable | None = None  # inputs(vae) -> decode's per-call inputs, by name, with examples
    refused: str = ""  # why no tile program reproduces it (refused when the TiledVAE is built)
    check: Callable | None = None  # check(vae) -> why this configuration is refused ("" where it is not)
    note: Callable | None = None  # note(vae, kind, shape) -> how the call's result differs from the wrapped
    # VAE's own for that call ("" where it does not), logged
    state: Callable | None = None  # state(vae) -> the settings (not parameters) its programs follow: a
    # program is lowered again when they change
    channels: Callable | None = None  # channels(vae) -> the channels encode takes (default: in_channels)
    frames: Callable | None = None  # frames(vae, kind, t) -> why a call of t frames is refused ("" where
    # it is not: the frame counts the wrapped VAE's own decode / encode take)
    kept: Callable | None = None  # kept(vae, kind, t) -> the frames of a t-frame input its own call keeps
    # (VidTok's non-causal decode: t floored to a multiple of num_latent_frames_batch_size), the others
    # dropped before the program runs
    decoded: str = "output"  # what decode returns: "output" (DecoderOutput, or a tuple), "frames" (its
    # frames tensor itself: VidTok's)
    example_frames: Callable | None = None  # example_frames(vae, kind) -> the frames of the example its
    # trace runs on where EXAMPLE_FRAMES' are not a count it takes (Allegro's encode: a multiple of 4)
    frames_first: bool = False  # decode returns (B, T, C, H, W), its program's (B, C, T, H, W) permuted
    # (Allegro's `tiled_decode` permutes its video)
    output: Callable | None = None  # output(vae, h) -> what encode returns where its configuration decides
    # (VidTok's: a posterior, or its FSQ latent and indices); else by `encoded`
    chunk: Callable | None = None  # chunk(vae, kind) -> the frames one call of the model's chunked loop
    # takes (CogVideoX's frame_batch_size; the first call also the remainder), or (lead, every): the first
    # call lead frames, the last the remainder (KVAE's): decode / encode are one call, traced on the
    # call's first chunk, its causal convolutions' caches carried from step to step
    loop: Callable | None = None  # loop(vae, kind, example) -> ((first, every, drop), [first call, a later
    # call]): a causal loop whose calls read the caches the calls before left (Wan's feat_cache), its
    # first and a later call traced and merged into one program (`locality.trace.calls`); example(frames)
    # is a call's meta input

    def refuses(self, vae) -> str:
        """Why `vae` (of this family) is refused, or ""."""
        return self.refused or (self.check(vae) if self.check is not None else "")


def _kl_decode(vae, z):
    return vae.decode(z, return_dict=False)[0]


def _kl_encode(vae, x):
    return vae.encode(x).latent_dist.parameters  # (the moments; the posterior's own are dead code)


KL = Family(decode=_kl_decode, encode=_kl_encode)
VIDEO = Family(decode=_kl_decode, encode=_kl_encode, video=True)  # (a 3-D VAE traced as it computes)
FAMILIES: dict[str, Family] = {
    "AutoencoderKL": KL,
    "AutoencoderTiny": Family(decode=_kl_decode, encode=lambda vae, x: vae.encode(x).latents, encoded="tiny"),
    "VQModel": Family(decode=lambda vae, z: vae.decode(z, force_not_quantize=True, return_dict=False)[0],
                      encode=lambda vae, x: vae.encode(x).latents, encoded="latents", quantize=True),
    "AsymmetricAutoencoderKL": KL,  # (image and mask: refused by `bind`, the rest is a KL decode)
    "AutoencoderDC": Family(decode=_kl_decode, encode=lambda vae, x: vae.encode(x).latent, encoded="latent"),
    # Wan 2.1 / 2.2 and Qwen-Image: their causal loop as it runs (`Family.loop`, `wan_calls`): decode one
    # latent frame a call, encode the first frame, then 4 a call (an incomplete last call's frames
    # dropped); the first and a later call traced, each with the caches the calls before it left, the
    # first call's skipped temporal resampling (its "Rep" markers) ops that start at step 1
    "AutoencoderKLWan": Family(video=True, loop=wan_loop, channels=wan_channels),
    "AutoencoderKLQwenImage": Family(video=True, loop=wan_loop, channels=wan_channels),
    "AutoencoderKLLTXVideo": Family(decode=ltx_decode, encode=_kl_encode, video=True, check=ltx_check,
                                    inputs=ltx_inputs),
    "AutoencoderKLLTX2Video": Family(decode=ltx_decode, encode=_kl_encode, video=True, check=ltx_check,
                                     inputs=ltx_inputs),
    # the whole video in one pass (its GroupNorms and mid-block attention over every frame: sync ops of a
    # one-step program); its own framewise decoding / encoding of long videos (on by default past 16
    # frames) is a temporal tiling with blending, which the exact path does not reproduce
    "AutoencoderKLHunyuanVideo": Family(decode=lambda vae, z: vae.decoder(vae.post_quant_conv(z)),
                                        encode=lambda vae, x: vae.quant_conv(vae.encoder(x)), video=True,
                                        note=hunyuan_note),
    # the whole video in one pass: GroupNorms of each frame (frames folded into the batch, sync ops) and the
    # encoder's attention over each position's frames; its own framewise decoding and spatial tiling
    # (use_tiling) are approximations the exact path does not reproduce (noted per call)
    "AutoencoderKLMochi": Family(decode=mochi_decode, encode=lambda vae, x: vae.encoder(x)[0], video=True,
                                 note=mochi_note, state=mochi_state, channels=mochi_channels,
                                 check=mochi_check),
    # the whole video in one pass: its wavelet patcher, GroupNorms of each frame, attention over each frame's
    # tokens and causal attention over each position's frames (`trace.video_sdpa`); encode returns its
    # IdentityDistribution of the latents
    "AutoencoderKLCosmos": Family(decode=_kl_decode, encode=_kl_encode, video=True, encoded="identity"),
    # CogVideoX (and ConsisID's): its chunked loop as it runs it (`Family.chunk`): the steps are its decode's
    # calls of 2 latent frames and encode's of 8 frames (the first with the remainder), its GroupNorms
    # (the spatial norms' too) sync ops over each call's frames, its causal convolutions' conv_cache the
    # steps' caches, the first call traced apart (its odd frames' first frame resampled apart)
    "AutoencoderKLCogVideoX": Family(decode=cog_decode, encode=cog_encode, video=True, chunk=cog_chunk,
                                     note=cog_note),
    # KVAE video: its chunked loop as it runs it (`Family.chunk`): decode's calls of 5 latent frames, then
    # 4 (encode's of 17, then 16 video frames), the last the remainder; its GroupNorms over each call's
    # frames, its cached causal convolutions (two conv3d written into one buffer, `trace.video_writes`)
    # the steps' caches; encode returns the posterior of its latent with log-variance 0
    "AutoencoderKLKVAEVideo": Family(decode=kvae_decode, encode=kvae_encode, video=True, chunk=kvae_chunk,
                                     check=kvae_check, frames=kvae_frames, encoded="mean"),
    # Kandinsky 6 SR: the whole video in one pass: its loop over 16-frame segments carries each causal
    # convolution's frames over (one convolution over every frame; its norms RMS over the channels), its
    # first segment's first frame apart; encode takes 1 + 4 k frames (`frames`)
    "Kandinsky6SRVAE": Family(decode=k6_decode, encode=k6_encode, video=True, frames=k6_frames),
    # the whole video in one pass, as its untiled decode / encode compute it (`video_vidtok`): its 1-D
    # resnet halves on each position's frames (`trace.video_rows`), trilinear interpolation in time and
    # avg_pool3d over frames (non-causal: nearest in time, each sample of the batch apart); decode returns
    # the frames tensor, encode a posterior or its FSQ latent and indices; encode takes r frames or more,
    # a non-causal decode a multiple of its latent frames batch (`frames`, `kept`)
    "AutoencoderVidTok": Family(decode=vidtok_decode, encode=vidtok_encode, video=True, check=vidtok_check,
                                frames=vidtok_frames, kept=vidtok_kept, note=vidtok_note, decoded="frames",
                                output=vidtok_output),
    # Allegro: the one pass its own tiling (cubes decoded / encoded alone, blended) approximates
    # (`video_allegro`): its GroupNorms over every frame, its mid-block attention over each frame's tokens;
    # decode returns (B, T, C, H, W); encode takes a multiple of 4 frames (`frames`)
    "AutoencoderKLAllegro": Family(decode=allegro_decode, encode=allegro_encode, video=True,
                                   frames=allegro_frames, example_frames=allegro_example, note=allegro_note,
                                   frames_first=True),
    # traced as they compute; refused at construction where a call cannot be placed, with the reason
    "AutoencoderKLHunyuanImageRefiner": VIDEO,
    # the whole video in one pass: its chunked loop's causal caches are one convolution over every frame
    # (each convolution's loop over its windows of frames, `trace.video_windows`), its GroupNorms of each
    # frame (spatial_group_norm=False, per chunk, refused by name); encode takes the frame counts its own
    # chunks take (`frames`)
    "AutoencoderKLMagvit": Family(decode=magvit_decode, encode=magvit_encode, video=True,
                                  check=magvit_check, frames=magvit_frames, note=magvit_note),
    # the whole video in one pass, as decode / encode compute it: RMS norms over the channels, its samplers'
    # channel <-> frame and space rearrangements (the first frame apart) with their channel-repeat / -mean
    # shortcuts (measured ops, their frames measured: 2 t - 1, (t + 1) / 2), the mid-block's attention
    # over every token with its causal mask (run whole at the latent's resolution)
    "AutoencoderKLHunyuanVideo15": Family(decode=_kl_decode, encode=_kl_encode, video=True,
                                          frames=hunyuan15_frames),
    # an image VAE in a video's layout: (B, C, 1, H, W) calls whose convolutions (QwenImage21CausalConv3d)
    # are 2-D ones on the one frame: traced on a (B, C, H, W) example into 2-D programs (`trace.frames`)
    "AutoencoderKLQwenImage21": Family(decode=lambda vae, z: _kl_decode(vae, z.unsqueeze(2)).squeeze(2),
                                       encode=lambda vae, x: _kl_encode(vae, x.unsqueeze(2)).squeeze(2),
                                       frame=True),
    # 2-D VAEs traced as their decode and encode compute (tested exact against the stock VAE)
    **{name: KL for name in ("AutoencoderKLFlux2", "AutoencoderKLKVAE", "AutoencoderKLHunyuanImage")},
    # refused by name with the reason (`locality.classes`): no tile program reproduces them
    **{name: Family(refused=why) for name, why in REFUSED_IMAGE.items()},
    **{name: Family(video=True, refused=why) for name, why in REFUSED_VIDEO.items()},
    # Stable Video Diffusion: decode(z, num_frames) of the frames in the batch, traced on the video they
    # are (its temporal convolutions and GroupNorms over frames x space in one step of every frame of the
    # call); its encoder is the 2-D one, each frame an image
    "AutoencoderKLTemporalDecoder": Family(decode=svd_decode, encode=_kl_encode, batched=True,
                                           inputs=svd_inputs),
}


# what an encode returns, by Family.encoded: (output class, its field, what wraps the program's output)
ENCODED = {
    "posterior": (AutoencoderKLOutput, "latent_dist", DiagonalGaussianDistribution),
    "latents": (VQEncoderOutput, "latents", None),
    "tiny": (AutoencoderTinyOutput, "latents", None),
    "latent": (EncoderOutput, "latent", None),
    "identity": (AutoencoderKLOutput, "latent_dist", IdentityDistribution),
    "mean": (AutoencoderKLOutput, "latent_dist",  # (KVAE video's: the latent its mean, log-variance 0)
             lambda h: DiagonalGaussianDistribution(torch.cat([h, torch.zeros_like(h)], dim=1))),
}


def encode_output(family: Family, h, return_dict: bool, vae=None):
    """An encode's result as the wrapped class returns it, from its program's output h."""
    if family.output is not None:
        return family.output(vae, h)
    cls, field, wrap = ENCODED[family.encoded]
    value = h if wrap is None else wrap(h)
    return cls(**{field: value}) if return_dict else (value,)


def family_of(vae) -> Family:
    """The family of a VAE (by class; a class not in the table is tried as an AutoencoderKL-shaped one:
    its decode and encode are traced, or refused by name)."""
    return FAMILIES.get(type(vae).__name__, KL)


def bind(method, vae, args: tuple, kwargs: dict, follows: dict) -> dict:
    """The call's arguments by the names of the wrapped class's `method` (its defaults filled in): those
    in `follows` (name -> default) are returned; any other given with a value other than its default is
    refused by name (the tiled path would ignore it)."""
    try:
        bound = inspect.signature(method).bind(vae, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"TiledVAE.{method.__name__}() for {type(vae).__name__}: {e}") from None
    bound.apply_defaults()
    params = inspect.signature(method).parameters
    out = {}
    for arg, value in list(bound.arguments.items())[2:]:  # (after self and the input)
        if arg in follows:
            out[arg] = value
        elif arg != "generator" and not _same(value, params[arg].default):
            where = f"TiledVAE.{method.__name__}() for {type(vae).__name__}"
            raise ValueError(f"{where}: {arg}={_short(value)} is not followed by the tiled path (it takes "
                             f"{sorted(follows)}); use the wrapped VAE")
    return {k: out.get(k, d) for k, d in follows.items()}


def _same(a, b) -> bool:
    """Whether a given argument is its default (plain values compared, objects by identity)."""
    return a is b or (isinstance(a, int | float | str | bool) and type(a) is type(b) and a == b)


def _short(value) -> str:
    """A value as a message shows it (a tensor by its shape)."""
    shape = getattr(value, "shape", None)
    return f"<tensor {tuple(shape)}>" if shape is not None else repr(value)
