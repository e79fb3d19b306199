"""Allegro's (`AutoencoderKLAllegro`) table entry (`families.FAMILIES`): what its decode and encode trace,
the frame counts its encode takes and the note every call logs (its own decode and encode run only
through its tiling).

Its own `_decode` / `_encode` raise without use_tiling; `tiled_decode` / `tiled_encode` run the decoder /
encoder on fixed cubes (`vae.kernel`, latent or video, moved by `vae.stride`) and blend their overlaps
with linear ramps, so the stock result is an approximation: each cube's GroupNorms (over a cube's frames
and space) and mid-block attention (over a cube's frame) see only that cube. The tiled path runs what
the cubes approximate: post_quant_conv of each frame, then the decoder on the whole latent (encode: the
encoder on the whole video, then quant_conv of each frame), its layers placed by what they compute
(`locality.trace`): 2-D resnets on the frames in the batch (`trace.video_batch`), temporal convolutions
over frames with the edge frames repeated (`trace.video`), GroupNorms over every frame (sync ops), the
mid-block attention over each frame's tokens. Its decode returns (B, T, C, H, W) (`Family.frames_first`).
"""

from __future__ import annotations

from ..locality.lowering import EXAMPLE_FRAMES
from .settings import Kind


def _framewise(conv, h):
    """A 2-D convolution of each frame of a (B, C, T, H, W) video (Allegro's quant convs)."""
    b = h.shape[0]
    return conv(h.permute(0, 2, 1, 3, 4).flatten(0, 1)).unflatten(0, (b, -1)).permute(0, 2, 1, 3, 4)


def allegro_decode(vae, z):
    """Allegro's decode in one pass, (B, C, T, H, W): post_quant_conv of each latent frame, then the
    decoder on the whole latent (what `tiled_decode` runs on each cube)."""
    return vae.decoder(_framewise(vae.post_quant_conv, z))


def allegro_encode(vae, x):
    """Allegro's encode in one pass: the encoder on the whole video, then quant_conv of each latent frame
    (what `tiled_encode` runs on each cube, and on the blended latent): the posterior's moments."""
    return _framewise(vae.quant_conv, vae.encoder(x))


def _ratio(vae) -> int:
    """Allegro's temporal compression: 2 for each temporal downsampling block."""
    return 2 ** sum(bool(d) for d in vae.config.temporal_downsample_blocks)


def allegro_example(vae, kind: Kind) -> int | None:
    """The frames Allegro's encode is traced on: EXAMPLE_FRAMES' latent frames times its compression (a
    count it takes); its decode's the default."""
    return _ratio(vae) * EXAMPLE_FRAMES[0] if kind is Kind.ENCODE else None


def allegro_frames(vae, kind: Kind, t: int) -> str:
    """Why an Allegro encode of t frames is refused: each temporal downsampling (a convolution of 2 frames,
    stride 2, beside a shortcut of every other frame) halves an even frame count only."""
    r = _ratio(vae)
    if kind is Kind.DECODE or (t >= r and t % r == 0):
        return ""
    return (f"AutoencoderKLAllegro encodes a multiple of {r} frames (each temporal downsampling's "
            "convolution of 2 frames, stride 2, and its shortcut of every other frame disagree on an odd "
            f"count: its encoder fails on {t}); give {r} k frames")


def allegro_note(vae, kind: Kind, shape) -> str:
    """What the wrapped VAE's own decode / encode would compute instead (always: it runs only tiled)."""
    what = "latent" if kind is Kind.DECODE else "video"
    return (f"the wrapped VAE {kind.value}s only through its own tiling (tiled_{kind.value}: the {what} cut "
            f"into cubes of {tuple(vae.kernel)} video frames x px every {tuple(vae.stride)}, each "
            f"{'decoded' if kind is Kind.DECODE else 'encoded'} alone, their overlaps blended: an "
            f"approximation); TiledVAE {kind.value}s in one pass, exactly as "
            + ("post_quant_conv and the decoder on the whole latent" if kind is Kind.DECODE
               else "the encoder on the whole video, then quant_conv"))
