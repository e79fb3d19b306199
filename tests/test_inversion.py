"""Tiled DDIM inversion: inverting then sampling with the same model, prompt and steps gives the input back.

The oracle is the encoded input latent itself. The embedded (trained) model on a scikit-image photograph
(64x64 px: a 8x8 latent, tiles of 4 with overlap 2, Mixture of Diffusers, guidance 4, strength 0.5):
inversion's error is first order in the step size (the model is evaluated at the next level's
timestep on the current latent), so it halves as the steps double. Measured on this machine (max abs /
RMS over the latent, whose std is about 1.1; re-noising moves it by 0.40-0.77 RMS):

    steps  4: 0.738 / 0.242    steps  8: 0.404 / 0.133    steps 16: 0.230 / 0.076
    steps 32: 0.126 / 0.043    steps 64: 0.068 / 0.024
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
skimage = pytest.importorskip("skimage")

import tilewise as tw  # noqa: E402
from tilewise.diffusion.inversion import ddim_invert, start_from  # noqa: E402

torch.set_num_threads(1)
MEASURED_MAX = {4: 0.738, 8: 0.404, 16: 0.230}  # see the module docstring
STRENGTH = 0.5


@pytest.fixture(scope="module")
def setup():
    from diffusers import StableDiffusionImg2ImgPipeline

    from tilewise.models import default_prompt_embeds, load_default_pipeline

    pipe = load_default_pipeline()
    photo = skimage.data.astronaut()[:256:4, 128:384:4].copy()  # 64x64, the astronaut's face
    x = torch.from_numpy(photo).permute(2, 0, 1)[None].float() / 127.5 - 1
    with torch.no_grad():
        z0 = pipe.vae.encode(x).latent_dist.mean * pipe.vae.config.scaling_factor
    i2i = StableDiffusionImg2ImgPipeline(**pipe.components)
    i2i.set_progress_bar_config(disable=True)
    i2i.unet = tw.TiledDenoiser(pipe.unet, tile_size=4, overlap=2, method="mixture")
    kw = dict(guidance_scale=4.0, **default_prompt_embeds(pipe, "astronaut"))
    return i2i, z0, kw, pipe.scheduler


def _roundtrip(setup, steps: int) -> float:
    i2i, z0, kw, scheduler = setup
    i2i.scheduler = scheduler
    with torch.no_grad():
        zt = ddim_invert(i2i, z0, STRENGTH, steps, int(steps * STRENGTH), **kw)
        start_from(i2i, zt)
        zr = i2i(image=z0, strength=STRENGTH, num_inference_steps=steps, output_type="latent", **kw).images
    assert i2i.unet.count(8, 8) > 1  # several tiles
    return float((zr - z0).abs().max())


def test_inversion_then_sampling_recovers_the_input_latent_and_shrinks_with_steps(setup):
    errors = {k: _roundtrip(setup, k) for k in MEASURED_MAX}
    for k, e in errors.items():  # the measured tolerance, with a quarter of slack for other CPUs
        assert e <= 1.25 * MEASURED_MAX[k], errors
    assert errors[8] <= 0.65 * errors[4] and errors[16] <= 0.65 * errors[8], errors  # halves per doubling


def test_upscale_with_inversion_is_deterministic_and_differs_from_fresh_noise():
    from tilewise.models import default_prompt_embeds, load_default_pipeline

    pipe = load_default_pipeline()
    photo = skimage.data.astronaut()[:256:8, 128:384:8].copy()  # 32x32
    photo = torch.from_numpy(photo).permute(2, 0, 1).float() / 255
    kw = dict(scale=2, strength=0.5, tile_size=4, overlap=2, num_inference_steps=4, guidance_scale=4.0,
              disable=True, **default_prompt_embeds(pipe, "astronaut"))
    a = tw.upscale(pipe, photo, inversion_steps=2, **kw)
    b = tw.upscale(pipe, photo, inversion_steps=2, **kw)
    plain = tw.upscale(pipe, photo, **kw)
    assert a.shape == plain.shape == (1, 3, 64, 64) and torch.equal(a, b)
    assert (a - plain).abs().max() > 1e-2


def test_inversion_is_refused_where_ddim_cannot_invert():
    from tiny_transformers import flux

    pipe, _ = flux()
    with pytest.raises(ValueError, match=r"inversion_steps needs a DDPM-family scheduler .* "
                                         r"FlowMatchEulerDiscreteScheduler is not one"):
        tw.upscale(pipe, torch.rand(3, 16, 16), inversion_steps=2, disable=True)
    from tilewise.models import load_default_pipeline

    bound = r"inversion_steps must be an int in \[0, 1000\] \(0: fresh .*\), got -1"
    with pytest.raises(ValueError, match=bound):
        tw.upscale(load_default_pipeline(), torch.rand(3, 16, 16), inversion_steps=-1)
