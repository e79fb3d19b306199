"""Recipes over a diffusers pipeline: load (embedded default or local weights), generate, encode, decode.

Every recipe is a plain function the CLI calls; each keeps the denoiser and the decoder choices separate
(seed 000: tiling the denoiser changes the trajectory, tiling the VAE in exact mode does not).

One file per job: `loading` (`load_pipeline`, `Loaded`), `single_file` (a checkpoint file configured by
a local folder) and `recipes` (generate, decode_file, encode_file); this package re-exports them.
"""

from .loading import DTYPES, Loaded, load_pipeline
from .recipes import (
    GenerateResult,
    decode_file,
    encode_file,
    generate,
    latent_scale,
    load_image,
    parse_region,
    vae_factor,
)

__all__ = ["DTYPES", "GenerateResult", "Loaded", "decode_file", "encode_file", "generate", "latent_scale",
           "load_image", "load_pipeline", "parse_region", "vae_factor"]
