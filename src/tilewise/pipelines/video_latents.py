"""The latents files of the video VAEs whose pipelines lay their latents out their own way (`decode` /
`encode --model`): what a file holds, and the raw latents the VAE decodes.

- AutoencoderKLCosmos (CosmosTextToWorldPipeline, CosmosVideoToWorldPipeline: Cosmos 1.0; the Cosmos 2 /
  2.5 pipelines use the Wan VAE): z = (raw - latents_mean) * sigma_data / latents_std, (1, C, T, h, w),
  as the pipelines' denoiser sees them (their decode: raw = z * latents_std / sigma_data + latents_mean;
  video2world's encode of its conditioning frames the inverse). latents_mean / latents_std are the VAE
  config's lists viewed (1, C, -1, 1, 1) and cut to the T latent frames (per channel and frame); where the
  config names no latents_mean, z = raw * sigma_data. sigma_data is the scheduler's (EDMEulerScheduler's
  config): an encode records it in the file's metadata and a decode reads it from there; else the --model
  pipeline folder's scheduler config's; else 0.5, EDMEulerScheduler's default and the Cosmos 1.0
  pipelines' (said in the log).
- AutoencoderKLTemporalDecoder (StableVideoDiffusionPipeline): z = raw * scaling_factor, (1, C, T, h, w):
  the pipeline's (1, F, C, h, w) latents with their frames along T, the layout of the other video
  families' files. Decoded as the pipeline's decode_latents: calls of `frames_per_call` frames
  (decode_chunk_size; all the frames by default, as the pipeline's call), each with num_frames = its
  frames (the frames of one call mix, so the chunking is part of the result); encoded frame by frame (its
  encoder is 2-D: each frame an image), the posterior's mean.
- AutoencoderKLHunyuanVideo15 (HunyuanVideo15Pipeline, its image2video), AutoencoderKLMagvit
  (EasyAnimatePipeline, its inpaint / control) and AutoencoderKLCogVideoX (CogVideoXPipeline, its
  image2video / video2video, CogVideoXFun): z = raw * scaling_factor, (1, C, T, h, w), nothing else:
  their decode steps divide by scaling_factor alone (CogVideoX's config may name a shift_factor and
  latents_mean / latents_std, which its pipelines never read; its pipelines' (1, F, C, h, w) latents go
  here with their frames along T, as SVD's). CogVideoX 1.5's pipelines pad their latents with
  patch_size_t - T % patch_size_t frames at the start and drop them before the decode step, but
  output_type="latent" returns them padded: a file holds the frames the decode step takes.
- AutoencoderKLAllegro (AllegroPipeline, text to video: its decode_latents divides by scaling_factor alone):
  z = raw * scaling_factor, (1, C, T, h, w), the pipeline's own latents; its decode returns frames first,
  (B, T, C, H, W), but the file's decode streams the program's frames to the sink (frames along T, as every
  family's); its encode takes 4 k frames (refused from the video's header, before the VAE is lowered).

Pixels: integer frames are read and written as the family's pipeline converts them. Most pipelines
(VideoProcessor) take pixels / (max / 2) - 1; Kandinsky6SRPipeline's K-VAE was trained on pixels / 128 - 1
(its encode_video rescales VideoProcessor's frames by 127.5 / 128, its decode_latents back, clamped), so its
8-bit pixels are read as p / 128 - 1 and written as round((v + 1) * 128), clamped (16-bit: 32768). Float
frames (.npy, 32-bit TIFF) hold the VAE's own values, as for every family.

torch is imported inside the functions (see `pipelines.video`).
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import BadInputFile

logger = logging.getLogger(__name__)

COSMOS, SVD = "AutoencoderKLCosmos", "AutoencoderKLTemporalDecoder"
# the classes whose pipelines scale their latents by scaling_factor alone (whatever else the config names)
SCALED = (SVD, "AutoencoderKLHunyuanVideo15", "AutoencoderKLMagvit", "AutoencoderKLCogVideoX",
          "Kandinsky6SRVAE", "AutoencoderKLAllegro")
OWN_LAYOUT = (COSMOS, *SCALED)  # the classes whose latents files this module lays out
# the classes whose pipelines map integer pixels p to p / 2^(bits - 1) - 1 (module docstring)
LEVEL_PIXELS = ("Kandinsky6SRVAE",)
SIGMA_DATA = 0.5  # EDMEulerScheduler's default sigma_data, that of the Cosmos 1.0 pipelines' scheduler


def pixel_scale(vae) -> str:
    """How the family's pipeline reads integer pixels: "max" (p / (max / 2) - 1) or "levels" (p /
    2^(bits - 1) - 1: `LEVEL_PIXELS`), as `frames.load_video` takes it."""
    return "levels" if type(vae).__name__ in LEVEL_PIXELS else "max"


def value_range(vae, bits: int) -> tuple[float, float]:
    """The values an integer sink of `bits` maps to its pixels 0 .. max for the family (`pixel_scale`):
    (-1, 1), or (-1, max / 2^(bits - 1) - 1), whose pixels are round((v + 1) 2^(bits - 1)), clamped."""
    if pixel_scale(vae) == "max" or bits not in (8, 16):
        return -1.0, 1.0
    return -1.0, ((1 << bits) - 1) / (1 << (bits - 1)) - 1


def has_own_layout(vae) -> bool:
    """Whether `vae`'s latents files are laid out here (Cosmos, `SCALED`)."""
    return type(vae).__name__ in OWN_LAYOUT


def file_metadata(path: str) -> dict[str, str]:
    """The string metadata of a .safetensors file (empty where it has none)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


def sigma_data(metadata: dict[str, str], scheduler: float | None, path: str = "") -> float:
    """Cosmos' sigma_data for a latents file: its metadata's, else the pipeline's scheduler's, else 0.5
    (module docstring); BadInputFile for metadata that is not a positive number."""
    text = metadata.get("sigma_data")
    if text is not None:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise BadInputFile(f"latents file {path!r} records sigma_data={text!r}: a positive number is "
                               "valid (the scheduler's sigma_data its latents were scaled by)")
        return value
    if scheduler is not None:
        return float(scheduler)
    logger.info("AutoencoderKLCosmos latents: no sigma_data recorded in the file nor in a pipeline's "
                "scheduler config: taking %s (EDMEulerScheduler's default, the Cosmos 1.0 pipelines')",
                SIGMA_DATA)
    return SIGMA_DATA


def cosmos_norm(vae, frames: int) -> tuple[Any, Any] | None:
    """Cosmos' latents_mean and latents_std for T = `frames` latent frames, (1, C, T, 1, 1) float32 on
    the CPU (None where the config names none); BadInputFile where they do not cover the frames."""
    import torch

    cfg = vae.config
    if cfg.get("latents_mean") is None:
        return None
    c = int(cfg.latent_channels)
    mean, std = torch.tensor(cfg.latents_mean).float(), torch.tensor(cfg.latents_std).float()
    if mean.numel() != std.numel() or mean.numel() % c:
        raise BadInputFile(f"{COSMOS}'s config holds {mean.numel()} latents_mean and {std.numel()} "
                           f"latents_std values: the pipelines view each as ({c} channels, frames)")
    mean, std = mean.view(1, c, -1, 1, 1), std.view(1, c, -1, 1, 1)
    if mean.shape[2] < frames:
        raise BadInputFile(f"the latents have {frames} frames, but {COSMOS}'s config's latents_mean / "
                           f"latents_std cover {mean.shape[2]} ({c} channels x {mean.shape[2]} frames): "
                           f"its pipelines decode at most {mean.shape[2]} latent frames")
    return mean[:, :, :frames], std[:, :, :frames]


def raw_of(vae, z, sigma: float | None = None):
    """A latents file's (1, C, T, h, w) tensor as the VAE decodes it (raw), float32 on the CPU; `sigma`:
    Cosmos' sigma_data (`sigma_data`)."""
    z = z.float()
    if type(vae).__name__ in SCALED:
        return z / _scaling(vae)
    norm = cosmos_norm(vae, z.shape[2])
    return z / sigma if norm is None else z * norm[1] / sigma + norm[0]


def file_of(vae, raw, sigma: float | None = None) -> tuple[Any, dict[str, str]]:
    """An encode's raw (1, C, T, h, w) latent as its latents file holds it (float32 on the CPU), and the
    file's metadata (how it is normalised)."""
    raw = raw.detach().float().cpu()
    name = type(vae).__name__
    if name in SCALED:
        sf = _scaling(vae)
        return (raw * sf).contiguous(), {"normalised": "z * scaling_factor", "scaling_factor": str(sf),
                                         "vae": name}
    norm = cosmos_norm(vae, raw.shape[2])
    z = raw * sigma if norm is None else (raw - norm[0]) * sigma / norm[1]
    how = "z * sigma_data" if norm is None else "(z - latents_mean) * sigma_data / latents_std"
    return z.contiguous(), {"normalised": how, "sigma_data": str(sigma), "vae": name}


def _scaling(vae) -> float:
    """The config's scaling_factor (1 where it names none)."""
    return float(vae.config.get("scaling_factor") or 1.0)


def encode_frames(tv, x):
    """SVD's encode of a (1, 3, T, H, W) video, frame by frame (each an image of its 2-D encoder): the
    posteriors' means as (1, C, T, h, w)."""
    import torch

    with torch.no_grad():
        means = [tv.encode(x[:, :, t]).latent_dist.mean for t in range(x.shape[2])]
    return torch.stack(means, dim=2)


class FrameWindow:
    """Frames t0 .. t0 + frames of a video sink, as a sink of `frames` frames (one decode call's, of SVD's
    calls of decode_chunk_size frames)."""

    def __init__(self, sink, t0: int, frames: int):
        self.sink, self.t0, self.frames = sink, t0, frames
        self.height, self.width = sink.height, sink.width
        self.random_access = getattr(sink, "random_access", False)

    def write(self, t0: int, y0: int, x0: int, block) -> None:
        if t0 + block.shape[1] > self.frames:
            raise ValueError(f"a block of frames {t0}..{t0 + block.shape[1] - 1} does not fit this call's "
                             f"{self.frames} frames")
        self.sink.write(self.t0 + t0, y0, x0, block)
