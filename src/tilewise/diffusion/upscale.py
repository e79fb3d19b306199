"""Tiled upscaling: Lanczos resize, encode, noise to `strength`, tiled denoise, decode, crop to scale x."""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from tqdm.auto import tqdm

from ..limits import MAX_STEPS, check_count
from .controlnet import TiledControlNet
from .fusion import TiledDenoiser

logger = logging.getLogger(__name__)


def _to_tensor(image: Any) -> tuple[torch.Tensor, str]:
    """(B, 3, H, W) float32 in [0, 1] and the input kind ("pil" or "pt")."""
    if isinstance(image, Image.Image):
        arr = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
        return torch.from_numpy(arr).permute(2, 0, 1)[None].contiguous(), "pil"
    if isinstance(image, torch.Tensor):
        x = image[None] if image.ndim == 3 else image
        if x.ndim != 4 or x.shape[1] != 3:
            raise ValueError(f"image tensor must be (3, H, W) or (B, 3, H, W), got {tuple(image.shape)}")
        if float(x.min()) < 0 or float(x.max()) > 1:
            lo, hi = float(x.min()), float(x.max())
            raise ValueError(f"image tensor values must lie in [0, 1], got [{lo}, {hi}]")
        return x.detach().float().cpu(), "pt"
    raise ValueError(f"image must be a PIL.Image or a torch.Tensor in [0, 1], got {type(image).__name__}")


def lanczos_resize(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Lanczos (PIL, float per channel) resize of a (B, C, H, W) [0, 1] tensor to size (h, w), clipped."""
    h, w = size
    out = torch.empty((*x.shape[:2], h, w))
    for b in range(x.shape[0]):
        for c in range(x.shape[1]):
            img = Image.fromarray(x[b, c].numpy().astype(np.float32), mode="F")
            out[b, c] = torch.from_numpy(np.array(img.resize((w, h), Image.LANCZOS), dtype=np.float32))
    return out.clamp(0, 1)


def _pad_to(x: torch.Tensor, multiple: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """Pad bottom/right to multiples of `multiple` (reflect, replicate where too small)."""
    H, W = x.shape[-2:]
    ph, pw = -H % multiple, -W % multiple
    if ph == 0 and pw == 0:
        return x, (0, 0)
    mode = "reflect" if ph < H and pw < W else "replicate"
    logger.info("upscale: padding the %dx%d image by (%d, %d) to multiples of %d (%s); cropped after decode",
                H, W, ph, pw, multiple, mode)
    return F.pad(x, (0, pw, 0, ph), mode=mode), (ph, pw)


def _img2img(pipe: Any, controlnet: Any = None) -> Any:
    """The pipeline's image-to-image variant (its ControlNet variant with `controlnet`), sharing its
    components (the input pipeline is not modified)."""
    from diffusers import AutoPipelineForImage2Image, DiffusionPipeline  # (lazy: seconds to import)

    if controlnet is not None:
        return AutoPipelineForImage2Image.from_pipe(pipe, controlnet=controlnet)
    if "Img2Img" in type(pipe).__name__:
        return DiffusionPipeline.from_pipe(pipe)
    return AutoPipelineForImage2Image.from_pipe(pipe)


def denoiser_attr(pipe: Any) -> str:
    """Where the pipeline keeps its denoiser: `unet` (SD family) or `transformer` (SD3, Flux, ...)."""
    for attr in ("unet", "transformer"):
        if getattr(pipe, attr, None) is not None:
            return attr
    raise ValueError(f"{type(pipe).__name__} has neither a unet nor a transformer to denoise with")


def _vae(vae: Any, vae_tile_size: int | None, disable: bool, process_group: Any = None) -> Any:
    """TiledVAE (exact) when `vae_tile_size` is given and tilewise.vae is available, else the plain VAE."""
    if vae_tile_size is None:
        return vae
    if importlib.util.find_spec("tilewise.vae") is None:
        logger.warning("upscale: vae_tile_size=%s given but tilewise.vae is not available; "
                       "using the plain VAE", vae_tile_size)
        return vae
    from ..vae import TiledVAE  # (lazy: optional here, as the find_spec check above says)

    return TiledVAE(vae, tile_size=vae_tile_size, progress=not disable, process_group=process_group)


@torch.no_grad()
def _decode(vae: Any, latents: torch.Tensor, base_vae: Any, pipe: Any = None, size=None) -> torch.Tensor:
    """Latents -> images in [0, 1]: unpack packed tokens (Flux), undo the scaling (and shift), decode."""
    if latents.ndim == 3 and hasattr(pipe, "_unpack_latents"):
        latents = pipe._unpack_latents(latents, size[0], size[1], pipe.vae_scale_factor)
    cfg = base_vae.config
    z = latents / cfg.scaling_factor
    if getattr(cfg, "shift_factor", None):
        z = z + cfg.shift_factor
    out = vae.decode(z.to(base_vae.dtype), return_dict=False)[0]
    return (out.float() / 2 + 0.5).clamp(0, 1)


@dataclass(frozen=True)
class UpscaleOptions:
    """The options of `upscale` (its keyword arguments but the model objects, the generator, the callback and
    the pipeline's own arguments), checked when built: scale > 0, strength in (0, 1] leaving at least one
    denoising step, inversion_steps an int >= 0."""

    scale: float = 2
    strength: float = 0.3
    tile_size: int = 64
    overlap: int = 16
    method: str = "mixture"
    vae_tile_size: int | None = None
    num_inference_steps: int = 20
    seed: int = 0
    batch_size: int = 1
    disable: bool = False
    denoiser_kwargs: dict | None = None
    process_group: Any = None
    inversion_steps: int = 0

    def __post_init__(self) -> None:
        scale, strength, steps = self.scale, self.strength, self.num_inference_steps
        check_count("num_inference_steps", steps, 1, MAX_STEPS, "schedulers are trained on 1000 timesteps")
        check_count("inversion_steps", self.inversion_steps, 0, MAX_STEPS,
                    "0: fresh noise; schedulers are trained on 1000 timesteps")
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        if not 0 < strength <= 1:
            raise ValueError(f"strength must be in (0, 1], got {strength}")
        if int(steps * strength) < 1:
            raise ValueError(f"strength {strength} of num_inference_steps {steps} leaves no "
                             f"denoising step (int({steps} * {strength}) = 0): use at least "
                             f"{math.ceil(1 / strength)} steps")


def upscale(
    pipe: Any,
    image: Any,
    scale: float = 2,
    strength: float = 0.3,
    tile_size: int = 64,
    overlap: int = 16,
    method: str = "mixture",
    vae_tile_size: int | None = None,
    *,
    num_inference_steps: int = 20,
    generator: torch.Generator | None = None,
    seed: int = 0,
    callback: Callable[[int, Any, torch.Tensor], None] | None = None,
    batch_size: int = 1,
    disable: bool = False,
    denoiser_kwargs: dict | None = None,
    process_group: Any = None,
    controlnet: Any = None,
    inversion_steps: int = 0,
    **pipe_kwargs: Any,
) -> Any:
    """Tiled img2img upscaling (Ultimate-SD-upscale style): returns exactly round(scale x input size).

    `image` is a PIL image (returns PIL) or a [0, 1] tensor (3, H, W) / (B, 3, H, W) (returns a tensor).
    `pipe_kwargs` go to the img2img pipeline (prompt or prompt_embeds, guidance_scale, ...). `callback` is
    called after every step as callback(step, timestep, latents). With `process_group` (every rank calls
    this) the denoiser's and the VAE's tiles are split over the ranks; every rank returns the same image.
    `controlnet` (a tile ControlNet, e.g. ControlNetModel): the pipeline's ControlNet img2img variant runs
    it per tile (`TiledControlNet`) with the resized input as every tile's control image (its crop).
    `inversion_steps` N > 0: instead of fresh noise, the encoded input is DDIM-inverted in N steps up to the
    first denoising timestep under the same tiled denoiser and conditioning, and DDIM samples down from
    there (`tilewise.diffusion.inversion`; both passes use DDIM built from the pipeline's scheduler).
    The options are those of `UpscaleOptions`; `run_upscale` takes them as that record.
    """
    options = UpscaleOptions(
        scale=scale, strength=strength, tile_size=tile_size, overlap=overlap, method=method,
        vae_tile_size=vae_tile_size, num_inference_steps=num_inference_steps, seed=seed,
        batch_size=batch_size, disable=disable, denoiser_kwargs=denoiser_kwargs, process_group=process_group,
        inversion_steps=inversion_steps,
    )
    return run_upscale(pipe, image, options, generator=generator, callback=callback, controlnet=controlnet,
                       **pipe_kwargs)


def run_upscale(
    pipe: Any,
    image: Any,
    options: UpscaleOptions,
    *,
    generator: torch.Generator | None = None,
    callback: Callable[[int, Any, torch.Tensor], None] | None = None,
    controlnet: Any = None,
    **pipe_kwargs: Any,
) -> Any:
    """`upscale` with its options as one record (the CLI's form), in the steps of a pipeline's __call__."""
    o = options
    # 1. check the input; the output is round(scale x its size)
    x, kind = _to_tensor(image)
    H, W = x.shape[-2:]
    size = (max(1, round(H * o.scale)), max(1, round(W * o.scale)))
    if o.inversion_steps:
        from .inversion import check_invertible  # (lazy: inversion imports diffusers)

        check_invertible(pipe.scheduler)  # before the expensive work
    # 2. Lanczos resize
    x = lanczos_resize(x, size)
    # 3. the pipeline's img2img variant (its ControlNet one with `controlnet`), sharing its components
    attr = denoiser_attr(pipe)
    model = getattr(pipe, attr)
    model = model.unet if isinstance(model, TiledDenoiser) else model
    if controlnet is not None:
        controlnet = controlnet if isinstance(controlnet, TiledControlNet) else TiledControlNet(controlnet)
    i2i = _img2img(pipe, controlnet)
    s = i2i.vae_scale_factor
    # 4. pad to whole latent pixels (transformers: whole 2x2 patches); cropped after decode
    x, _ = _pad_to(x, s if attr == "unet" else 2 * s)
    # 5. tile the denoiser and the VAE
    denoiser = TiledDenoiser(model, tile_size=o.tile_size, overlap=o.overlap, method=o.method,
                             batch_size=o.batch_size, seed=o.seed, vae_scale_factor=s,
                             process_group=o.process_group, **(o.denoiser_kwargs or {}))
    setattr(i2i, attr, denoiser)
    i2i.vae = _vae(pipe.vae, o.vae_tile_size, o.disable, o.process_group)
    i2i.set_progress_bar_config(disable=True)
    # 6. the pipeline's arguments: generator, control image, size
    generator = generator if generator is not None else torch.Generator().manual_seed(o.seed)
    pipe_kwargs = _call_kwargs(i2i, x, controlnet is not None, pipe_kwargs)
    # 7. noise to `strength` (or DDIM-invert) and denoise, one bar over steps x tiles
    latents = _denoise(i2i, denoiser, x, o, generator, callback, pipe_kwargs)
    # 8. decode, crop to the size asked
    out = _decode(i2i.vae, latents, pipe.vae, i2i, x.shape[-2:])[..., : size[0], : size[1]].cpu()
    return out if kind == "pt" else _to_pil(out)


def _call_kwargs(i2i: Any, x: torch.Tensor, control: bool, pipe_kwargs: dict) -> dict:
    """The img2img call's own arguments: the resized input as control image, its size where the pipeline
    takes one (Flux, SD3: else their default size), then the caller's."""
    if control:
        pipe_kwargs = {"control_image": x, **pipe_kwargs}
    if "height" in inspect.signature(i2i.__call__).parameters:
        pipe_kwargs = {"height": x.shape[-2], "width": x.shape[-1], **pipe_kwargs}
    return pipe_kwargs


def _denoise(i2i: Any, denoiser: TiledDenoiser, x: torch.Tensor, o: UpscaleOptions, generator: Any,
             callback: Callable | None, pipe_kwargs: dict) -> torch.Tensor:
    """img2img from `x` at `strength` to latents (from its DDIM inversion with `inversion_steps`), the tiled
    denoiser counting its tiles into one bar of steps x tiles."""
    s = i2i.vae_scale_factor
    steps = min(int(o.num_inference_steps * o.strength), o.num_inference_steps) * i2i.scheduler.order
    pieces = denoiser.count(x.shape[-2] // s, x.shape[-1] // s)
    total = (steps + o.inversion_steps) * pieces
    with tqdm(total=total, desc="upscale (steps x tiles)", disable=o.disable) as bar:
        denoiser.progress_bar = bar

        def on_step(_pipe, i, t, kw):
            if callback is not None:
                callback(i, t, kw["latents"])
            return kw

        if o.inversion_steps:
            from .inversion import ddim_invert, start_from  # (lazy: inversion imports diffusers)

            start = ddim_invert(i2i, x, o.strength, o.num_inference_steps, o.inversion_steps,
                                generator=generator, **pipe_kwargs)
            start_from(i2i, start)
        latents = i2i(image=x, strength=o.strength, num_inference_steps=o.num_inference_steps,
                      generator=generator, output_type="latent", callback_on_step_end=on_step,
                      **pipe_kwargs).images
        denoiser.progress_bar = None
    return latents


def _to_pil(out: torch.Tensor) -> Any:
    """The first image of a (B, 3, H, W) [0, 1] tensor as an 8-bit RGB PIL image."""
    arr = (out[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    return Image.fromarray(arr)
