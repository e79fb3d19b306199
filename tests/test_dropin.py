"""TiledVAE and TiledDenoiser as drop-ins for the modules they wrap, in eleven stock diffusers pipelines.

Every pipeline is a real stock pipeline from tiny seeded configs (`tiny_pipes`), 2 steps, small images.
The oracle is always the same stock pipeline without the wrapper.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tiny_pipes as tp  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.vae.run.executor import Executor  # noqa: E402

torch.set_num_threads(1)

# bf16 against the stock bf16 pipeline: the tiled decode rounds differently (statistics in float64, one
# GroupNorm affine), so it may differ by up to bf16's own error of the stock pipeline against fp32
BF16_FACTOR = 2.0


def _tiled_vae(pipe, tile: int = 2):
    pipe.vae = tw.TiledVAE(pipe.vae, tile_size=tile, progress=False)
    return pipe


@pytest.fixture
def executor_runs(monkeypatch):
    """Counts tiled executor runs (proves the tiled path ran, not the one-tile untiled one)."""
    runs = []
    run = Executor.run

    def counted(self, x, emit=None):
        runs.append(tuple(x.shape))
        return run(self, x, emit)

    monkeypatch.setattr(Executor, "run", counted)
    return runs


@pytest.mark.parametrize("name", list(tp.CASES))
def test_tiled_vae_in_stock_pipelines_equals_stock_fp32_and_bf16(name, executor_runs):
    build, run, _ = tp.CASES[name]
    ref = run(build())
    pipe = _tiled_vae(build())
    out = run(pipe)
    assert executor_runs, "the TiledVAE never ran tiled"
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() <= 1e-4
    # bf16: the whole pipeline moved by pipe.to, the wrapper included
    stock16 = build().to(torch.bfloat16)
    ref16 = run(stock16)
    pipe.to(torch.bfloat16)
    assert isinstance(pipe.vae, tw.TiledVAE) and pipe.vae.dtype == torch.bfloat16
    assert next(pipe.vae.vae.parameters()).dtype == torch.bfloat16
    out16 = run(pipe)
    own = np.abs(ref16 - ref).max()  # bf16's own error against fp32
    assert np.abs(out16 - ref16).max() <= BF16_FACTOR * own + 1e-3, (np.abs(out16 - ref16).max(), own)


@pytest.mark.parametrize("name", list(tp.CASES))
def test_one_tile_denoiser_in_stock_pipelines_equals_stock(name):
    build, run, attr = tp.CASES[name]
    ref = run(build())
    pipe = build()
    setattr(pipe, attr, tw.TiledDenoiser(getattr(pipe, attr), tile_size=64, overlap=0))
    out = run(pipe)
    assert np.abs(out - ref).max() <= 1e-5


@pytest.mark.parametrize("name", ["sd", "sdxl_img2img", "x4_upscale", "flux", "sd_tiny_vae"])
def test_save_pretrained_writes_the_wrapped_model_and_stock_loading_reads_it(name, tmp_path):
    build, run, attr = tp.CASES[name]
    ref = run(build())
    pipe = _tiled_vae(build())
    denoiser = getattr(pipe, attr)
    setattr(pipe, attr, tw.TiledDenoiser(denoiser, tile_size=64, overlap=0))
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    vae_cls = type(pipe.vae.vae).__name__
    assert index["vae"] == ["diffusers", vae_cls]
    assert (tmp_path / "vae" / "config.json").exists() and list((tmp_path / "vae").glob("*.safetensors"))
    assert index[attr] == ["diffusers", type(denoiser).__name__]
    assert list((tmp_path / attr).glob("*.safetensors"))
    loaded = type(pipe).from_pretrained(tmp_path, **_nones(pipe))  # stock loading: plain diffusers modules
    assert type(loaded.vae).__name__ == vae_cls and not isinstance(loaded.vae, tw.TiledVAE)
    tp._ready(loaded)
    assert np.abs(run(loaded) - ref).max() <= 1e-5
    # a wrapper passed to from_pretrained is taken as the component
    again = type(pipe).from_pretrained(tmp_path, vae=tw.TiledVAE(loaded.vae, tile_size=2, progress=False),
                                       **_nones(pipe))
    assert isinstance(again.vae, tw.TiledVAE)
    assert np.abs(run(tp._ready(again)) - ref).max() <= 1e-4


def _nones(pipe) -> dict:
    """The components the tiny pipelines leave out (text encoders, tokenizers): passed as None to loading,
    as stock diffusers asks for a component saved as None."""
    return {k: None for k, v in pipe.components.items() if v is None}


def test_a_saved_pipeline_loads_where_tilewise_is_not_installed(tmp_path):
    pipe = _tiled_vae(tp.sd())
    pipe.unet = tw.TiledDenoiser(pipe.unet, tile_size=64, overlap=0)
    pipe.save_pretrained(tmp_path)
    code = ("import sys; sys.modules['tilewise'] = None\n"  # import tilewise now raises ImportError
            "from diffusers import DiffusionPipeline\n"
            f"p = DiffusionPipeline.from_pretrained({str(tmp_path)!r}, **{_nones(pipe)!r})\n"
            "print(type(p).__name__, type(p.vae).__name__, type(p.unet).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["StableDiffusionPipeline", "AutoencoderKL", "UNet2DConditionModel"]


def test_the_wrappers_are_modules_that_move_cast_and_present_the_model():
    pipe = _tiled_vae(tp.sd())
    pipe.unet = tw.TiledDenoiser(pipe.unet, tile_size=64, overlap=0)
    tv, td = pipe.vae, pipe.unet
    from diffusers import AutoencoderKL, UNet2DConditionModel

    assert isinstance(tv, torch.nn.Module) and isinstance(tv, AutoencoderKL) and type(tv) is tw.TiledVAE
    assert isinstance(td, UNet2DConditionModel) and type(td) is tw.TiledDenoiser
    for method in ("half", "float", "eval", "cpu", "bfloat16"):
        assert getattr(tv, method)() is tv and getattr(td, method)() is td, method
    assert tv.requires_grad_(False) is tv and not any(p.requires_grad for p in tv.vae.parameters())
    tv.half()
    assert tv.dtype == torch.float16 and tv.vae.dtype == torch.float16
    pipe.to(torch.float32)
    assert tv.dtype == torch.float32 and td.dtype == torch.float32
    assert list(tv.state_dict()) == list(tv.vae.state_dict())
    assert [id(p) for p in tv.parameters()] == [id(p) for p in tv.vae.parameters()]
    assert dict(tv.named_parameters()).keys() == dict(tv.vae.named_parameters()).keys()
    assert tv.config is tv.vae.config and td.config is td.unet.config
    tv.load_state_dict(tv.vae.state_dict())
    tv.use_slicing = True  # an attribute the VAE has: set on the VAE
    assert tv.vae.use_slicing is True and "use_slicing" not in tv.__dict__
    tv.tile_size = 3  # the wrapper's own setting
    assert tv.tile_size == 3 and not hasattr(tv.vae, "tile_size")


def test_copies_and_pickles_keep_the_wrapper(tmp_path):
    import copy

    pipe = _tiled_vae(tp.sd())
    z = torch.randn(1, 4, 6, 5, generator=tp._g(4))
    want = pipe.vae.decode(z).sample
    for other in (copy.deepcopy(pipe.vae), _reloaded(pipe.vae, tmp_path / "tv.pt")):
        assert type(other) is tw.TiledVAE and other.vae is not pipe.vae.vae
        assert torch.equal(other.decode(z).sample, want)


def _reloaded(module, path):
    torch.save(module, path)
    return torch.load(path, weights_only=False)


def test_pipeline_helpers_work_through_the_wrappers(caplog):
    from diffusers.models.attention_processor import AttnProcessor

    build, run, _ = tp.CASES["sd"]
    stock = build()
    stock.fuse_qkv_projections()
    stock.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    ref = run(stock)
    pipe = _tiled_vae(build())
    pipe.unet = tw.TiledDenoiser(pipe.unet, tile_size=64, overlap=0)
    pipe.fuse_qkv_projections()  # refused for a VAE that is not an AutoencoderKL before
    assert _fused(pipe.vae.vae) and _fused(pipe.unet.unet)
    pipe.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    assert pipe.unet.unet.up_blocks[0].b1 == 1.2
    assert np.abs(run(pipe) - ref).max() <= 1e-4
    pipe.unfuse_qkv_projections()
    assert not _fused(pipe.vae.vae) and not _fused(pipe.unet.unet)
    pipe.vae.set_attn_processor(AttnProcessor())
    pipe.unet.set_attn_processor(AttnProcessor())
    assert all(isinstance(p, AttnProcessor) for p in pipe.vae.vae.attn_processors.values())
    assert all(isinstance(p, AttnProcessor) for p in pipe.unet.unet.attn_processors.values())
    with caplog.at_level(logging.INFO, logger="tilewise"):
        pipe.vae.enable_tiling()  # what the pipelines' deprecated enable_vae_tiling() calls
        pipe.vae.enable_slicing()
    said = [r.getMessage() for r in caplog.records if "tilewise's exact tiling is active" in r.getMessage()]
    assert len(said) == 2, caplog.text
    assert not pipe.vae.vae.use_tiling  # diffusers' own tiling stays off: it is not what decodes


def _fused(model) -> bool:
    from diffusers.models.attention_processor import FusedAttnProcessor2_0

    return any(isinstance(p, FusedAttnProcessor2_0) for p in model.attn_processors.values())


def test_fp16_vae_upcast_by_the_pipeline_moves_the_wrapped_vae():
    """SDXL with force_upcast: the pipeline casts the VAE to float32 for the decode and back after."""
    build, run, _ = tp.CASES["sdxl"]
    stock = build().to(torch.float16)
    stock.vae.register_to_config(force_upcast=True)
    try:
        ref = run(stock)
    except RuntimeError as e:  # pragma: no cover - depends on the CPU kernels of this torch build
        pytest.skip(f"float16 UNet not runnable on this CPU build: {e}")
    pipe = build().to(torch.float16)
    pipe.vae.register_to_config(force_upcast=True)
    pipe.vae = tw.TiledVAE(pipe.vae, tile_size=2, progress=False)
    seen = []
    decode = tw.TiledVAE.decode

    def spy(self, z, *a, **k):
        seen.append((z.dtype, self.dtype))
        return decode(self, z, *a, **k)

    tw.TiledVAE.decode = spy
    try:
        out = run(pipe)
    finally:
        tw.TiledVAE.decode = decode
    assert seen == [(torch.float32, torch.float32)]  # upcast before the decode
    assert pipe.vae.dtype == torch.float16  # and cast back after
    assert np.abs(out - ref).max() <= 1e-3  # (float16 UNet; the VAE in float32 in both)


@pytest.mark.parametrize("hw", [(100, 60), (33, 17), (8, 8), (5, 120)])
def test_any_size_the_stock_vae_encodes_tiledvae_encodes(hw):
    from vae_support import kl_vae, tiny_vae

    for vae in (kl_vae("sd3"), tiny_vae()):
        x = torch.rand(1, 3, *hw, generator=tp._g(1)) * 2 - 1
        with torch.no_grad():
            r = vae.encode(x)
        ref = r.latent_dist.mean if hasattr(r, "latent_dist") else r.latents
        o = tw.TiledVAE(vae, tile_size=3, progress=False).encode(x)
        out = o.latent_dist.mean if hasattr(o, "latent_dist") else o.latents
        assert out.shape == ref.shape and (out - ref).abs().max() <= 1e-4


def test_a_size_the_stock_vae_cannot_encode_is_refused_by_name():
    from vae_support import kl_vae

    vae = kl_vae("sd")
    x = torch.zeros(1, 3, 5, 120)
    with pytest.raises(RuntimeError):
        vae.encode(x)
    with pytest.raises(ValueError, match=r"5x120 is too small for the VAE encoder: encoder\.down_blocks\.\d"):
        tw.TiledVAE(vae, tile_size=3).encode(x)
