"""The recipes the CLI calls: `generate` (tiled denoise, then tiled decode), `decode_file`, `encode_file`."""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..atomic import atomic_path
from ..errors import BadRequest
from ..locality.lowering3d import is_video_vae
from .fits import check_generate_fits, check_image_output, check_latents_output
from .loading import Loaded
from .video import decode_video_file, encode_video_file

logger = logging.getLogger(__name__)


def parse_region(text: str) -> tuple[tuple[int, int, int, int], str]:
    """'x0,y0,x1,y1:prompt' -> ((x0, y0, x1, y1), prompt) in pixels."""
    box, sep, prompt = text.partition(":")
    try:
        coords = tuple(int(v) for v in box.split(","))
    except ValueError:
        coords = ()
    if not sep or len(coords) != 4 or not prompt.strip():
        raise ValueError(
            f"region {text!r} must look like 'x0,y0,x1,y1:prompt' (pixels, e.g. '0,0,512,512:brick')"
        )
    return coords, prompt.strip()  # type: ignore[return-value]


@dataclass
class GenerateResult:
    """What a generation did: output path or image tensor, timings, tile counts, the VAE plan."""

    out: str | None
    image: Any
    seconds: dict[str, float] = field(default_factory=dict)
    unet_tiles_per_call: int = 0
    vae_plan: Any = None


def latent_scale(vae) -> tuple[float, float]:
    """(scaling_factor, shift_factor) of a VAE config (SD: 0.18215, 0; SD3/Flux have a shift)."""
    cfg = vae.config
    return float(getattr(cfg, "scaling_factor", 1.0) or 1.0), float(getattr(cfg, "shift_factor", 0.0) or 0.0)


def generate(
    loaded: Loaded,
    prompt: str,
    width: int,
    height: int,
    *,
    negative: str = "",
    regions: list[tuple[tuple[int, int, int, int], str]] | None = None,
    method: str = "mixture",
    tile_size: int = 16,
    overlap: int = 4,
    batch_size: int | None = None,
    steps: int = 20,
    seed: int = 0,
    guidance: float = 5.0,
    vae_tile: int = 32,
    vae_mode: str = "exact",
    out: str | None = None,
    bits: int = 8,
    progress: bool = True,
    process_group: Any = None,
    replace: bool = True,
) -> GenerateResult:
    """Text to image at any size: tiled denoising (TiledDenoiser) then tiled decoding (TiledVAE).

    With `process_group` ("default" under torchrun) the tiles of both stages are split over the ranks;
    every rank calls this, rank 0 writes `out`. Before anything runs, `out` is checked (suffix, folder,
    replace=False: must not exist) and the full-size buffers of denoising and decoding are estimated
    against the memory (and staging disk) there is (`WontFit` with the figure otherwise).
    """
    import torch

    from ..diffusion import Region, TiledDenoiser
    from ..vae import TiledVAE

    pipe = loaded.pipe
    attr = loaded.denoiser  # "unet", or "transformer" (SD3, Flux, ...: the adapter follows its class)
    f = int(getattr(pipe, "vae_scale_factor", 8))
    m = f if attr == "unet" else 2 * f  # transformers take whole 2x2 latent patches
    if width <= 0 or height <= 0 or width % m or height % m:
        raise ValueError(
            f"width and height have to be positive multiples of {m} but are {width} and {height}"
        )
    check_image_output(out, bits, replace)
    for box, _ in regions or []:
        x0, y0, x1, y1 = box
        if not (0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height):
            raise ValueError(f"region box {box} lies outside the {width}x{height} image")
    check_generate_fits(getattr(pipe, attr), width, height, f, len(regions or []))
    tv = TiledVAE(pipe.vae, tile_size=vae_tile, mode=vae_mode, progress=progress, process_group=process_group)
    zshape = (1, int(pipe.vae.config.latent_channels), height // f, width // f)
    streamed = out is not None
    tv.preflight(zshape, streamed=streamed)
    if batch_size is None:  # the embedded UNet is tiny: per-call overhead dominates, batch many tiles
        batch_size = 32 if loaded.embedded else 4
    cond = loaded.encode(prompt, negative)
    tiled_regions = []
    for box, text in regions or []:
        emb = loaded.region_embeds(text, negative)
        tiled_regions.append(
            Region(
                box=box,
                prompt_embeds=emb["prompt_embeds"],
                pooled_prompt_embeds=emb.get("pooled_prompt_embeds"),
            )
        )
    model = getattr(pipe, attr)
    denoiser = TiledDenoiser(
        model,
        tile_size=tile_size,
        overlap=overlap,
        method=method,
        batch_size=batch_size,
        regions=tiled_regions or None,
        seed=seed,
        vae_scale_factor=f,
        progress=False,
        process_group=process_group,
    )
    tiles = denoiser.count(height // f, width // f)
    logger.info(
        "generate %dx%d: %s over %d %s tiles of %d latent px per call, %d steps",
        width,
        height,
        method,
        tiles,
        type(model).__name__,
        tile_size,
        steps,
    )
    seconds: dict[str, float] = {}
    setattr(pipe, attr, denoiser)
    try:
        pipe.set_progress_bar_config(disable=not progress, desc="denoise")
        t0 = time.perf_counter()
        latents = pipe(
            **cond,
            height=height,
            width=width,
            num_inference_steps=steps,
            guidance_scale=guidance,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="latent",
        ).images
        seconds["denoise"] = time.perf_counter() - t0
    finally:
        setattr(pipe, attr, model)
    if latents.ndim == 3 and hasattr(pipe, "_unpack_latents"):  # Flux: packed 2x2 patch tokens
        latents = pipe._unpack_latents(latents, height, width, f)
    sf, shift = latent_scale(pipe.vae)
    z = latents / sf + shift
    plan = tv.plan(tuple(z.shape))
    t0 = time.perf_counter()
    image = _decode_out(tv, z, out, bits, replace)
    seconds["decode"] = time.perf_counter() - t0
    return GenerateResult(out=out, image=image, seconds=seconds, unet_tiles_per_call=tiles, vae_plan=plan)


def _decode_out(tv, z, out: str | None, bits: int, replace: bool = True):
    """Decode to a file sink (streamed, atomic) or to memory; returns the image tensor when in memory."""
    if out is None:
        return tv.decode(z).sample
    from ..sinks import open_sink

    if not _writes(tv):  # rank 0 writes; this rank sends its rows
        tv.decode_to(z, None)
        return None
    f = vae_factor(tv.vae)
    with open_sink(out, z.shape[-2] * f, z.shape[-1] * f, 3, bits=bits, replace=replace) as sink:
        tv.decode_to(z, sink)
    logger.info("wrote %s", out)
    return None


def _writes(tv) -> bool:
    """Whether this process writes output files: single process, or rank 0 of the TiledVAE's group."""
    from ..distributed import rank_world, resolve_group

    return rank_world(resolve_group(tv.process_group))[0] == 0


def vae_factor(vae) -> int:
    """Pixels per latent pixel of an AutoencoderKL-style VAE (8 for SD): 2 ** (blocks - 1)."""
    return int(2 ** (len(vae.config.block_out_channels) - 1))


def decode_file(
    loaded: Loaded | Any,
    latents_path: str,
    out: str,
    *,
    tile_size: int = 32,
    mode: str = "exact",
    budget: str | None = None,
    staging: str = "auto",
    bits: int = 8,
    progress: bool = True,
    process_group: Any = None,
    replace: bool = True,
):
    """Decode a latents .safetensors (key 'latents', scaled like a pipeline's output) to an image file;
    `loaded` is a pipeline or a VAE. A 3-D VAE (Qwen-Image, Wan, LTX-Video) decodes (B, C, T, H, W)
    latents to an image or a video sink (`pipelines.video`).

    The output and the latents file (header, shape, dtype, channels, values) are checked first."""
    from ..sources import read_latents
    from ..vae import TiledVAE

    vae = _vae(loaded)
    if is_video_vae(vae):
        _one_process(vae, process_group)
        return decode_video_file(vae, latents_path, out, tile_size=tile_size, mode=mode, budget=budget,
                                 staging=staging, bits=bits, progress=progress, replace=replace)
    check_image_output(out, bits, replace)
    z = read_latents(latents_path, channels=int(vae.config.latent_channels)).to(vae.device, vae.dtype)
    sf, shift = latent_scale(vae)
    tv = TiledVAE(vae, tile_size=tile_size, mode=mode, memory_budget=budget, staging=staging,
                  progress=progress, process_group=process_group)
    plan = tv.plan(tuple(z.shape))
    _decode_out(tv, z / sf + shift, out, bits, replace)
    return plan


def load_image(path: str, multiple: int = 8):
    """An image file as a (1, 3, H, W) float tensor in [-1, 1], read at its depth (`tilewise.sources`);
    sides must be multiples of `multiple`."""
    from ..errors import BadInputFile
    from ..sources import read_image

    pic = read_image(path)
    h, w = pic.height, pic.width
    if h % multiple or w % multiple:
        raise BadInputFile(
            f"image {path!r} is {w}x{h}; both sides must be multiples of {multiple} to encode "
            f"(crop to {w - w % multiple}x{h - h % multiple} or pad)"
        )
    return pic.tensor((-1.0, 1.0))


def encode_file(
    loaded: Loaded | Any,
    image_path: str,
    out: str,
    *,
    tile_size: int = 32,
    mode: str = "exact",
    budget: str | None = None,
    staging: str = "auto",
    progress: bool = True,
    process_group: Any = None,
    replace: bool = True,
):
    """Encode an image file to a latents .safetensors (mean of the latent distribution, scaled).

    With `process_group` every rank encodes its band of tiles and rank 0 writes the file. `loaded` is a
    pipeline or a VAE; a 3-D VAE encodes an image or a video (`pipelines.frames`)."""
    from safetensors.torch import save_file

    from ..vae import TiledVAE

    check_latents_output(out, replace)
    vae = _vae(loaded)
    if is_video_vae(vae):
        _one_process(vae, process_group)
        return encode_video_file(vae, image_path, out, tile_size=tile_size, mode=mode, budget=budget,
                                 staging=staging, progress=progress, replace=replace)
    x = load_image(image_path, vae_factor(vae)).to(vae.device, vae.dtype)
    tv = TiledVAE(vae, tile_size=tile_size, mode=mode, memory_budget=budget, staging=staging,
                  progress=progress, process_group=process_group)
    plan = tv.plan(tuple(x.shape), kind="encode")
    dist = tv.encode(x).latent_dist
    sf, shift = latent_scale(vae)
    latents = ((dist.mean - shift) * sf).contiguous()
    if not _writes(tv):
        return plan
    with atomic_path(out, replace=replace) as tmp:
        try:
            save_file({"latents": latents.cpu()}, str(tmp),
                      metadata={"scaling_factor": str(sf), "shift_factor": str(shift)})
        except Exception as e:  # safetensors' errors name neither the file nor errno
            if "os error 28" in str(e) or "No space left" in str(e):
                raise OSError(errno.ENOSPC, "No space left on device", str(out)) from e
            raise
    return plan


def _vae(loaded):
    """The VAE of a Loaded pipeline, or the VAE itself."""
    return loaded.pipe.vae if isinstance(loaded, Loaded) else loaded


def _one_process(vae, process_group) -> None:
    if process_group is not None:
        raise BadRequest(f"{type(vae).__name__} (a 3-D VAE) decodes and encodes in one process for now: drop "
                         f"--nproc")
