"""The recipes the CLI calls: `generate` (tiled denoise, then tiled decode), `decode_file`, `encode_file`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..atomic import atomic_path
from ..locality.lowering3d import is_video_vae
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
) -> GenerateResult:
    """Text to image at any size: tiled denoising (TiledDenoiser) then tiled decoding (TiledVAE).

    With `process_group` ("default" under torchrun) the tiles of both stages are split over the ranks;
    every rank calls this, rank 0 writes `out`.
    """
    import torch

    from ..diffusion import Region, TiledDenoiser
    from ..vae import TiledVAE

    pipe = loaded.pipe
    f = int(getattr(pipe, "vae_scale_factor", 8))
    if width <= 0 or height <= 0 or width % f or height % f:
        raise ValueError(
            f"width and height have to be positive multiples of {f} but are {width} and {height}"
        )
    if batch_size is None:  # the embedded UNet is tiny: per-call overhead dominates, batch many tiles
        batch_size = 32 if loaded.embedded else 4
    cond = loaded.encode(prompt, negative)
    tiled_regions = []
    for box, text in regions or []:
        x0, y0, x1, y1 = box
        if not (0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height):
            raise ValueError(f"region box {box} lies outside the {width}x{height} image")
        emb = loaded.encode(text, negative)
        tiled_regions.append(
            Region(
                box=box,
                prompt_embeds=emb["prompt_embeds"],
                pooled_prompt_embeds=emb.get("pooled_prompt_embeds"),
            )
        )
    unet = pipe.unet
    denoiser = TiledDenoiser(
        unet,
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
        "generate %dx%d: %s over %d UNet tiles of %d latent px per call, %d steps",
        width,
        height,
        method,
        tiles,
        tile_size,
        steps,
    )
    seconds: dict[str, float] = {}
    pipe.unet = denoiser
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
        pipe.unet = unet
    sf, shift = latent_scale(pipe.vae)
    z = latents / sf + shift
    tv = TiledVAE(pipe.vae, tile_size=vae_tile, mode=vae_mode, progress=progress, process_group=process_group)
    plan = tv.plan(tuple(z.shape))
    t0 = time.perf_counter()
    image = _decode_out(tv, z, out, bits)
    seconds["decode"] = time.perf_counter() - t0
    return GenerateResult(out=out, image=image, seconds=seconds, unet_tiles_per_call=tiles, vae_plan=plan)


def _decode_out(tv, z, out: str | None, bits: int):
    """Decode to a file sink (streamed, atomic) or to memory; returns the image tensor when in memory."""
    if out is None:
        return tv.decode(z).sample
    from ..sinks import open_sink

    if not _writes(tv):  # rank 0 writes; this rank sends its rows
        tv.decode_to(z, None)
        return None
    f = vae_factor(tv.vae)
    with open_sink(out, z.shape[-2] * f, z.shape[-1] * f, 3, bits=bits) as sink:
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
):
    """Decode a latents .safetensors (key 'latents', scaled like a pipeline's output) to an image file;
    `loaded` is a pipeline or a VAE. A 3-D VAE (Qwen-Image, Wan, LTX-Video) decodes (B, C, T, H, W)
    latents to an image or a video sink (`pipelines.video`)."""
    from safetensors.torch import load_file

    from ..vae import TiledVAE

    vae = _vae(loaded)
    if is_video_vae(vae):
        _one_process(vae, process_group)
        return decode_video_file(vae, latents_path, out, tile_size=tile_size, mode=mode, budget=budget,
                                 staging=staging, bits=bits, progress=progress)
    tensors = load_file(latents_path)
    if "latents" not in tensors:
        raise ValueError(f"{latents_path!r} has no 'latents' tensor (keys: {sorted(tensors)})")
    z = tensors["latents"].to(vae.device, vae.dtype)
    if z.ndim == 3:
        z = z[None]
    sf, shift = latent_scale(vae)
    tv = TiledVAE(vae, tile_size=tile_size, mode=mode, memory_budget=budget, staging=staging,
                  progress=progress, process_group=process_group)
    plan = tv.plan(tuple(z.shape))
    _decode_out(tv, z / sf + shift, out, bits)
    return plan


def load_image(path: str, multiple: int = 8):
    """An RGB image file as a (1, 3, H, W) float tensor in [-1, 1]; sides must be multiples of `multiple`."""
    import numpy as np
    import torch
    from PIL import Image

    with Image.open(path) as im:
        rgb = np.array(im.convert("RGB"))
    h, w = rgb.shape[:2]
    if h % multiple or w % multiple:
        raise ValueError(
            f"image {path!r} is {w}x{h}; both sides must be multiples of {multiple} to encode "
            f"(crop to {w - w % multiple}x{h - h % multiple} or pad)"
        )
    return torch.from_numpy(rgb).permute(2, 0, 1)[None].float() / 127.5 - 1


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
):
    """Encode an image file to a latents .safetensors (mean of the latent distribution, scaled).

    With `process_group` every rank encodes its band of tiles and rank 0 writes the file. `loaded` is a
    pipeline or a VAE; a 3-D VAE encodes an image or a video (`pipelines.frames`)."""
    from safetensors.torch import save_file

    from ..vae import TiledVAE

    vae = _vae(loaded)
    if is_video_vae(vae):
        _one_process(vae, process_group)
        return encode_video_file(vae, image_path, out, tile_size=tile_size, mode=mode, budget=budget,
                                 staging=staging, progress=progress)
    x = load_image(image_path, vae_factor(vae)).to(vae.device, vae.dtype)
    tv = TiledVAE(vae, tile_size=tile_size, mode=mode, memory_budget=budget, staging=staging,
                  progress=progress, process_group=process_group)
    plan = tv.plan(tuple(x.shape), kind="encode")
    dist = tv.encode(x).latent_dist
    sf, shift = latent_scale(vae)
    latents = ((dist.mean - shift) * sf).contiguous()
    if not _writes(tv):
        return plan
    with atomic_path(out) as tmp:
        save_file(
            {"latents": latents.cpu()},
            str(tmp),
            metadata={"scaling_factor": str(sf), "shift_factor": str(shift)},
        )
    return plan


def _vae(loaded):
    """The VAE of a Loaded pipeline, or the VAE itself."""
    return loaded.pipe.vae if isinstance(loaded, Loaded) else loaded


def _one_process(vae, process_group) -> None:
    if process_group is not None:
        raise ValueError(f"{type(vae).__name__} (a 3-D VAE) decodes and encodes in one process for now: drop "
                         f"--nproc")
