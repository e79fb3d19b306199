"""Tiled diffusion: one wrapper around any diffusers denoiser, predicting on tiles and fusing the predictions.

- `TiledDenoiser`: MultiDiffusion (uniform), Mixture of Diffusers (Gaussian), SpotDiffusion (shifted
  non-overlapping windows) and halo-crop (exact for local models), with per-tile SDXL micro-conditioning.
- `TiledControlNet`: a ControlNet (SD 1.x, SDXL, SD3, Flux; single or Multi) whose residuals the
  TiledDenoiser computes per tile, on the tile's crop of the latent and of the control image.
- `Region`: a box or mask with its own prompt embeddings that replaces the prompt where it applies.
- `upscale`: Lanczos resize, encode, noise to `strength`, tiled denoise, decode; exactly `scale` x the input.
  Its options as one record: `UpscaleOptions`, which `run_upscale` (the CLI's form) takes.

Tiling the denoiser is a different policy from tiling the decoder: unlike `TiledVAE` it changes the
denoising trajectory (each tile sees only its window), so global composition can be lost. The fused
prediction is handed to the pipeline's own scheduler, which steps the whole latent; for schedulers whose
update is affine in the model output with per-pixel constant coefficients (DDIM, Euler, Euler ancestral
with one global noise, DPM-Solver++), fusing then stepping equals stepping every tile then averaging.
Schedulers with sample clipping or dynamic thresholding (`clip_sample=True`, `thresholding=True`) are not
affine: there the two orders differ, and the wrapper implements fuse-then-step.
"""

from .controlnet import TiledControlNet
from .fusion import METHODS, TiledDenoiser
from .regions import Region
from .upscale import UpscaleOptions, run_upscale, upscale

__all__ = ["METHODS", "Region", "TiledControlNet", "TiledDenoiser", "UpscaleOptions", "run_upscale",
           "upscale"]
