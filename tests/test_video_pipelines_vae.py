"""`pipe.vae = tw.TiledVAE(pipe.vae)` in stock video pipelines (issue #28): each tiny pipeline (prompt
embeddings given where it takes a prompt, no text encoder) called twice with the same seed, once with its
stock VAE and once with the wrapped one tiled into several tiles; what it returns is equal (fp32, max abs
<= 1e-4).

CogVideoXPipeline's drop-in test is tests/test_video_cogvideox.py's; HunyuanVideo15Pipeline's, Allegro's
and StableVideoDiffusion's sit with their VAEs' tests.
"""

from unittest import mock

import pytest

torch = pytest.importorskip("torch")

import tiny_denoisers as td  # noqa: E402
from video_vae_support import cogvideox_vae, kandinsky6_sr, ltx2, video_vae  # noqa: E402
from video_vae_support import mochi as mochi_vae  # noqa: E402

import tilewise as tw  # noqa: E402

TOL = 1e-4


def mochi():
    """MochiPipeline with the GroupNorm-randomised Mochi VAE of the video tests; its latents_mean / std
    unset (the pipeline views them as 12 channels: these latents have 4), so it divides by scaling_factor."""
    pipe, call = td.mochi()
    pipe.vae = mochi_vae(latents_mean=None, latents_std=None)
    return pipe, call, 3, [((1, 4, 3, 6, 10), "decode", (2, 4))]  # (13 frames: 3 latent frames of 6 x 10)


def ltx():
    """LTXPipeline with the 0.9.0 VAE (8x: 8 x 12 latents)."""
    pipe, call = td.ltx()
    return pipe, call, 4, [((1, 4, 3, 8, 12), "decode", (2, 3))]


def ltx_image_to_video():
    """LTXImageToVideoPipeline with the 0.9.0 VAE: the 64 x 96 condition image encoded, the video decoded."""
    from diffusers import LTXImageToVideoPipeline

    pipe, call = td.ltx()
    pipe = LTXImageToVideoPipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=None, tokenizer=None,
                                   transformer=pipe.transformer)
    return pipe, dict(call, image=td.image(64, 96, seed=3)), 4, [((1, 4, 3, 8, 12), "decode", (2, 3)),
                                                                 ((1, 3, 1, 64, 96), "encode", (2, 3))]


def ltx_timestep():
    """LTXPipeline with a 0.9.5 VAE conditioned on the decode timestep (16x, 8x: 2 latent frames of 4 x 6):
    the pipeline noises the latents with its generator and passes the timestep to vae.decode."""
    from diffusers import LTXPipeline

    pipe, call = td.ltx()
    pipe = LTXPipeline(scheduler=pipe.scheduler, vae=video_vae("ltx0.9.5-t"), text_encoder=None,
                       tokenizer=None, transformer=pipe.transformer)
    call = dict(call, decode_timestep=0.05, decode_noise_scale=0.025)
    return pipe, call, 2, [((1, 4, 2, 4, 6), "decode", (2, 3))]


def ltx_condition():
    """LTXConditionPipeline with the timestep-conditioned 0.9.5 VAE: an image condition at frame 0 encoded,
    the video decoded with the decode timestep and noise."""
    from diffusers import LTXConditionPipeline

    pipe, call, _, plans = ltx_timestep()
    pipe = LTXConditionPipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=None, tokenizer=None,
                                transformer=pipe.transformer)
    plans = [*plans, ((1, 3, 1, 64, 96), "encode", (2, 3))]
    return pipe, dict(call, image=td.image(64, 96, seed=3)), 2, plans


def ltx2_audio_video():
    """LTX2Pipeline (video and audio) with the LTX-2 VAE (its ratios given: 16x, 8x, as it computes), a
    tiny audio VAE, text connectors and vocoder; the prompt embeddings are two text-encoder layers' states."""
    from diffusers import AutoencoderKLLTX2Audio, LTX2Pipeline, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder

    audio = td.seeded(AutoencoderKLLTX2Audio, base_channels=8, ch_mult=(1, 2), num_res_blocks=1,
                      latent_channels=4, mel_bins=8)  # (2 x 4 latent mel bins: 8 audio channels)
    tr = td.seeded(LTX2VideoTransformer3DModel, in_channels=4, out_channels=4, num_attention_heads=2,
                   attention_head_dim=8, cross_attention_dim=16, audio_in_channels=8, audio_out_channels=8,
                   audio_num_attention_heads=2, audio_attention_head_dim=8, audio_cross_attention_dim=16,
                   num_layers=1, caption_channels=td.D)
    heads = dict(num_attention_heads=2, attention_head_dim=8, num_layers=1, num_learnable_registers=None)
    connectors = td.seeded(LTX2TextConnectors, caption_channels=td.D, text_proj_in_factor=2,
                           **{f"{m}_connector_{k}": v for m in ("video", "audio") for k, v in heads.items()})
    vocoder = td.seeded(LTX2Vocoder, in_channels=16, hidden_channels=8, upsample_kernel_sizes=[4],
                        upsample_factors=[2], resnet_kernel_sizes=[3], resnet_dilations=[[1]])
    vae = ltx2(spatial_compression_ratio=16, temporal_compression_ratio=8)
    pipe = LTX2Pipeline(scheduler=td.flow(), vae=vae, audio_vae=audio, text_encoder=None, tokenizer=None,
                        connectors=connectors, transformer=tr, vocoder=vocoder)
    mask = torch.ones(1, 5, dtype=torch.long)
    call = td.neg(prompt_embeds=td.rand(1, 5, 2 * td.D), prompt_attention_mask=mask, guidance_scale=2.0,
                  height=64, width=96, num_frames=9)
    return pipe, call, 2, [((1, 4, 2, 4, 6), "decode", (2, 3))]


def easyanimate():
    """EasyAnimatePipeline (text to video) with the Magvit VAE: prompt embeddings and their masks given,
    its Qwen2-VL text encoder None (encode_prompt then reads neither it nor the tokenizer)."""
    from diffusers import EasyAnimatePipeline

    tr, _ = td.easyanimate()
    pipe = EasyAnimatePipeline(vae=video_vae("magvit"), text_encoder=None, tokenizer=None, transformer=tr,
                               scheduler=td.flow())
    call = td.neg(prompt_embeds=td.rand(1, 5, td.D), prompt_attention_mask=torch.ones(1, 5, dtype=torch.long),
                  guidance_scale=2.0, height=48, width=80, num_frames=9)
    return pipe, call, 3, [((1, 4, 3, 6, 10), "decode", (2, 4))]


def kandinsky6_super_resolution():
    """Kandinsky6SRPipeline at 2x: a 5-frame 32 x 32 video is one tile of its own (64 x 64 px at the
    transformer's one tile size), encoded, denoised and decoded: encode and decode both tiled here."""
    from diffusers import Kandinsky6SRPipeline, Kandinsky6SRTransformer3DModel

    tr = td.seeded(Kandinsky6SRTransformer3DModel, in_visual_dim=4, out_visual_dim=4, time_dim=16,
                   model_dim=32, ff_dim=64, num_visual_blocks=1, axes_dims=(4, 6, 6), tile_sizes=((64, 64),))
    pipe = Kandinsky6SRPipeline(transformer=tr, vae=kandinsky6_sr(), scheduler=td.flow())
    video = torch.rand(1, 5, 3, 32, 32, generator=td.g(3))  # ((B, T, C, H, W) in [0, 1], as it preprocesses)
    return pipe, dict(video=video, resolution_scale=2), 4, [((1, 4, 2, 8, 8), "decode", (2, 2)),
                                                            ((1, 3, 5, 64, 64), "encode", (2, 2))]


def hunyuan_image_refiner():
    """HunyuanImageRefinerPipeline with the refiner VAE (16x): the 64 x 64 image encoded (its latent
    sampled with the call's generator), refined by a one-layer 3-D transformer, decoded."""
    from diffusers import HunyuanImageRefinerPipeline, HunyuanImageTransformer2DModel

    tr = td.seeded(HunyuanImageTransformer2DModel, in_channels=16, out_channels=8, num_attention_heads=2,
                   attention_head_dim=12, num_layers=1, num_single_layers=1, num_refiner_layers=1,
                   patch_size=(1, 1, 1), text_embed_dim=td.D, rope_axes_dim=(4, 4, 4), guidance_embeds=True)
    pipe = HunyuanImageRefinerPipeline(scheduler=td.flow(), vae=video_vae("refiner"), text_encoder=None,
                                       tokenizer=None, transformer=tr)
    call = dict(image=td.image(64, 64, seed=3), prompt_embeds=td.rand(1, 5, td.D), height=64, width=64,
                prompt_embeds_mask=torch.ones(1, 5, dtype=torch.long))
    return pipe, call, 2, [((1, 4, 1, 4, 4), "decode", (2, 2)), ((1, 3, 1, 64, 64), "encode", (2, 2))]


def consisid():
    """ConsisIDPipeline (CogVideoX with identity conditioning) with the CogVideoX VAE of the video tests:
    the 48 x 80 reference image encoded (its latent sampled with the call's generator), a one-layer
    transformer with a tiny local facial extractor fed random face inputs (`id_cond`, `id_vit_hidden`: what
    its face models would give; no keypoints, whose drawing needs OpenCV), the video decoded. The class is
    imported from its module: diffusers' package exports a placeholder for it where OpenCV is missing, which
    the module itself imports only if present and uses only to draw keypoints."""
    from diffusers import ConsisIDTransformer3DModel
    from diffusers.pipelines.consisid.pipeline_consisid import ConsisIDPipeline
    from diffusers.schedulers import CogVideoXDPMScheduler

    tr = td.seeded(ConsisIDTransformer3DModel, num_attention_heads=2, attention_head_dim=16, in_channels=8,
                   out_channels=4, time_embed_dim=4, text_embed_dim=td.D, num_layers=1, sample_width=10,
                   sample_height=6, sample_frames=9, patch_size=2, max_text_seq_length=5,
                   use_rotary_positional_embeddings=True, is_train_face=True, cross_attn_interval=1,
                   cross_attn_dim_head=8, cross_attn_num_heads=2, LFE_id_dim=8, LFE_vit_dim=16, LFE_depth=1,
                   LFE_dim_head=8, LFE_num_heads=2, LFE_num_id_token=2, LFE_num_querie=4,
                   LFE_output_dim=21, LFE_ff_mult=1, LFE_num_scale=1)  # (kv width 21: 2/3 of 32)
    pipe = ConsisIDPipeline(tokenizer=None, text_encoder=None, vae=cogvideox_vae(), transformer=tr,
                            scheduler=CogVideoXDPMScheduler())
    call = td.neg(prompt_embeds=td.rand(1, 5, td.D), guidance_scale=2.0, height=48, width=80, num_frames=9,
                  max_sequence_length=5, image=td.image(48, 80, seed=3), id_cond=td.rand(1, 8, seed=4),
                  id_vit_hidden=[td.rand(1, 6, 16, seed=5)])
    return pipe, call, 3, [((1, 4, 3, 6, 10), "decode", (2, 4)), ((1, 3, 1, 48, 80), "encode", (2, 4))]


BUILDS = [mochi, ltx, ltx_image_to_video, ltx_timestep, ltx_condition, ltx2_audio_video, easyanimate,
          kandinsky6_super_resolution, hunyuan_image_refiner, consisid]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b.__name__)
def test_the_pipeline_with_the_tiled_vae_makes_the_stock_output(build):
    pipe, call, tile, plans = build()
    pipe.set_progress_bar_config(disable=True)
    call = dict(call, num_inference_steps=2, output_type="pt", return_dict=False)
    vae = pipe.vae
    with torch.no_grad(), mock.patch.object(vae, "decode", wraps=vae.decode) as decode, \
            mock.patch.object(vae, "encode", wraps=vae.encode) as encode:
        ref = pipe(generator=torch.Generator().manual_seed(1), **call)[0]
    calls = {(tuple(c.args[0].shape), kind) for kind, m in (("decode", decode), ("encode", encode))
             for c in m.call_args_list}
    assert calls == {(shape, kind) for shape, kind, _ in plans}  # (the shapes the pipeline's VAE calls take)
    pipe.vae = tw.TiledVAE(vae, tile_size=tile, progress=False)
    with torch.no_grad():
        out = pipe(generator=torch.Generator().manual_seed(1), **call)[0]
    for shape, kind, grid in plans:
        assert pipe.vae.plan(shape, kind=kind).grid == grid
    assert out.shape == ref.shape and (out - ref).abs().max() <= TOL
    assert ((ref > 0) & (ref < 1)).float().mean() > 0.5  # (most pixels not clamped: the test sees them)
