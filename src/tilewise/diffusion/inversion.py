"""DDIM inversion as schedulers a stock img2img pipeline runs: up from the clean latent, then down from there.

DDIM's deterministic update (Song et al. 2021, eq. 12 with eta = 0) run backwards inverts an image
(Dhariwal & Nichol 2021; Mokady et al. 2023, null-text inversion): from x at level a' (the previous
timestep, or the clean latent) to level a at timestep t,

    x0 = (x - sqrt(1 - a') eps) / sqrt(a'),   x_t = sqrt(a) x0 + sqrt(1 - a) eps,   eps = model(x, t)

with the model evaluated at the target timestep (diffusers' `DDIMInverseScheduler` convention). The
img2img pipeline then samples down from x_t instead of from the re-noised latent.

Both passes go through the pipeline itself, so the denoiser (a TiledDenoiser: the same tiles, fusion and
conditioning) is called as in any img2img run: `DDIMInversion` at strength 1 walks the ascending levels
and leaves the encoded latent un-noised; `StartFrom` is the forward DDIM whose "noised" starting point is
the inverted latent. They are schedulers of their own (subclasses), not changes to diffusers' classes.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from diffusers import DDIMScheduler
from diffusers.schedulers.scheduling_ddim import DDIMSchedulerOutput

logger = logging.getLogger(__name__)


def img2img_timesteps(config, steps: int, strength: float) -> list[int]:
    """The timesteps DDIM runs in an img2img call of `steps` steps at `strength` (descending)."""
    forward = DDIMScheduler.from_config(config)
    forward.set_timesteps(steps)
    k = min(int(steps * strength), steps)
    return [int(t) for t in forward.timesteps[steps - k :]]


def inversion_levels(config, steps: int, strength: float, inversion_steps: int) -> list[int]:
    """Ascending timesteps from the sampler's lowest to its first: the sampler's own when the counts match."""
    tail = img2img_timesteps(config, steps, strength)
    if not tail:
        raise ValueError(f"strength {strength} with {steps} steps runs no denoising step to invert to")
    lo, hi = tail[-1], tail[0]
    return [int(round(v)) for v in np.linspace(lo, hi, inversion_steps)] if inversion_steps > 1 else [hi]


def _split(scheduler, output: torch.Tensor, sample: torch.Tensor, a: torch.Tensor):
    """(x0, eps) from the model output for a sample at level a (epsilon, v or sample prediction)."""
    kind = scheduler.config.prediction_type
    if kind == "epsilon":
        return (sample - (1 - a) ** 0.5 * output) / a**0.5, output
    if kind == "v_prediction":
        return a**0.5 * sample - (1 - a) ** 0.5 * output, a**0.5 * output + (1 - a) ** 0.5 * sample
    if kind == "sample":
        return output, (sample - a**0.5 * output) / (1 - a) ** 0.5
    raise ValueError(f"prediction_type must be epsilon, v_prediction or sample, got {kind!r}")


class DDIMInversion(DDIMScheduler):
    """DDIM backwards over `levels` (ascending timesteps); `add_noise` returns the clean latent."""

    levels: list[int] = []

    def set_timesteps(self, num_inference_steps: int, device=None) -> None:
        if num_inference_steps != len(self.levels):
            raise ValueError(f"DDIMInversion has {len(self.levels)} levels, asked for {num_inference_steps} "
                             "steps")
        self.num_inference_steps = num_inference_steps
        self.timesteps = torch.tensor(self.levels, dtype=torch.long, device=device)

    def add_noise(self, original_samples, noise, timesteps):
        return original_samples  # inversion starts from the encoded image itself

    def _alpha(self, t: int) -> torch.Tensor:
        return self.alphas_cumprod[t] if t >= 0 else self.final_alpha_cumprod

    def step(self, model_output, timestep, sample, eta: float = 0.0, use_clipped_model_output: bool = False,
             generator=None, variance_noise=None, return_dict: bool = True):
        """One step up: from the previous level (or the clean latent) to `timestep`."""
        t = int(timestep)
        i = self.levels.index(t)
        a_prev = self._alpha(self.levels[i - 1] if i > 0 else -1).to(sample.device)
        a = self._alpha(t).to(sample.device)
        x0, eps = _split(self, model_output, sample, a_prev)
        x_t = a**0.5 * x0 + (1 - a) ** 0.5 * eps
        if not return_dict:
            return (x_t,)
        return DDIMSchedulerOutput(prev_sample=x_t, pred_original_sample=x0)


class StartFrom(DDIMScheduler):
    """DDIM whose img2img starting point is `start` (an inverted latent) instead of the re-noised image."""

    start: torch.Tensor | None = None

    def add_noise(self, original_samples, noise, timesteps):
        if self.start is None or self.start.shape != original_samples.shape:
            got = None if self.start is None else tuple(self.start.shape)
            raise ValueError(f"StartFrom needs a start latent of shape {tuple(original_samples.shape)}, "
                             f"got {got}")
        return self.start.to(original_samples.device, original_samples.dtype)


def check_invertible(scheduler) -> None:
    """DDIM inversion needs a DDPM-family noise schedule (alphas_cumprod), without sample clipping."""
    config = scheduler.config
    if getattr(scheduler, "alphas_cumprod", None) is None or "beta_schedule" not in config:
        raise ValueError(f"inversion_steps needs a DDPM-family scheduler (DDIM, DDPM, Euler, DPM-Solver, "
                         f"...: betas and alphas_cumprod); {type(scheduler).__name__} is not one "
                         "(flow-matching pipelines: SD3, Flux); use inversion_steps=0")
    if config.get("clip_sample") or config.get("thresholding"):
        raise ValueError("inversion_steps: the scheduler clips or thresholds its samples (clip_sample / "
                         "thresholding), which DDIM inversion cannot undo; give a scheduler without them")


def ddim_invert(i2i, image, strength: float, steps: int, inversion_steps: int, **pipe_kwargs) -> torch.Tensor:
    """The latent at the first timestep of `i2i(image, strength, steps)`, DDIM-inverted from the encoded
    image in `inversion_steps` steps by the pipeline itself (its denoiser and conditioning: `pipe_kwargs`);
    `image` may be pixels or a latent. The pipeline's scheduler is left a `DDIMInversion`; `start_from`
    then sets the sampler."""
    check_invertible(i2i.scheduler)
    config = i2i.scheduler.config
    inverse = DDIMInversion.from_config(config)
    inverse.levels = inversion_levels(config, steps, strength, inversion_steps)
    i2i.scheduler = inverse
    logger.info("DDIM inversion in %d steps up to timestep %d", inversion_steps, inverse.levels[-1])
    return i2i(image=image, strength=1.0, num_inference_steps=inversion_steps, output_type="latent",
               **pipe_kwargs).images


def start_from(i2i, latent: torch.Tensor) -> None:
    """Make the img2img pipeline's next run start from `latent` (DDIM sampling, no fresh noise)."""
    forward = StartFrom.from_config(i2i.scheduler.config)
    forward.start = latent
    i2i.scheduler = forward
