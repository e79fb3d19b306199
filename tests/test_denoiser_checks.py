"""TiledDenoiser's refusals and what diffusers hangs on a denoiser (issues 29 and 33).

Refused when built, by name and with the reason: classes no family tiles, a config whose positions exist
for one size only, a module that is not a denoiser, a step cache, frame windows for HunyuanVideo's
token-replace I2V. Refused when called, before any tile runs: a model or latent on the meta device, a
dtype mismatch, NaN in the sample, frame windows over Wan VACE's reference frames. Kept working through the
wrapper: IP-Adapter image embeddings (stock FluxPipeline with IP-Adapter processors), a forward replaced
on the instance by a (*args, **kwargs) wrapper.
"""

from __future__ import annotations

import functools

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import tiny_denoisers as td  # noqa: E402
import tiny_transformers as tt  # noqa: E402

from tilewise.diffusion import TiledDenoiser  # noqa: E402

torch.set_num_threads(1)


def one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ---- refused when built -----------------------------------------------------------------------------------
def test_classes_no_family_tiles_are_refused_by_name_with_the_reason():
    from diffusers import MotionAdapter

    motion = td.seeded(MotionAdapter, block_out_channels=(32, 32), motion_layers_per_block=1,
                       motion_num_attention_heads=2, motion_norm_num_groups=8)
    with pytest.raises(ValueError) as e:
        TiledDenoiser(motion)
    assert one_line(e).startswith("TiledDenoiser cannot wrap a MotionAdapter: it holds AnimateDiff's motion")
    with pytest.raises(ValueError) as e:
        TiledDenoiser(torch.nn.Conv2d(4, 4, 3))
    msg = one_line(e)
    assert msg.startswith("TiledDenoiser cannot wrap a Conv2d (unet=): supported model classes are")
    for cls in ("WanTransformer3DModel", "UNetMotionModel", "CogVideoXTransformer3DModel",
                "ChromaTransformer2DModel"):
        assert cls in msg
    assert "model(sample, timestep, ...)" in msg


def test_a_position_table_of_one_size_is_refused_when_built():
    from diffusers import CogVideoXTransformer3DModel

    tr = td.seeded(CogVideoXTransformer3DModel, num_attention_heads=2, attention_head_dim=16, in_channels=4,
                   out_channels=4, time_embed_dim=4, text_embed_dim=td.D, num_layers=1, sample_width=10,
                   sample_height=6, sample_frames=9, max_text_seq_length=5,
                   use_rotary_positional_embeddings=True, use_learned_positional_embeddings=True)
    with pytest.raises(ValueError,
                       match=r"cannot wrap this CogVideoXTransformer3DModel: its learned position "
                                         r"embedding exists for one size only"):
        TiledDenoiser(tr)


def test_a_step_cache_is_refused_when_built_and_when_enabled_later():
    from diffusers import FirstBlockCacheConfig

    model = tt.flux_transformer()
    model.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    with pytest.raises(ValueError) as e:
        TiledDenoiser(model)
    assert "has a step cache enabled" in one_line(e) and "model.disable_cache()" in one_line(e)
    model.disable_cache()
    pipe, kw = tt.FAMILIES["flux"]()
    pipe.transformer = TiledDenoiser(pipe.transformer, tile_size=8, overlap=4)
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))  # reads through to the model
    with pytest.raises(ValueError, match="would reuse another tile's state"):
        pipe(**kw, height=32, width=32, num_inference_steps=1, output_type="latent")


def test_frame_windows_are_refused_for_hunyuan_video_token_replace_when_built():
    from diffusers import HunyuanVideoTransformer3DModel

    tr = td.seeded(HunyuanVideoTransformer3DModel, in_channels=4, out_channels=4, num_attention_heads=2,
                   attention_head_dim=8, num_layers=1, num_single_layers=1, num_refiner_layers=1,
                   patch_size=2, patch_size_t=1, text_embed_dim=td.D, pooled_projection_dim=8,
                   rope_axes_dim=(2, 2, 4), image_condition_type="token_replace")
    TiledDenoiser(tr, tile_size=4, overlap=2)  # tiles over space: the first frame is every tile's first
    with pytest.raises(ValueError) as e:
        TiledDenoiser(tr, tile_size=4, overlap=2, tile_frames=2)
    assert one_line(e).startswith("tile_frames=2: HunyuanVideoTransformer3DModel "
                                  "(image_condition_type='token_replace', HunyuanVideo I2V) modulates")


# ---- refused when called -----------------------------------------------------------------------------------
def test_meta_device_plans_but_does_not_run():
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                      in_channels=4, out_channels=4, text_dim=td.D, freq_dim=16, ffn_dim=32,
                                      num_layers=1, rope_max_seq_len=32)
    den = TiledDenoiser(model, tile_size=4, overlap=2)  # planning needs no weights
    assert den.count(6, 10, frames=3) == len(den.plan(6, 10, frames=3)) > 1
    x = torch.zeros(1, 4, 3, 6, 10)
    with pytest.raises(ValueError) as e:
        den(hidden_states=x, timestep=torch.tensor([1]), encoder_hidden_states=torch.zeros(1, 5, td.D))
    assert one_line(e).startswith("the model's weights are on the meta device (no data): TiledDenoiser can "
                                  "plan")


@pytest.mark.parametrize("broken", ["dtype", "nan"])
def test_a_broken_sample_is_named_before_any_tile_runs(broken):
    model = td.wan_transformer()
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    x = td.rand(1, 4, 3, 6, 10)
    if broken == "dtype":
        x, want = x.half(), r"sample is torch.float16 but the model's weights are torch.float32: cast one"
    else:
        x[0, 1, 2, 3, 4] = float("nan")
        want = (r"sample holds 1 NaN or inf values \(first at index \[0, 1, 2, 3, 4\] of shape "
                r"\(1, 4, 3, 6, 10\)\)")
    with pytest.raises(ValueError, match=want):
        TiledDenoiser(model, tile_size=4, overlap=2)(hidden_states=x, timestep=torch.tensor([1]),
                                                    encoder_hidden_states=td.rand(1, 5, td.D))
    assert calls == []  # refused before the model ran


def test_frame_windows_are_refused_for_wan_vace_reference_frames_before_any_tile_runs():
    """WanVACEPipeline with reference_images prepends their latents as frames: refused with tile_frames
    (the same pipeline without them runs frame windows: test_denoiser_families' wan-vace case)."""
    pipe, kw = td.wan_vace()
    pipe.set_progress_bar_config(disable=True)
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda m, a: calls.append(1))
    pipe.transformer = TiledDenoiser(pipe.transformer, tile_size=4, overlap=2, tile_frames=2)
    with pytest.raises(ValueError) as e, torch.no_grad():
        pipe(**kw, reference_images=[td.image(48, 80, seed=9)], num_inference_steps=1, output_type="latent")
    assert one_line(e).startswith("tile_frames=2: WanVACETransformer3DModel has 1 reference frame(s) first "
                                  "in the latent (control_hidden_states: reactive latents and mask zero")
    assert not calls


# ---- what diffusers hangs on a denoiser keeps working -----------------------------------------------------
def test_a_forward_replaced_by_an_args_kwargs_wrapper_binds_against_the_class_forward():
    case = td.CASES["wan"]
    pipe, kw = case.build()
    model = pipe.transformer
    seen = []

    @functools.wraps(type(model).forward)  # as accelerate's hooks do, but the signature is (*args, **kwargs)
    def forward(*args, **kwargs):
        seen.append(1)
        return type(model).forward(model, *args, **kwargs)

    forward.__wrapped__ = None  # a wrapper that hides what it wraps: only the class tells what it takes
    del forward.__wrapped__
    forward.__signature__ = None
    del forward.__signature__
    model.forward = lambda *args, **kwargs: forward(*args, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        ref = pipe(**kw, num_inference_steps=1, generator=td.g(0), output_type="latent").frames
        pipe.transformer = TiledDenoiser(model, tile_size=256)
        out = pipe(**kw, num_inference_steps=1, generator=td.g(0), output_type="latent").frames
    assert seen and (out - ref).abs().max() <= 1e-5  # the instance's forward ran, bound by the class's


def flux_ip_adapter():
    """FluxPipeline with IP-Adapter attention processors and image projection (seeded), as
    `load_ip_adapter` installs them, and image embeddings passed to the pipeline."""
    from diffusers.models.embeddings import ImageProjection, MultiIPAdapterImageProjection
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    pipe, kw = tt.FAMILIES["flux"]()
    tr = pipe.transformer
    inner, text = tr.config.num_attention_heads * tr.config.attention_head_dim, tr.config.joint_attention_dim
    torch.manual_seed(5)
    tr.encoder_hid_proj = MultiIPAdapterImageProjection(
        [ImageProjection(image_embed_dim=8, cross_attention_dim=text, num_image_text_embeds=2)])
    procs = {name: FluxIPAdapterAttnProcessor(hidden_size=inner, cross_attention_dim=text, num_tokens=(2,),
                                              scale=1.0) if name.startswith("transformer_blocks") else p
             for name, p in tr.attn_processors.items()}
    tr.set_attn_processor(procs)
    with torch.no_grad():
        for p in procs.values():
            for q in p.parameters() if isinstance(p, torch.nn.Module) else ():
                q.normal_(0, 0.3)
    kw = dict(kw, ip_adapter_image_embeds=[td.rand(1, 1, 8, seed=3)],
              negative_ip_adapter_image_embeds=[torch.zeros(1, 1, 8)])
    return pipe, kw


def test_ip_adapter_image_embeddings_reach_every_tile():
    pipe, kw = flux_ip_adapter()

    def run(**extra):
        pipe.set_progress_bar_config(disable=True)
        with torch.no_grad():
            return pipe(**{**kw, **extra}, height=32, width=32, num_inference_steps=2, output_type="latent",
                        generator=td.g(0)).images

    ref, other = run(), run(ip_adapter_image_embeds=[td.rand(1, 1, 8, seed=4)])
    assert (ref - other).abs().max() > 1e-4  # the image embeddings matter
    model = pipe.transformer
    pipe.transformer = TiledDenoiser(model, tile_size=64)
    assert (run() - ref).abs().max() <= 1e-5
    pipe.transformer = TiledDenoiser(model, tile_size=8, overlap=4)
    tiled, tiled_other = run(), run(ip_adapter_image_embeds=[td.rand(1, 1, 8, seed=4)])
    assert tiled.shape == ref.shape and torch.isfinite(tiled).all()
    assert (tiled - tiled_other).abs().max() > 1e-4  # every tile's call got the embeddings
