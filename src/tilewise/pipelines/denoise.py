"""The denoising stage both generate recipes share: the pipeline's denoiser tiled, the pipeline's own loop.

torch and `tilewise.diffusion` are imported inside the functions (see `pipelines.recipes`).
"""

from __future__ import annotations

from typing import Any

from .loading import Loaded
from .options import GenerateOptions


def tiled_denoiser(loaded: Loaded, o: GenerateOptions, regions: list, f: int, attr: str | None = None):
    """The pipeline's denoiser (or its `attr`, Wan 2.2's transformer_2) wrapped in a TiledDenoiser with the
    options' tiles, fusion, regions and frame windows."""
    from ..diffusion import TiledDenoiser  # (lazy: torch)

    batch_size = o.batch_size
    if batch_size is None:  # the embedded UNet is tiny: per-call overhead dominates, batch many tiles
        batch_size = 32 if loaded.embedded else 4
    return TiledDenoiser(getattr(loaded.pipe, attr or loaded.denoiser), tile_size=o.tile_size,
                         overlap=o.overlap, method=o.method, batch_size=batch_size, regions=regions or None,
                         seed=o.seed, vae_scale_factor=f, progress=False, process_group=o.process_group,
                         tile_frames=o.tile_frames, frame_overlap=o.frame_overlap)


def denoise(pipe, tiled: dict[str, Any], o: GenerateOptions, **call: Any):
    """The pipeline's sampling loop with its denoisers replaced by `tiled` (attribute -> TiledDenoiser; put
    back after), latents out: the pipeline's output (`.images`, a video pipeline's `.frames`)."""
    import torch  # (lazy)

    models = {attr: getattr(pipe, attr) for attr in tiled}
    for attr, denoiser in tiled.items():
        setattr(pipe, attr, denoiser)
    try:
        pipe.set_progress_bar_config(disable=not o.progress, desc="denoise")
        return pipe(**call, height=o.height, width=o.width, num_inference_steps=o.steps,
                    guidance_scale=o.guidance, generator=torch.Generator("cpu").manual_seed(o.seed),
                    output_type="latent")
    finally:
        for attr, model in models.items():
            setattr(pipe, attr, model)
