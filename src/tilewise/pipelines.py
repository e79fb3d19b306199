"""Recipes over a diffusers pipeline: load (embedded default or local weights), generate, encode, decode.

Every recipe is a plain function the CLI calls; each keeps the denoiser and the decoder choices separate
(seed 000: tiling the denoiser changes the trajectory, tiling the VAE in exact mode does not).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .atomic import atomic_path

logger = logging.getLogger(__name__)

DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class Loaded:
    """A pipeline and how to turn text into its conditioning."""

    pipe: Any
    source: str
    embedded: bool
    sdxl: bool

    def encode(self, prompt: str, negative: str = "") -> dict[str, Any]:
        """{prompt_embeds, negative_prompt_embeds[, pooled_prompt_embeds, negative_pooled_prompt_embeds]}."""
        if self.embedded:
            from .models import default_prompt_embeds

            return default_prompt_embeds(self.pipe, prompt, negative)
        device = self.pipe.unet.device
        if self.sdxl:
            pe, npe, ppe, nppe = self.pipe.encode_prompt(
                prompt,
                device=device,
                num_images_per_prompt=1,
                do_classifier_free_guidance=True,
                negative_prompt=negative,
            )
            return {
                "prompt_embeds": pe,
                "negative_prompt_embeds": npe,
                "pooled_prompt_embeds": ppe,
                "negative_pooled_prompt_embeds": nppe,
            }
        pe, npe = self.pipe.encode_prompt(prompt, device, 1, True, negative_prompt=negative)
        return {"prompt_embeds": pe, "negative_prompt_embeds": npe}


def _torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    return getattr(torch, name)


def load_pipeline(
    model: str | os.PathLike | None = None,
    *,
    config: str | os.PathLike | None = None,
    scheduler: str = "ddim",
    device: str = "cpu",
    dtype: str = "float32",
    local_files_only: bool = True,
) -> Loaded:
    """The embedded default pipeline (model=None), a diffusers pipeline folder, or one .safetensors file.

    A single file takes its architecture from `config`, a local diffusers pipeline folder of the same
    model family (diffusers' from_single_file(config=...)); offline, a single file needs one.
    """

    torch_dtype = _torch_dtype(dtype)
    if model is None:
        if config is not None:
            raise ValueError(f"--config {str(config)!r} needs a single-file --model checkpoint to apply to")
        from .models import load_default_pipeline

        pipe = load_default_pipeline(scheduler=scheduler, device=device, dtype=torch_dtype)
        return Loaded(pipe, "embedded default (tilewise/models)", embedded=True, sdxl=False)
    path = Path(model)
    if not path.exists():
        raise ValueError(
            f"--model {str(model)!r} does not exist: give a diffusers pipeline folder (with "
            "model_index.json) or a single .safetensors checkpoint"
        )
    if path.is_dir():
        if config is not None:
            raise ValueError(
                f"--config {str(config)!r} applies to a single-file --model only, but --model "
                f"{str(path)!r} is a folder (it carries its own configs)"
            )
        if not (path / "model_index.json").is_file():
            raise ValueError(f"{str(path)!r} is a folder without model_index.json: not a diffusers pipeline")
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(path, local_files_only=local_files_only)
    elif path.suffix in (".safetensors", ".ckpt"):
        pipe = _load_single_file(path, config, local_files_only)
    else:
        raise ValueError(f"--model {str(model)!r}: expected a folder or a .safetensors/.ckpt file")
    if not hasattr(pipe, "unet") or not hasattr(pipe, "vae"):
        raise ValueError(
            f"{type(pipe).__name__} from {str(path)!r} has no unet/vae: tilewise needs an SD-family "
            "UNet pipeline"
        )
    if scheduler != "ddim":
        import diffusers

        from .models import SCHEDULERS

        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {sorted(SCHEDULERS)}, got {scheduler!r}")
        pipe.scheduler = getattr(diffusers, SCHEDULERS[scheduler]).from_config(pipe.scheduler.config)
    pipe.to(device, torch_dtype)
    sdxl = "XL" in type(pipe).__name__
    return Loaded(pipe, str(path), embedded=False, sdxl=sdxl)


def _load_single_file(path: Path, config: str | os.PathLike | None, local_files_only: bool):
    """One original-format checkpoint through diffusers' from_single_file, configured by a local folder."""
    if config is None:
        if local_files_only:
            # diffusers would infer the model family and fetch its configs from the Hub (it even turns
            # local_files_only off to do so): refuse here, in one line, instead
            raise ValueError(
                f"--model {str(path)!r} is a single checkpoint: loading it offline needs --config FOLDER, "
                "a local diffusers pipeline folder of the same architecture (model_index.json, component "
                "configs, tokenizer), or downloads allowed (load_pipeline(..., local_files_only=False))"
            )
        from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

        cls = StableDiffusionXLPipeline if "xl" in path.name.lower() else StableDiffusionPipeline
        return cls.from_single_file(str(path), local_files_only=False)
    folder = Path(config)
    cls = _pipeline_class(folder)
    from diffusers.loaders.single_file_utils import SingleFileComponentError

    try:
        pipe = cls.from_single_file(str(path), config=str(folder), local_files_only=local_files_only)
    except (RuntimeError, SingleFileComponentError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        if isinstance(e, RuntimeError) and not lines[0].startswith("Error(s) in loading state_dict"):
            raise
        detail = lines[1] if isinstance(e, RuntimeError) and len(lines) > 1 else lines[0]
        raise ValueError(
            f"--model {str(path)!r} does not fit the architecture of --config {str(folder)!r}: {detail}"
        ) from e
    _check_complete(pipe, path, folder)
    return pipe


def _checkpoint_shapes(path: Path) -> dict:
    """Every tensor of a checkpoint file as a meta tensor of its shape (weights are not loaded)."""
    import torch

    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            return {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}
    import zipfile

    state = torch.load(path, map_location="meta", weights_only=True, mmap=zipfile.is_zipfile(path))
    while "state_dict" in state:
        state = state["state_dict"]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _check_complete(pipe, path: Path, folder: Path) -> None:
    """Every UNet, VAE and CLIP-L text-encoder weight was in the checkpoint (diffusers' key conversion rerun
    on shapes only): diffusers loads with strict=False, so a weight the file lacks stays random."""
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_ldm_unet_checkpoint,
        convert_ldm_vae_checkpoint,
    )

    ckpt = _checkpoint_shapes(path)
    found = {}
    if type(getattr(pipe, "unet", None)).__name__ == "UNet2DConditionModel":
        found["unet"] = convert_ldm_unet_checkpoint(ckpt, pipe.unet.config)
    if type(getattr(pipe, "vae", None)).__name__ == "AutoencoderKL":
        found["vae"] = convert_ldm_vae_checkpoint(ckpt, pipe.vae.config)
    clip = convert_ldm_clip_checkpoint(ckpt)  # empty for OpenCLIP layouts (SD 2.x), not checked here
    if clip and type(getattr(pipe, "text_encoder", None)).__name__.startswith("CLIPTextModel"):
        found["text_encoder"] = clip
    for name, converted in found.items():
        have = {k.removeprefix("text_model.") for k, v in converted.items() if v is not None}
        want = {k.removeprefix("text_model.") for k in getattr(pipe, name).state_dict()}
        missing = sorted(want - have)
        if missing:
            raise ValueError(
                f"--model {str(path)!r} lacks {len(missing)} of the {len(want)} {name} weights that --config "
                f"{str(folder)!r} describes (e.g. {missing[0]!r}); they would stay random: give the config "
                "folder of the checkpoint's own architecture"
            )


def _pipeline_class(folder: Path):
    """The pipeline class a diffusers folder names in model_index.json ('_class_name')."""
    import json

    import diffusers

    index = folder / "model_index.json"
    if not folder.is_dir() or not index.is_file():
        what = "does not exist" if not folder.exists() else "has no model_index.json"
        raise ValueError(
            f"--config {str(folder)!r} {what}: give a diffusers pipeline folder (model_index.json, "
            "component configs, tokenizer) of the checkpoint's architecture"
        )
    name = json.loads(index.read_text()).get("_class_name")
    cls = getattr(diffusers, str(name), None)
    if cls is None or not hasattr(cls, "from_single_file"):
        raise ValueError(
            f"{str(index)!r} names pipeline class {name!r}, which diffusers cannot load from a single file"
        )
    return cls


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

    from .diffusion import Region, TiledDenoiser
    from .vae import TiledVAE

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
    from .sinks import open_sink

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
    from .distributed import rank_world, resolve_group

    return rank_world(resolve_group(tv.process_group))[0] == 0


def vae_factor(vae) -> int:
    """Pixels per latent pixel of an AutoencoderKL-style VAE (8 for SD): 2 ** (blocks - 1)."""
    return int(2 ** (len(vae.config.block_out_channels) - 1))


def decode_file(
    loaded: Loaded,
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
    """Decode a latents .safetensors (key 'latents', scaled like a pipeline's output) to an image file."""
    from safetensors.torch import load_file

    from .vae import TiledVAE

    tensors = load_file(latents_path)
    if "latents" not in tensors:
        raise ValueError(f"{latents_path!r} has no 'latents' tensor (keys: {sorted(tensors)})")
    z = tensors["latents"].to(loaded.pipe.vae.device, loaded.pipe.vae.dtype)
    if z.ndim == 3:
        z = z[None]
    sf, shift = latent_scale(loaded.pipe.vae)
    tv = TiledVAE(loaded.pipe.vae, tile_size=tile_size, mode=mode, memory_budget=budget, staging=staging,
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
    loaded: Loaded,
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

    With `process_group` every rank encodes its band of tiles and rank 0 writes the file."""
    from safetensors.torch import save_file

    from .vae import TiledVAE

    vae = loaded.pipe.vae
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
