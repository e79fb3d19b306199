"""Recipes over a diffusers pipeline: load (embedded default or local weights), generate, encode, decode.

Every recipe is a plain function the CLI calls; each keeps the denoiser and the decoder choices separate
(seed 000: tiling the denoiser changes the trajectory, tiling the VAE in exact mode does not).

One file per job: `loading` (`load_pipeline`, `load_vae`, `Loaded`), `single_file` (a checkpoint file
configured by a local folder), `recipes` (generate, decode_file, encode_file, and their `run_*` forms
that take the options as one record of `options`: GenerateOptions, VaeFileOptions), `denoise` (the tiled
denoiser in the pipeline's own loop, for both generates), `generate_video` (text to video: a video
pipeline's latents decoded by its 3-D VAE), `video` (the 3-D VAE forms of decode and encode: latents of
(B, C, T, H, W), video sinks) and `frames` (reading a video to encode); this package re-exports them.
"""

from .frames import load_video
from .loading import DTYPES, Loaded, load_pipeline, load_vae
from .options import GenerateOptions, VaeFileOptions
from .recipes import (
    GenerateResult,
    decode_file,
    encode_file,
    generate,
    latent_scale,
    load_image,
    parse_region,
    run_decode_file,
    run_encode_file,
    run_generate,
    vae_factor,
)
from .video import decode_video_file, encode_video_file, latent_norm

__all__ = ["DTYPES", "GenerateOptions", "GenerateResult", "Loaded", "VaeFileOptions", "decode_file",
           "decode_video_file", "encode_file", "encode_video_file", "generate", "latent_norm", "latent_scale",
           "load_image", "load_pipeline", "load_vae", "load_video", "parse_region", "run_decode_file",
           "run_encode_file", "run_generate", "vae_factor"]
