"""TiledVAE on 3-D causal VAEs: exact tiled decode and encode equal the untiled VAE, plans count what runs."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from video_vae_support import factor, video_vae  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.vae.video.executor import VideoExecutor  # noqa: E402
from tilewise.vae.video.plan import make_video_plan  # noqa: E402

TOL = 1e-4


def _latent(frames, h, w, seed=0):
    return torch.randn(1, 4, frames, h, w, generator=torch.Generator().manual_seed(seed))


def _video(vae, frames, h, w, seed=1):
    f = factor(vae)
    return torch.rand(1, 3, frames, h * f, w * f, generator=torch.Generator().manual_seed(seed)) * 2 - 1


# odd latent sizes; one frame (an image), several frames; tiles of 3 latent px (2x3 grid)
@pytest.mark.parametrize("name,frames", [("qwen", 1), ("wan2.1", 3), ("wan2.2", 2), ("ltx0.9.0", 3),
                                         ("ltx0.9.5", 2), ("ltx2", 3), ("refiner", 1), ("refiner", 3)])
def test_exact_decode_equals_untiled(name, frames):
    vae = video_vae(name)
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = _latent(frames, 5, 7)
    with torch.no_grad():
        ref = vae.decode(z).sample
        out = tv.decode(z).sample
    assert out.shape == ref.shape and (out - ref).abs().max() <= TOL
    assert tv.plan(tuple(z.shape)).grid == (2, 3)


@pytest.mark.parametrize("name,frames", [("qwen", 1), ("wan2.1", 7), ("wan2.2", 5), ("ltx0.9.0", 5),
                                         ("ltx0.9.0", 6), ("ltx0.9.5", 9), ("ltx2", 9), ("refiner", 1),
                                         ("refiner", 5)])
def test_exact_encode_equals_untiled(name, frames):
    vae = video_vae(name)
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    x = _video(vae, frames, 3, 5)
    with torch.no_grad():
        ref = vae.encode(x).latent_dist
        out = tv.encode(x).latent_dist
    assert (out.mean - ref.mean).abs().max() <= TOL and (out.logvar - ref.logvar).abs().max() <= TOL
    assert (out.mode() - ref.mode()).abs().max() <= TOL


@pytest.mark.parametrize("order", ["frames", "tiles"])
@pytest.mark.parametrize("staging", ["device", "host"])
def test_both_orders_and_stagings_are_exact_and_hold_what_the_plan_says(order, staging):
    vae = video_vae("wan2.1")
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = _latent(3, 7, 5, seed=2)
    plan = make_video_plan(tv.settings, tv.job("decode"), tuple(z.shape), staging=staging, order=order)
    p = tv.program("decode")
    ex = VideoExecutor(p, plan.tile_size, p.input, staging=staging, order=order, progress=False)
    with torch.no_grad():
        res = ex.run(z)
        ref = vae.decode(z).sample
    out = res.output
    assert (out - ref).abs().max() <= TOL
    assert res.cache_peak == plan.cache_bytes > 0 and res.staged_peak == plan.staged_peak > 0
    assert tuple(out.shape) == plan.output_shape and plan.step_frames == [1, 4, 4]


def test_tile_major_order_holds_one_tiles_caches():
    tv = tw.TiledVAE(video_vae("wan2.1"), tile_size=2, progress=False)
    shape = (1, 4, 4, 6, 6)
    frames = make_video_plan(tv.settings, tv.job("decode"), shape, order="frames")
    tiles = make_video_plan(tv.settings, tv.job("decode"), shape, order="tiles")
    assert tiles.cache_bytes == max(tiles.cache_bytes, 1) and tiles.cache_bytes < frames.cache_bytes / 4
    assert frames.macs == tiles.macs and frames.halo_overhead > 0
    assert tv.plan(shape).order == "tiles"  # the smaller peak, when the output needs no frame order


@pytest.mark.parametrize("h,w,tile", [(3, 13, 3), (11, 2, 4)])
def test_strips_are_exact(h, w, tile):
    vae = video_vae("qwen")
    tv = tw.TiledVAE(vae, tile_size=tile, progress=False)
    z = _latent(2, h, w, seed=3)
    with torch.no_grad():
        assert (tv.decode(z).sample - vae.decode(z).sample).abs().max() <= TOL
    grid = tv.plan(tuple(z.shape)).grid
    assert 1 in grid and max(grid) > 1


@pytest.mark.parametrize("h,w", [(1, 9), (7, 1)])
def test_encode_strips_are_exact(h, w):
    """Images one latent pixel high (or wide): a 1 x n (n x 1) grid of tiles."""
    vae = video_vae("qwen")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    x = _video(vae, 1, h, w, seed=10)
    with torch.no_grad():
        assert (tv.encode(x).latent_dist.mean - vae.encode(x).latent_dist.mean).abs().max() <= TOL
    assert sorted(tv.plan(tuple(x.shape), kind="encode").grid) == [1, max(h, w) // 2 + 1]


def test_tile_local_attention_is_the_named_approximation():
    """attention="tile": each tile's queries attend to the tokens of its own box (the core and the halo of
    the later segment), no sync point; exact global attention on the same grid stays exact."""
    vae = video_vae("qwen")
    z = _latent(1, 30, 30, seed=4)
    with torch.no_grad():
        ref = vae.decode(z).sample
        local = tw.TiledVAE(vae, tile_size=8, attention="tile", progress=False)
        exact = tw.TiledVAE(vae, tile_size=8, progress=False)
        assert local.plan(tuple(z.shape)).segments == 1 and exact.plan(tuple(z.shape)).segments == 3
        assert (local.decode(z).sample - ref).abs().max() > 1e-2
        assert (exact.decode(z).sample - ref).abs().max() <= TOL


@pytest.mark.parametrize("path", ["v.npy", "v.tif", "f{:02d}.png"])
def test_decode_to_video_sinks_streams_the_exact_video(tmp_path, path):
    vae = video_vae("wan2.1")
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = _latent(2, 5, 4, seed=5)
    with torch.no_grad():
        ref = vae.decode(z).sample
        tiled = tv.decode(z).sample
    _, c, t, h, w = ref.shape
    with tw.open_video_sink(tmp_path / path, t, h, w, c) as sink:
        tv.decode_to(z, sink)
    if path.endswith(".npy"):
        got = np.load(tmp_path / path)
    elif path.endswith(".tif"):
        import tifffile

        got = tifffile.imread(tmp_path / path)
    else:
        from PIL import Image

        got = np.stack([np.array(Image.open(tmp_path / path.format(i))) for i in range(t)])
    want = np.stack([tw.sinks.to_hwc_uint(tiled[0, :, i]) for i in range(t)])
    assert got.shape == (t, h, w, c) and np.array_equal(got, want)
    exact = np.stack([tw.sinks.to_hwc_uint(ref[0, :, i]) for i in range(t)]).astype(int)
    assert np.abs(got.astype(int) - exact).max() <= 1  # float noise can flip a rounding


def test_one_frame_decodes_into_an_image_sink(tmp_path):
    vae = video_vae("qwen")
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    z = _latent(1, 4, 7, seed=6)
    with torch.no_grad():
        ref = tv.decode(z).sample[0, :, 0]
    with tw.open_sink(tmp_path / "i.npy", ref.shape[1], ref.shape[2], 3, bits=32) as sink:
        tv.decode_to(z, sink)
    got = np.load(tmp_path / "i.npy")
    assert np.abs(got - ref.permute(1, 2, 0).numpy()).max() <= 1e-6


def test_bad_inputs_name_the_value_and_what_is_valid(tmp_path):
    vae = video_vae("wan2.1")
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    with pytest.raises(ValueError, match=r"\(B, C, T, H, W\).*\(1, 4, 5, 7\)"):
        tv.decode(torch.zeros(1, 4, 5, 7))
    with pytest.raises(ValueError, match="3 channels, the VAE decoder expects 4"):
        tv.decode(torch.zeros(1, 3, 1, 5, 7))
    with pytest.raises(ValueError, match="multiples of 8.*36x40"):
        tv.encode(torch.zeros(1, 3, 1, 36, 40))
    assert tw.TiledVAE(vae, staging="disk").plan((1, 4, 1, 5, 7)).staging.value == "disk"  # (accepted)
    with pytest.raises(ValueError, match="process_group='default' needs torch.distributed initialised"):
        tw.TiledVAE(vae, process_group="default").decode(torch.zeros(1, 4, 1, 5, 7))
    sink = tw.open_video_sink(tmp_path / "v.npy", 3, 40, 56)
    with pytest.raises(ValueError, match="holds 3 frames of 40x56, the decode makes 5"):
        tv.decode_to(torch.zeros(1, 4, 2, 5, 7), sink)
    sink.abort()
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="order='frames'"):
        make_video_plan(tv.settings, tv.job("decode"), (1, 4, 2, 5, 7), order="tiles", sequential=True)
    with pytest.raises(ValueError, match="no plan fits memory_budget"):
        tw.TiledVAE(vae, memory_budget="1KiB").plan((1, 4, 2, 5, 7))


def test_fast_mode_runs_exact_and_the_plan_says_why():
    vae = video_vae("qwen")
    tv = tw.TiledVAE(vae, tile_size=3, mode="fast", progress=False)
    z = _latent(1, 5, 5, seed=7)
    with torch.no_grad():
        assert (tv.decode(z).sample - vae.decode(z).sample).abs().max() <= TOL
    assert "has none: the run is exact" in str(tv.plan(tuple(z.shape)))


def test_memory_budget_picks_the_largest_tile_that_fits():
    tv = tw.TiledVAE(video_vae("wan2.1"), tile_size=16, progress=False)
    shape = (1, 4, 3, 16, 16)
    whole = tv.plan(shape)
    tv.memory_budget = whole.peak // 2
    plan = tv.plan(shape)
    assert plan.peak <= tv.memory_budget and plan.tile_size < 16
    text = str(plan)
    assert "causal steps: 3" in text and "caches:" in text and "estimated device peak" in text


@pytest.mark.parametrize("name", ["qwen", "wan2.1", "ltx0.9.0", "ltx2"])
def test_preflight_plans_the_video_and_refuses_what_cannot_fit(name, monkeypatch):
    """preflight (what a recipe calls before its work) used the 2-D planner on 3-D VAEs and failed."""
    from tilewise.errors import WontFit
    from tilewise.vae.video.plan import VideoPlan

    vae = video_vae(name)
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    shape = (1, vae.config.get("z_dim") or vae.config.latent_channels, 3, 5, 7)
    plan = tv.preflight(shape)
    assert isinstance(plan, VideoPlan) and plan.grid == (2, 3) and plan.peak > 0
    monkeypatch.setattr("tilewise.vae.checks.device_memory_available", lambda device=None: plan.peak // 2)
    with pytest.raises(WontFit, match=r"caches, staged values and output need at least"):
        tv.preflight(shape)
    with pytest.raises(ValueError, match=r"\(B, C, T, H, W\)"):
        tv.preflight(shape[:2] + shape[3:])


def test_encode_warns_about_the_frames_the_model_drops(caplog):
    vae = video_vae("wan2.1")
    tv = tw.TiledVAE(vae, tile_size=2, progress=False)
    x = _video(vae, 7, 3, 3)
    with torch.no_grad(), caplog.at_level("WARNING"):
        out = tv.encode(x).latent_dist.mean
    assert out.shape[2] == 2 and "last 2 of 7 input frames are not encoded" in caplog.text
    assert "not encoded" in str(tv.plan(tuple(x.shape), kind="encode"))


def test_drops_into_stock_qwen_image_pipelines_for_decode_and_encode():
    """pipe.vae = TiledVAE(...) in QwenImagePipeline (decode of (B, C, 1, H, W) latents) and
    QwenImageImg2ImgPipeline (encode, then decode): the images equal the stock VAE's."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        QwenImageImg2ImgPipeline,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(in_channels=16, out_channels=4, num_layers=1,
                                              attention_head_dim=8, num_attention_heads=2,
                                              joint_attention_dim=16, axes_dims_rope=(2, 2, 4)).eval()
    vae = video_vae("qwen")
    g = torch.Generator().manual_seed(0)
    kw = dict(prompt_embeds=torch.randn(1, 5, 16, generator=g),
              prompt_embeds_mask=torch.ones(1, 5, dtype=torch.long), height=80, width=112,
              num_inference_steps=2, output_type="pt", true_cfg_scale=1.0)
    img2img = dict(kw, image=torch.rand(1, 3, 80, 112, generator=g), strength=0.6)
    for cls, call in ((QwenImagePipeline, kw), (QwenImageImg2ImgPipeline, img2img)):
        pipe = cls(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                   transformer=transformer)
        pipe.set_progress_bar_config(disable=True)
        ref = pipe(generator=torch.Generator().manual_seed(1), **call).images
        pipe.vae = tw.TiledVAE(vae, tile_size=3, progress=False)
        out = pipe(generator=torch.Generator().manual_seed(1), **call).images
        assert pipe.vae.plan((1, 4, 1, 10, 14)).grid == (4, 5)
        assert out.shape == ref.shape and (out - ref).abs().max() <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("order", ["frames", "tiles"])
def test_wan22_long_video_on_a_larger_grid_is_exact(order):
    """Wan 2.2 (patchify, residual up/down blocks, DupUp3D / AvgDown3D) over 6 latent frames on a 3x4 grid,
    caches and staged values on the host; encode of 17 frames (1 + 4 x 4)."""
    vae = video_vae("wan2.2")
    tv = tw.TiledVAE(vae, tile_size=4, progress=False)
    z = _latent(6, 9, 13, seed=8)
    p = tv.program("decode")
    with torch.no_grad():
        out = VideoExecutor(p, 4, p.input, staging="host", order=order, progress=False).run(z).output
        assert (out - vae.decode(z).sample).abs().max() <= TOL
        x = _video(vae, 17, 6, 8, seed=9)
        p = tv.program("encode")
        enc = VideoExecutor(p, 3, p.output, staging="host", order=order, progress=False).run(x).output
        assert (enc - vae.encode(x).latent_dist.parameters).abs().max() <= TOL


def test_drops_into_a_stock_wan_pipeline():
    """pipe.vae = TiledVAE(...) in WanPipeline: the decoded video (5 frames, from 2 latent frames, over a
    2x2 grid of tiles) equals the stock VAE's."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                        in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32,
                                        num_layers=1, rope_max_seq_len=32).eval()
    vae = video_vae("wan2.1")
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler())
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt_embeds=torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(2)), height=32,
                width=48, num_frames=5, num_inference_steps=2, guidance_scale=1.0, output_type="pt")
    ref = pipe(generator=torch.Generator().manual_seed(1), **call).frames
    pipe.vae = tw.TiledVAE(vae, tile_size=3, progress=False)
    out = pipe(generator=torch.Generator().manual_seed(1), **call).frames
    assert pipe.vae.plan((1, 4, 2, 4, 6)).grid == (2, 2)
    assert out.shape == ref.shape == (1, 5, 3, 32, 48) and (out - ref).abs().max() <= TOL


@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_a_call_that_asks_for_gradients_gets_a_graph_and_an_inference_call_none(kind):
    """An input that requires grad, or a training VAE with trainable parameters, gets an output with a
    graph (tests/test_vae_gradients_video.py checks its gradients); under no_grad, or in eval mode on an
    input that does not require grad, the plain run (no graph)."""
    import copy

    vae = copy.deepcopy(video_vae("wan2.1"))
    tv = tw.TiledVAE(vae, tile_size=3, progress=False)
    t = _latent(1, 5, 7) if kind == "decode" else _video(vae, 1, 3, 5)

    def run(u):
        out = tv.decode(u).sample if kind == "decode" else tv.encode(u).latent_dist.mean
        return out.requires_grad

    assert run(t.clone().requires_grad_(True))
    vae.train()
    assert run(t)
    with torch.no_grad():
        assert not run(t)
    vae.eval()
    assert not run(t)  # (nothing asks for gradients)
