"""The embedded default models: committed configs and weights, tokenizer, a real StableDiffusionPipeline
(checked step by step against a hand-written DDIM + CFG loop), determinism, held-out VAE reconstruction."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tilewise import models

# Measured held-out PSNR of the shipped VAE on the crops below (see MODEL_CARD.md), minus a few dB.
PSNR_FLOOR_DB = 18.0  # measured 20.79 dB on these four crops
# noise-prediction MSE with the tile ControlNet / without it, t = 300 and 500, on those crops
TILE_CONTROLNET_RATIO = 0.6  # measured 0.32 and 0.30


@pytest.fixture(scope="module")
def pipe():
    return models.load_default_pipeline("ddim")


def test_import_is_light():
    code = "import sys, tilewise.models; print('torch' in sys.modules, 'diffusers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_weights_are_safetensors_within_budget():
    files = sorted(p.name for p in models.MODEL_DIR.iterdir() if p.suffix in {".bin", ".pt", ".ckpt",
                                                                              ".pth", ".safetensors"})
    assert files == ["controlnet_tile.safetensors", "text_encoder.safetensors", "unet.safetensors",
                     "vae.safetensors"]
    total = sum((models.MODEL_DIR / f).stat().st_size for f in files)
    assert total <= 10 * 2**20, total


def test_loaders_give_the_committed_configs():
    vae, unet = models.load_default_vae(), models.load_default_unet()
    for module, name in ((vae, "vae"), (unet, "unet")):
        cfg = json.loads((models.MODEL_DIR / f"{name}.json").read_text())
        for k, v in cfg.items():
            got = module.config[k]
            assert (list(got) if isinstance(got, tuple) else got) == v, (name, k)
    assert list(vae.config.block_out_channels) == [32, 64, 64, 64] and vae.config.latent_channels == 4
    assert 2 ** (len(vae.config.block_out_channels) - 1) == 8  # SD's downsampling factor
    te = models.load_default_text_encoder()
    assert te.config["dim"] == unet.config.cross_attention_dim
    assert not any(p.requires_grad for p in unet.parameters()) and not unet.training
    for word in ("astronaut", "coffee", "cat", "chelsea", "grass", "gravel", "brick"):
        assert word in models.vocabulary()


def test_tokenizer_and_encode_prompt():
    tok = models.load_default_tokenizer()
    ids = tok(["Grass, brick", ""])
    assert ids.shape == (2, tok.max_length) and ids.dtype == torch.long
    assert ids[0, :2].tolist() == [tok.ids["grass"], tok.ids["brick"]] and ids[0, 2:].eq(0).all()
    assert ids[1].eq(0).all()
    with pytest.raises(ValueError, match=r"unknown word\(s\) \['dog'\].*knows only: .*astronaut"):
        tok("a dog")
    with pytest.raises(ValueError, match="at most 8"):
        tok(" ".join(["grass"] * 9))
    e = models.encode_prompt(["grass", ""])
    te = models.load_default_text_encoder()
    assert e.shape == (2, tok.max_length, te.config["dim"])
    with torch.no_grad():
        torch.testing.assert_close(e, te(ids.new_tensor([[tok.ids["grass"]] + [0] * 7, [0] * 8])),
                                   rtol=0, atol=0)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="scheduler must be one of"):
        models.load_default_scheduler("heun2")
    with pytest.raises(ValueError, match="dtype must be one of"):
        models.load_default_vae(dtype="float8")
    with pytest.raises(ValueError, match="no embedded model config 'clip'"):
        models.load_config("clip")


@pytest.mark.parametrize("name", sorted(models.SCHEDULERS))
def test_every_scheduler_uses_the_training_schedule(name):
    s = models.load_default_scheduler(name)
    cfg = models.load_config("scheduler")
    assert s.config.num_train_timesteps == cfg["num_train_timesteps"]
    assert s.config.beta_schedule == cfg["beta_schedule"] == "scaled_linear"
    assert s.config.prediction_type == "epsilon"


def _generate(pipe, prompt, seed, steps=3, guidance=4.0, negative=""):
    g = torch.Generator().manual_seed(seed)
    return pipe(**models.default_prompt_embeds(pipe, prompt, negative), height=64, width=64,
                num_inference_steps=steps, guidance_scale=guidance, generator=g, output_type="pt").images


def test_pipeline_is_a_real_stable_diffusion_pipeline_and_deterministic(pipe):
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    assert isinstance(pipe, StableDiffusionPipeline) and isinstance(pipe.scheduler, DDIMScheduler)
    assert pipe.vae_scale_factor == 8
    a, b = _generate(pipe, "grass", 0), _generate(pipe, "grass", 0)
    assert a.shape == (1, 3, 64, 64) and torch.isfinite(a).all() and 0 <= a.min() and a.max() <= 1
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (a - _generate(pipe, "grass", 1)).abs().max() > 1e-2
    assert (a - _generate(pipe, "brick", 0)).abs().max() > 1e-3


@torch.no_grad()
def test_pipeline_matches_a_hand_written_ddim_cfg_loop(pipe):
    """Oracle: z_T ~ N(0, I) from the same generator; eps = eps_u + w (eps_c - eps_u); DDIM steps; decode."""
    w, steps, seed = 3.0, 4, 7
    out = _generate(pipe, "a photo of cat", seed, steps=steps, guidance=w)
    cond, uncond = models.encode_prompt("a photo of cat"), models.encode_prompt("")
    sched = models.load_default_scheduler("ddim")
    sched.set_timesteps(steps)
    z = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(seed)) * sched.init_noise_sigma
    for t in sched.timesteps:
        eps = pipe.unet(torch.cat([z, z]), t, encoder_hidden_states=torch.cat([uncond, cond])).sample
        eps_u, eps_c = eps.chunk(2)
        z = sched.step(eps_u + w * (eps_c - eps_u), t, z).prev_sample
    x = pipe.vae.decode(z / pipe.vae.config.scaling_factor).sample
    torch.testing.assert_close(out, (x / 2 + 0.5).clamp(0, 1), rtol=0, atol=1e-5)


def test_prompt_embeds_helper_validates_lengths(pipe):
    kw = models.default_prompt_embeds(pipe, ["grass", "brick"], "")
    assert kw["prompt_embeds"].shape == kw["negative_prompt_embeds"].shape == (2, 8, 64)
    with pytest.raises(ValueError, match="2 prompts but 3 negative"):
        models.default_prompt_embeds(pipe, ["grass", "brick"], ["", "", ""])


def _held_out_crops() -> torch.Tensor:
    """Crops from the held-out right 20% strips (never seen in training), as in training/data.py."""
    skdata = pytest.importorskip("skimage.data", reason="scikit-image provides the held-out pictures")
    crops = []
    for name in ("coffee", "brick", "astronaut", "chelsea"):
        im = torch.from_numpy(getattr(skdata, name)().copy()).float()
        im = (im[..., None].expand(*im.shape, 3) if im.ndim == 2 else im[..., :3]) / 127.5 - 1
        strip = im[:, round(im.shape[1] * 0.8):]
        x0 = (strip.shape[1] - 64) // 2
        crops.append(strip[100:164, x0:x0 + 64].permute(2, 0, 1))
    return torch.stack(crops)


@torch.no_grad()
def test_vae_reconstruction_psnr_on_held_out_crops():
    x = _held_out_crops()
    vae = models.load_default_vae()
    y = vae.decode(vae.encode(x).latent_dist.mode()).sample.clamp(-1, 1)
    psnr = 10 * torch.log10(4 / ((y - x) ** 2).mean()).item()
    assert psnr >= PSNR_FLOOR_DB, psnr


@torch.no_grad()
def test_tile_controlnet_lowers_the_denoising_error_on_held_out_crops():
    """The embedded tile ControlNet is trained: given the blurred crop (2x down, Lanczos up, as upscale
    feeds it) the UNet's noise prediction error on held-out crops drops well below the UNet's alone."""
    from tilewise.diffusion.upscale import lanczos_resize

    x = _held_out_crops()
    control = lanczos_resize(torch.nn.functional.interpolate((x + 1) / 2, scale_factor=0.5, mode="area"),
                             (64, 64))
    vae, unet, cn = models.load_default_vae(), models.load_default_unet(), models.load_default_controlnet()
    assert not cn.training and list(cn.config.block_out_channels) == list(unet.config.block_out_channels)
    z0 = vae.encode(x).latent_dist.mode() * vae.config.scaling_factor
    sched = models.load_default_scheduler("ddpm")
    emb = models.encode_prompt([""] * len(x))
    ratios = []
    for t in (300, 500):
        eps = torch.randn(z0.shape, generator=torch.Generator().manual_seed(t))
        tt = torch.full((len(x),), t)
        zt = sched.add_noise(z0, eps, tt)
        alone = ((unet(zt, tt, encoder_hidden_states=emb).sample - eps) ** 2).mean()
        down, mid = cn(zt, tt, encoder_hidden_states=emb, controlnet_cond=control, return_dict=False)
        pred = unet(zt, tt, encoder_hidden_states=emb, down_block_additional_residuals=down,
                    mid_block_additional_residual=mid).sample
        ratios.append(float(((pred - eps) ** 2).mean() / alone))
    assert max(ratios) <= TILE_CONTROLNET_RATIO, ratios
