"""Text to video (`generate --frames N`): a video pipeline's tiled denoising, then the 3-D VAE's tiled decode
streamed to a frame pattern, a .npy or a .tif stack.

The pipelines whose latents tilewise decodes as they come out are those of the Wan VAE (`VIDEO_VAES`'s
AutoencoderKLWan: Wan 2.1 / 2.2, SkyReels-V2, Sana-Video, ...), which return (B, C, T, H, W) latents
normalised per channel; their call takes the frame count as `num_frames` (or `frames`). Everything that can
be refused is refused before the pipeline runs: the frame count against the VAE's temporal factor, the
size against its spatial factor and the transformer's patch, the output against the frames it will get,
the tiles and frame windows against the model (TiledDenoiser's checks), the latents against the memory.

torch and the layers that import it are imported inside the functions (see `pipelines.recipes`).
"""

from __future__ import annotations

import inspect
import logging
import time

from ..errors import BadRequest
from .denoise import denoise, tiled_denoiser
from .fits import check_generate_fits
from .loading import Loaded
from .options import GenerateOptions, GenerateResult
from .video import check_video_output, decode_to_file, denormalised

logger = logging.getLogger(__name__)

VAES = ("AutoencoderKLWan",)  # 3-D VAEs whose pipelines' latents come out as (B, C, T, H, W), normalised


def frames_arg(pipe) -> str | None:
    """The name of a video pipeline's frame-count argument ("num_frames", Sana-Video's "frames"); None for
    an image pipeline."""
    params = inspect.signature(pipe.__call__).parameters
    return next((n for n in ("num_frames", "frames") if n in params), None)


def run_generate_video(loaded: Loaded, o: GenerateOptions) -> GenerateResult:
    """`generate` of a video: the request checked, the denoiser tiled, the pipeline's loop, the decode."""
    from ..vae import TiledVAE  # (lazy: torch)

    pipe = loaded.pipe
    # 1. check the request against the pipeline, the output against the frames, before any work
    arg, t_factor, f = _check_video_request(pipe, o)
    denoiser = tiled_denoiser(loaded, o, [], f)  # tiles and frame windows checked against the model
    m = f * denoiser.align
    if o.width % m or o.height % m:
        raise BadRequest(f"width and height have to be positive multiples of {m} (the VAE's {f} x the "
                         f"transformer's patch {denoiser.align}) but are {o.width} and {o.height}")
    T = (o.frames - 1) // t_factor + 1
    check_generate_fits(pipe.transformer, o.width, o.height, f, frames=T)
    tv = TiledVAE(pipe.vae, tile_size=o.vae_tile, mode=o.vae_mode, progress=o.progress)
    tv.plan((1, int(pipe.vae.config.z_dim), T, o.height // f, o.width // f), streamed=True)  # its tiles
    # 2. denoise with the pipeline's own loop (it encodes the prompt), its transformer tiled
    tiles = denoiser.count(o.height // f, o.width // f, frames=T)
    logger.info("generate %d frames of %dx%d: %s over %d %s tiles per call, %d steps", o.frames, o.width,
                o.height, o.method, tiles, type(pipe.transformer).__name__, o.steps)
    t0 = time.perf_counter()
    cond = loaded.encode(o.prompt, o.negative)
    tiled = {"transformer": denoiser}
    if getattr(pipe, "transformer_2", None) is not None:  # Wan 2.2 A14B: the low-noise expert, tiled alike
        tiled["transformer_2"] = tiled_denoiser(loaded, o, [], f, attr="transformer_2")
    latents = denoise(pipe, tiled, o, **cond, **{arg: o.frames}).frames
    seconds = {"denoise": time.perf_counter() - t0}
    # 3. decode, streamed to the output
    t0 = time.perf_counter()
    plan = decode_to_file(tv, denormalised(pipe.vae, latents), o.out, bits=o.bits, replace=o.replace)
    seconds["decode"] = time.perf_counter() - t0
    return GenerateResult(out=o.out, image=None, seconds=seconds, unet_tiles_per_call=tiles, vae_plan=plan)


def _check_video_request(pipe, o: GenerateOptions) -> tuple[str, int, int]:
    """(the frame-count argument, the VAE's temporal and spatial factors) of a valid video request."""
    name, arg = type(pipe).__name__, frames_arg(pipe)
    if arg is None:
        raise BadRequest(f"--frames {o.frames}: {name} is an image pipeline; drop --frames, or give a video "
                         "pipeline folder (Wan 2.x, SkyReels-V2, ...)")
    if o.frames is None:
        raise BadRequest(f"{name} is a video pipeline: give --frames (e.g. --frames 81) and an --out frame "
                         "pattern such as 'frames/f{:04d}.png', a .npy or a .tif stack")
    vae = type(pipe.vae).__name__
    if vae not in VAES or getattr(pipe, "transformer", None) is None:
        raise BadRequest(f"--frames: {name} (its VAE a {vae}) is not one tilewise generates videos with; "
                         f"it runs pipelines with a transformer and a {' or '.join(VAES)}")
    if o.process_group is not None or o.regions:
        raise BadRequest("--frames runs in one process over one prompt: drop --nproc and --region")
    if o.out is None:
        raise BadRequest("--frames needs --out: a frame pattern such as 'frames/f{:04d}.png', a .npy or a "
                         ".tif stack (the video is streamed there)")
    t, f = int(pipe.vae_scale_factor_temporal), int(pipe.vae_scale_factor_spatial)
    if o.frames < 1 or (o.frames - 1) % t:
        lo = max(1, (o.frames - 1) // t * t + 1)
        raise BadRequest(f"--frames {o.frames}: {name} makes 1 + {t}k frames (the VAE's temporal factor "
                         f"{t}); use {lo} or {lo + t}")
    check_video_output(o.out, o.bits, o.frames, o.replace)
    return arg, t, f
