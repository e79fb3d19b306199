"""`pipe.vae = tw.TiledVAE(pipe.vae)` in stock video pipelines (issue #28): each tiny pipeline of
tests/tiny_denoisers.py called twice with the same seed, once with its stock VAE and once with the wrapped
one tiled into several tiles; the frames it returns are equal (fp32, max abs <= 1e-4).

CogVideoXPipeline's drop-in test is tests/test_video_cogvideox.py's; HunyuanVideo15Pipeline's, Allegro's
and StableVideoDiffusion's sit with their VAEs' tests.
"""

import pytest

torch = pytest.importorskip("torch")

import tiny_denoisers as td  # noqa: E402
from video_vae_support import mochi as mochi_vae  # noqa: E402
from video_vae_support import video_vae  # noqa: E402

import tilewise as tw  # noqa: E402

TOL = 1e-4


def mochi():
    """MochiPipeline with the GroupNorm-randomised Mochi VAE of the video tests; its latents_mean / std
    unset (the pipeline views them as 12 channels: these latents have 4), so it divides by scaling_factor."""
    pipe, call = td.mochi()
    pipe.vae = mochi_vae(latents_mean=None, latents_std=None)
    return pipe, call, (1, 4, 3, 6, 10), 3, (2, 4)  # (13 frames: 3 latent frames of 6 x 10)


def ltx():
    """LTXPipeline with the 0.9.0 VAE (8x: 8 x 12 latents)."""
    pipe, call = td.ltx()
    return pipe, call, (1, 4, 3, 8, 12), 4, (2, 3)


def ltx_timestep():
    """LTXPipeline with a 0.9.5 VAE conditioned on the decode timestep (16x, 8x: 2 latent frames of 4 x 6):
    the pipeline noises the latents with its generator and passes the timestep to vae.decode."""
    from diffusers import LTXPipeline

    pipe, call = td.ltx()
    pipe = LTXPipeline(scheduler=pipe.scheduler, vae=video_vae("ltx0.9.5-t"), text_encoder=None,
                       tokenizer=None, transformer=pipe.transformer)
    return pipe, dict(call, decode_timestep=0.05, decode_noise_scale=0.025), (1, 4, 2, 4, 6), 2, (2, 3)


@pytest.mark.parametrize("build", [mochi, ltx, ltx_timestep], ids=lambda b: b.__name__)
def test_the_pipeline_with_the_tiled_vae_makes_the_stock_frames(build):
    pipe, call, shape, tile, grid = build()
    pipe.set_progress_bar_config(disable=True)
    call = dict(call, num_inference_steps=2, output_type="pt")
    with torch.no_grad():
        ref = pipe(generator=torch.Generator().manual_seed(1), **call).frames
        pipe.vae = tw.TiledVAE(pipe.vae, tile_size=tile, progress=False)
        out = pipe(generator=torch.Generator().manual_seed(1), **call).frames
    assert pipe.vae.plan(shape).grid == grid
    assert out.shape == ref.shape and (out - ref).abs().max() <= TOL
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.5  # (most pixels not clamped: the test sees them)
