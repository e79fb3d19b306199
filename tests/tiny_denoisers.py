"""Tiny stock pipelines (no download) for every denoiser family TiledDenoiser tiles, images and video.

Real diffusers classes from tiny configs with seeded random weights; no text encoders (the pipelines take
prompt embeddings), the smallest VAEs each pipeline accepts. `CASES[name]` is a `Case`: `build()` ->
(pipe, call kwargs), the pipeline's denoiser attribute, the latent size the call makes, and how the
pipeline's output is read (`latent(out)`). Families whose pipeline needs a text encoder that cannot be
built small are called as their pipeline calls the denoiser (`Case.direct`: (model, inputs)). No tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

D = 16  # text embedding width


def g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(*shape, seed: int = 7) -> torch.Tensor:
    return torch.randn(*shape, generator=g(seed))


@dataclass
class Case:
    """One family's stock pipeline call (or direct call, `direct=True`), and where its denoiser sits."""

    build: Callable
    slot: str = "transformer"
    video: bool = True
    direct: bool = False
    steps: int = 1
    positions: bool = True  # the denoiser has positional inputs (test_each_tile_gets_the_positions...)
    tile_frames: int | None = 2  # frame windows in the positions test (video)
    extra: dict = field(default_factory=dict)  # keyword arguments of the pipeline call beyond build's
    tiles: dict = field(default_factory=dict)  # TiledDenoiser options of the several-tiles run, beyond SMALL


def seeded(cls, seed: int = 0, **config):
    """cls(**config) with seeded weights; parameters initialised to zero (output layers, adaLN gates of
    some families) get seeded noise too, so a prediction cannot be constant and a test cannot pass blind."""
    torch.manual_seed(seed)
    model = cls(**config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and not p.any():
                p.copy_(torch.randn(p.shape, generator=g(seed + 1)) * 0.1)
    return model


def flow():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler()


# ---- video transformers -----------------------------------------------------------------------------------
def wan_vae():
    from video_vae_support import video_vae

    return video_vae("wan2.1")


def wan_transformer(cls_name: str = "WanTransformer3DModel", in_channels: int = 4, **extra):
    import diffusers

    return seeded(getattr(diffusers, cls_name), patch_size=(1, 2, 2), num_attention_heads=2,
                  attention_head_dim=8, in_channels=in_channels, out_channels=4, text_dim=D, freq_dim=16,
                  ffn_dim=32, num_layers=1, rope_max_seq_len=32, **extra)


def wan():
    from diffusers import WanPipeline

    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=wan_vae(), transformer=wan_transformer(),
                       scheduler=flow())
    return pipe, dict(prompt_embeds=rand(1, 5, D), negative_prompt_embeds=rand(1, 5, D, seed=8),
                      guidance_scale=2.0, height=48, width=80, num_frames=9)


def neg(**kw):
    """The call kwargs with negative prompt embeddings of the same shapes (real CFG)."""
    out = dict(kw)
    for k, v in kw.items():
        if (k.startswith("prompt_embeds") or k.startswith("pooled_prompt_embeds")) and \
                isinstance(v, torch.Tensor) and v.is_floating_point():
            out["negative_" + k] = rand(*v.shape, seed=8)
        elif "mask" in k and k.startswith("prompt"):
            out["negative_" + k] = v
    return out


def wan_vace():
    from diffusers import WanVACEPipeline

    tr = wan_transformer("WanVACETransformer3DModel", vace_layers=[0], vace_in_channels=72)
    pipe = WanVACEPipeline(tokenizer=None, text_encoder=None, vae=wan_vae(), transformer=tr, scheduler=flow())
    video = [image(48, 80, seed=i) for i in range(9)]
    return pipe, dict(prompt_embeds=rand(1, 5, D), guidance_scale=1.0, height=48, width=80, num_frames=9,
                      video=video)


def skyreels():
    from diffusers import SkyReelsV2Pipeline

    pipe = SkyReelsV2Pipeline(tokenizer=None, text_encoder=None, vae=wan_vae(),
                              transformer=wan_transformer("SkyReelsV2Transformer3DModel"), scheduler=flow())
    return pipe, neg(prompt_embeds=rand(1, 5, D), guidance_scale=2.0, height=48, width=80, num_frames=9)


def hunyuan_video():
    from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoPipeline, HunyuanVideoTransformer3DModel

    tr = seeded(HunyuanVideoTransformer3DModel, in_channels=4, out_channels=4, num_attention_heads=2,
                attention_head_dim=8, num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2,
                patch_size_t=1, text_embed_dim=D, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4))
    vae = seeded(AutoencoderKLHunyuanVideo, in_channels=3, out_channels=3, latent_channels=4,
                 block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=4,
                 down_block_types=("HunyuanVideoDownBlock3D",) * 3,
                 up_block_types=("HunyuanVideoUpBlock3D",) * 3, spatial_compression_ratio=4,
                 temporal_compression_ratio=4)
    pipe = HunyuanVideoPipeline(text_encoder=None, tokenizer=None, transformer=tr, vae=vae, scheduler=flow(),
                                text_encoder_2=None, tokenizer_2=None)
    return pipe, dict(prompt_embeds=rand(1, 5, D), pooled_prompt_embeds=rand(1, 8),
                      prompt_attention_mask=torch.ones(1, 5, dtype=torch.long), height=32, width=48,
                      num_frames=9)


def hunyuan_video15():
    from diffusers import HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel
    from diffusers.guiders import ClassifierFreeGuidance

    tr = seeded(HunyuanVideo15Transformer3DModel, in_channels=9, out_channels=4, num_attention_heads=2,
                attention_head_dim=8, num_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1,
                text_embed_dim=D, text_embed_2_dim=8, image_embed_dim=8, rope_axes_dim=(2, 2, 4),
                task_type="t2v")
    pipe = HunyuanVideo15Pipeline(text_encoder=None, tokenizer=None, transformer=tr, vae=hunyuan15_vae(),
                                  scheduler=flow(), text_encoder_2=None, tokenizer_2=None,
                                  guider=ClassifierFreeGuidance(guidance_scale=2.0))
    return pipe, neg(prompt_embeds=rand(1, 5, D), prompt_embeds_mask=torch.ones(1, 5, dtype=torch.long),
                     prompt_embeds_2=rand(1, 3, 8), prompt_embeds_mask_2=torch.ones(1, 3, dtype=torch.long),
                     height=48, width=80, num_frames=9)


def hunyuan15_vae():
    from diffusers import AutoencoderKLHunyuanVideo15

    return seeded(AutoencoderKLHunyuanVideo15, in_channels=3, out_channels=3, latent_channels=4,
                  block_out_channels=(8, 8, 8, 8), layers_per_block=1, spatial_compression_ratio=8,
                  temporal_compression_ratio=4)


def sana_video():
    from diffusers import AutoencoderKLWan, SanaVideoPipeline, SanaVideoTransformer3DModel

    tr = seeded(SanaVideoTransformer3DModel, in_channels=4, out_channels=4, num_attention_heads=2,
                attention_head_dim=8, num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=8,
                cross_attention_dim=16, caption_channels=D, sample_size=8, rope_max_seq_len=32)
    del AutoencoderKLWan
    pipe = SanaVideoPipeline(tokenizer=None, text_encoder=None, vae=wan_vae(), transformer=tr,
                             scheduler=flow())
    return pipe, neg(prompt_embeds=rand(1, 5, D), prompt_attention_mask=torch.ones(1, 5, dtype=torch.long),
                     guidance_scale=2.0, height=64, width=96, frames=9, use_resolution_binning=False,
                     complex_human_instruction=None, negative_prompt=None)


def mochi():
    from diffusers import AutoencoderKLMochi, MochiPipeline, MochiTransformer3DModel

    tr = seeded(MochiTransformer3DModel, patch_size=2, num_attention_heads=2, attention_head_dim=8,
                num_layers=1, pooled_projection_dim=16, in_channels=4, text_embed_dim=D, time_embed_dim=4,
                max_sequence_length=16)
    vae = seeded(AutoencoderKLMochi, latent_channels=4, out_channels=3, encoder_block_out_channels=(32,) * 4,
                 decoder_block_out_channels=(32,) * 4, layers_per_block=(1,) * 5)
    pipe = MochiPipeline(scheduler=flow(), vae=vae, text_encoder=None, tokenizer=None, transformer=tr)
    return pipe, neg(prompt_embeds=rand(1, 5, D), prompt_attention_mask=torch.ones(1, 5, dtype=torch.long),
                     guidance_scale=2.0, height=48, width=80, num_frames=13)


def cosmos():
    """Cosmos Predict 2 video-to-world as its pipeline calls the transformer (its pipelines refuse to run
    without the cosmos_guardrail safety checker): the first latent frame is the condition. No padding-mask
    channel (resizing it needs torchvision)."""
    from diffusers import CosmosTransformer3DModel

    tr = seeded(CosmosTransformer3DModel, in_channels=5, out_channels=4, num_attention_heads=2,
                attention_head_dim=12, num_layers=1, text_embed_dim=D, adaln_lora_dim=4, max_size=(8, 16, 16),
                patch_size=(1, 2, 2), rope_scale=(1.0, 3.0, 3.0), concat_padding_mask=False,
                extra_pos_embed_type="learnable")
    T, H, W = 3, 6, 10
    cond = torch.zeros(1, 1, T, 1, 1)
    cond[:, :, :1] = 1
    inputs = dict(hidden_states=rand(1, 4, T, H, W), timestep=0.2 * cond + 0.7 * (1 - cond),
                  encoder_hidden_states=rand(1, 5, D), fps=16, condition_mask=cond.expand(1, 1, T, H, W),
                  padding_mask=torch.zeros(1, 1, H * 8, W * 8))
    return tr, inputs


def cogvideox(rope: bool = True):
    """CogVideoX 5B-like (the pipeline's rotary table) or 2B-like (the patch embedding's sinusoidal one)."""
    from diffusers import AutoencoderKLCogVideoX, CogVideoXPipeline, CogVideoXTransformer3DModel
    from diffusers.schedulers import CogVideoXDDIMScheduler

    tr = seeded(CogVideoXTransformer3DModel, num_attention_heads=2, attention_head_dim=16, in_channels=4,
                out_channels=4, time_embed_dim=4, text_embed_dim=D, num_layers=1, sample_width=10,
                sample_height=6, sample_frames=9, patch_size=2, max_text_seq_length=5,
                use_rotary_positional_embeddings=rope)
    vae = seeded(AutoencoderKLCogVideoX, latent_channels=4, block_out_channels=(8,) * 4, layers_per_block=1,
                 norm_num_groups=2, temporal_compression_ratio=4)
    pipe = CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=tr,
                             scheduler=CogVideoXDDIMScheduler())
    return pipe, neg(prompt_embeds=rand(1, 5, D), guidance_scale=2.0, height=48, width=80, num_frames=9,
                     max_sequence_length=5)


def ltx():
    from diffusers import LTXPipeline, LTXVideoTransformer3DModel
    from video_vae_support import video_vae

    tr = seeded(LTXVideoTransformer3DModel, in_channels=4, out_channels=4, num_attention_heads=2,
                attention_head_dim=8, cross_attention_dim=16, num_layers=1, caption_channels=D)
    pipe = LTXPipeline(scheduler=flow(), vae=video_vae("ltx0.9.0"), text_encoder=None, tokenizer=None,
                       transformer=tr)
    return pipe, neg(prompt_embeds=rand(1, 5, D), prompt_attention_mask=torch.ones(1, 5, dtype=torch.long),
                     guidance_scale=2.0, height=64, width=96, num_frames=9)


def kandinsky5():
    from diffusers import Kandinsky5T2VPipeline, Kandinsky5Transformer3DModel

    tr = seeded(Kandinsky5Transformer3DModel, in_visual_dim=4, in_text_dim=D, in_text_dim2=8, time_dim=16,
                out_visual_dim=4, patch_size=(1, 2, 2), model_dim=16, ff_dim=32, num_text_blocks=1,
                num_visual_blocks=1, axes_dims=(4, 2, 2))
    pipe = Kandinsky5T2VPipeline(transformer=tr, vae=None, text_encoder=None, tokenizer=None,
                                 text_encoder_2=None, tokenizer_2=None, scheduler=flow())
    cu = torch.tensor([0, 5], dtype=torch.int32)
    return pipe, dict(prompt_embeds_qwen=rand(5, D), prompt_embeds_clip=rand(1, 8), prompt_cu_seqlens=cu,
                      negative_prompt_embeds_qwen=rand(5, D, seed=8), negative_prompt_embeds_clip=rand(1, 8),
                      negative_prompt_cu_seqlens=cu, guidance_scale=2.0, height=48, width=80, num_frames=9)


def kandinsky6():
    from diffusers import Kandinsky6TI2VAPipeline, Kandinsky6Transformer3DModel

    tr = seeded(Kandinsky6Transformer3DModel, in_visual_dim=4, out_visual_dim=4, in_text_dim=D,
                in_text_dim2=8, time_dim=16, model_dim=16, ff_dim=32, num_text_blocks=1, num_visual_blocks=1,
                axes_dims=(4, 2, 2), visual_cond=False, in_audio_dim=4, out_audio_dim=4)
    pipe = Kandinsky6TI2VAPipeline(transformer=tr, vae=None, text_encoder=None, tokenizer=None,
                                   text_encoder_2=None, tokenizer_2=None, scheduler=flow(), audio_vae=None,
                                   vocoder=None)
    return pipe, neg(prompt_embeds=rand(1, 5, D), pooled_prompt_embeds=rand(1, 8), sample_audio=False,
                     guidance_scale=2.0, height=48, width=80, num_frames=9)


# ---- image transformers ------------------------------------------------------------------------------------
def kl_vae(latent: int = 4, levels: int = 2):
    """AutoencoderKL of `levels` levels: the pipelines read their VAE factor 2^(levels - 1) from it."""
    from tiny_transformers import kl_vae as build

    return build(latent, levels=levels)


def dit_like(cls_name: str, **config):
    import diffusers

    return seeded(getattr(diffusers, cls_name), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                  num_layers=1, patch_size=2, **config)


def pixart():
    from diffusers import PixArtSigmaPipeline

    tr = dit_like("PixArtTransformer2DModel", out_channels=8, sample_size=8, cross_attention_dim=16,
                  caption_channels=D, norm_num_groups=2)
    pipe = PixArtSigmaPipeline(tokenizer=None, text_encoder=None, vae=kl_vae(), transformer=tr,
                               scheduler=ddim())
    return pipe, neg(prompt_embeds=rand(1, 5, D), prompt_attention_mask=torch.ones(1, 5, dtype=torch.long),
                     guidance_scale=2.0, height=24, width=40, use_resolution_binning=False,
                     negative_prompt=None)


def dit():
    from diffusers import DiTPipeline

    tr = dit_like("DiTTransformer2DModel", out_channels=8, sample_size=8, norm_num_groups=2,
                  num_embeds_ada_norm=1000)  # the pipeline's unconditional class is 1000
    pipe = DiTPipeline(transformer=tr, vae=kl_vae(), scheduler=ddim())
    return pipe, dict(class_labels=[1], guidance_scale=2.0)


def ddim():
    from diffusers import DDIMScheduler

    return DDIMScheduler()


def auraflow():
    from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel

    tr = seeded(AuraFlowTransformer2DModel, sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1,
                num_single_dit_layers=1, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=D,
                caption_projection_dim=16, out_channels=4, pos_embed_max_size=256)
    pipe = AuraFlowPipeline(tokenizer=None, text_encoder=None, vae=kl_vae(), transformer=tr, scheduler=flow())
    return pipe, neg(prompt_embeds=rand(1, 5, D), prompt_attention_mask=torch.ones(1, 5, dtype=torch.long),
                     guidance_scale=2.0, height=24, width=40)


def sana(interpolation_scale=1.0):
    from diffusers import SanaPipeline, SanaTransformer2DModel

    tr = seeded(SanaTransformer2DModel, in_channels=4, out_channels=4, num_attention_heads=2,
                attention_head_dim=8, num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=8,
                cross_attention_dim=16, caption_channels=D, sample_size=8, patch_size=2,
                interpolation_scale=interpolation_scale)
    pipe = SanaPipeline(tokenizer=None, text_encoder=None, vae=dc_vae(), transformer=tr, scheduler=flow())
    return pipe, neg(prompt_embeds=rand(1, 5, D), prompt_attention_mask=torch.ones(1, 5, dtype=torch.long),
                     guidance_scale=2.0, height=32, width=64, use_resolution_binning=False,
                     complex_human_instruction=None, negative_prompt=None)


def dc_vae():
    """AutoencoderDC of two levels (factor 2), as Sana's pipelines read their VAE factor from it."""
    from diffusers import AutoencoderDC

    return seeded(AutoencoderDC, latent_channels=4, attention_head_dim=4, encoder_block_types="ResBlock",
                  decoder_block_types="ResBlock", encoder_block_out_channels=(8, 8),
                  decoder_block_out_channels=(8, 8), encoder_layers_per_block=(1, 1),
                  decoder_layers_per_block=(1, 1), encoder_qkv_multiscales=((), ()),
                  decoder_qkv_multiscales=((), ()), decoder_norm_types="rms_norm")


def cogview3plus():
    from diffusers import CogView3PlusPipeline, CogView3PlusTransformer2DModel

    tr = seeded(CogView3PlusTransformer2DModel, patch_size=2, in_channels=4, num_layers=1,
                attention_head_dim=8, num_attention_heads=2, out_channels=4, text_embed_dim=D,
                time_embed_dim=8, condition_dim=2, pos_embed_max_size=16, sample_size=8)
    pipe = CogView3PlusPipeline(tokenizer=None, text_encoder=None, vae=kl_vae(), transformer=tr,
                                scheduler=ddim())
    return pipe, neg(prompt_embeds=rand(1, 5, D), guidance_scale=2.0, height=24, width=40)


def cogview4():
    from diffusers import CogView4Pipeline, CogView4Transformer2DModel

    tr = seeded(CogView4Transformer2DModel, patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                attention_head_dim=8, num_attention_heads=2, text_embed_dim=D, time_embed_dim=8,
                condition_dim=2, pos_embed_max_size=16, sample_size=8, rope_axes_dim=(16, 16))
    pipe = CogView4Pipeline(tokenizer=None, text_encoder=None, vae=kl_vae(), transformer=tr, scheduler=flow())
    return pipe, neg(prompt_embeds=rand(1, 5, D), guidance_scale=2.0, height=32, width=48)


def hunyuan_image():
    from diffusers import HunyuanImagePipeline, HunyuanImageTransformer2DModel
    tr = seeded(HunyuanImageTransformer2DModel, in_channels=4, out_channels=4, num_attention_heads=2,
                attention_head_dim=8, num_layers=1, num_single_layers=1, num_refiner_layers=1,
                patch_size=(2, 2), text_embed_dim=D, text_embed_2_dim=8, rope_axes_dim=(4, 4))
    from diffusers import AutoencoderKLHunyuanImage
    from diffusers.guiders import ClassifierFreeGuidance

    vae = seeded(AutoencoderKLHunyuanImage, in_channels=3, out_channels=3, latent_channels=4,
                 block_out_channels=(32, 32), layers_per_block=1, spatial_compression_ratio=2, sample_size=32)
    pipe = HunyuanImagePipeline(scheduler=flow(), vae=vae, text_encoder=None, tokenizer=None,
                                text_encoder_2=None, tokenizer_2=None, transformer=tr,
                                guider=ClassifierFreeGuidance(guidance_scale=2.0), ocr_guider=None)
    return pipe, neg(prompt_embeds=rand(1, 5, D), prompt_embeds_mask=torch.ones(1, 5, dtype=torch.long),
                     prompt_embeds_2=rand(1, 3, 8), prompt_embeds_mask_2=torch.ones(1, 3, dtype=torch.long),
                     height=24, width=40)


def lumina2():
    from diffusers import Lumina2Pipeline, Lumina2Transformer2DModel

    tr = seeded(Lumina2Transformer2DModel, sample_size=8, patch_size=2, in_channels=4, hidden_size=16,
                num_layers=1, num_refiner_layers=1, num_attention_heads=2, num_kv_heads=2, multiple_of=4,
                axes_dim_rope=(4, 2, 2), axes_lens=(32, 32, 32), cap_feat_dim=D)
    pipe = Lumina2Pipeline(transformer=tr, scheduler=flow(), vae=kl_vae(), text_encoder=None, tokenizer=None)
    mask = torch.ones(1, 5, dtype=torch.long)
    return pipe, dict(prompt_embeds=rand(1, 5, D), prompt_attention_mask=mask,
                      negative_prompt_embeds=rand(1, 5, D, seed=8),
                      negative_prompt_attention_mask=mask.clone(), guidance_scale=2.0, height=32, width=48,
                      system_prompt="")


def hunyuan_dit():
    """HunyuanDiT as its pipeline calls the transformer (its text encoders are BERT and mT5, and its pipeline
    sizes the rotary grid for an 8x VAE): the 2-D rotary table of the whole latent, its crop region as the
    pipeline computes it, image_meta_size and style per row, CFG."""
    from diffusers import HunyuanDiT2DModel
    from diffusers.models.embeddings import get_2d_rotary_pos_embed
    from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid

    tr = seeded(HunyuanDiT2DModel, num_attention_heads=2, attention_head_dim=8, in_channels=4, patch_size=2,
                sample_size=8, hidden_size=16, num_layers=4, cross_attention_dim=D, cross_attention_dim_t5=D,
                pooled_projection_dim=8, text_len=5, text_len_t5=5)
    h, w = 6, 10  # tokens of a 12 x 20 latent
    rope = get_2d_rotary_pos_embed(8, get_resize_crop_region_for_grid((h, w), 8), (h, w), output_type="pt")
    ones = torch.ones(2, 5, dtype=torch.long)
    return tr, dict(hidden_states=rand(1, 4, 2 * h, 2 * w, seed=3).expand(2, -1, -1, -1),
                    timestep=torch.tensor([700.0, 700.0]), encoder_hidden_states=rand(2, 5, D),
                    text_embedding_mask=ones, encoder_hidden_states_t5=rand(2, 5, D, seed=4),
                    text_embedding_mask_t5=ones, style=torch.tensor([0, 0]), image_rotary_emb=rope,
                    image_meta_size=torch.tensor([[96.0, 160, 96, 160, 0, 0]] * 2))


def hidream():
    """HiDream-I1 with prompt embeddings (T5, two Llama layers, pooled CLIP); max_resolution 16 x 16 latent
    px (64 tokens), and the pipeline's default size scaled to match (it resizes every request to the area
    of default_sample_size): a 24 x 40 image, a non-square 12 x 20 latent padded to max_seq."""
    from diffusers import HiDreamImagePipeline, HiDreamImageTransformer2DModel

    tr = seeded(HiDreamImageTransformer2DModel, patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                num_single_layers=1, attention_head_dim=8, num_attention_heads=2, caption_channels=[D, D],
                text_emb_dim=8, num_routed_experts=2, num_activated_experts=1, axes_dims_rope=(4, 2, 2),
                max_resolution=(16, 16), llama_layers=[0, 1])
    none = dict.fromkeys([f"{k}{i}" for k in ("text_encoder", "tokenizer") for i in ("", "_2", "_3", "_4")])
    pipe = HiDreamImagePipeline(scheduler=flow(), vae=kl_vae(), transformer=tr, **none)
    pipe.default_sample_size = 16
    return pipe, dict(prompt_embeds_t5=rand(1, 5, D), prompt_embeds_llama3=rand(2, 1, 4, D, seed=3),
                      pooled_prompt_embeds=rand(1, 8, seed=4),
                      negative_prompt_embeds_t5=rand(1, 5, D, seed=8),
                      negative_prompt_embeds_llama3=rand(2, 1, 4, D, seed=9),
                      negative_pooled_prompt_embeds=rand(1, 8, seed=10), guidance_scale=2.0, height=24,
                      width=40)


def qwen_image21():
    """Qwen-Image 2.1 as its pipeline calls the transformer for one prompt (its text encoder is Qwen3-VL):
    one condition image (2 x 4 tokens, two vision-language slots) and a 6 x 10 target, the text's last
    token padded; no prefix cache (see test_denoiser_families for the cache's extract / cached calls)."""
    from diffusers import QwenImage21Transformer2DModel

    tr = seeded(QwenImage21Transformer2DModel, patch_size=1, in_channels=4, out_channels=4, num_layers=1,
                attention_head_dim=8, num_attention_heads=2, context_in_dim=D, mlp_ratio=2,
                axes_dims_rope=(2, 2, 4))
    h, w = 6, 10
    vlm = torch.tensor([False, False, True, True, False, False, False])  # 5 text tokens, 2 image slots
    return tr, dict(hidden_states=torch.cat([rand(1, 8, 4, seed=2), rand(1, h * w, 4, seed=3)], dim=1),
                    encoder_hidden_states=rand(1, 7, D), timestep=torch.tensor([0.7]),
                    img_shapes=[[(1, 2, 4), (1, h, w)]],
                    img_mask=torch.cat([vlm, torch.ones(h * w // 4, dtype=torch.bool)])[None],
                    encoder_hidden_states_mask=torch.tensor([[1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool))


# ---- Flux-like token layouts (img_ids) ---------------------------------------------------------------------
def flux_like(cls_name: str, **config):
    import diffusers

    return seeded(getattr(diffusers, cls_name), patch_size=1, in_channels=16, num_layers=1,
                  num_single_layers=1, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=D,
                  axes_dims_rope=(4, 6, 6), **config)


def chroma():
    from diffusers import ChromaPipeline

    tr = flux_like("ChromaTransformer2DModel", approximator_num_channels=8, approximator_hidden_dim=16,
                   approximator_layers=1)
    pipe = ChromaPipeline(scheduler=flow(), vae=kl_vae(), text_encoder=None, tokenizer=None, transformer=tr)
    return pipe, neg(prompt_embeds=rand(1, 5, D), prompt_attention_mask=torch.ones(1, 5, dtype=torch.bool),
                     guidance_scale=2.0, height=24, width=40)


def bria():
    from diffusers import BriaPipeline

    pipe = BriaPipeline(transformer=flux_like("BriaTransformer2DModel"), scheduler=flow(), vae=kl_vae(),
                        text_encoder=None, tokenizer=None)
    return pipe, neg(prompt_embeds=rand(1, 5, D), guidance_scale=2.0, height=24, width=40)


def longcat():
    """LongCat-Image as its pipeline calls the transformer (its encode_prompt needs a prompt string even
    with prompt_embeds): text ids numbered from 0, image ids from the tokenizer's length on."""
    from diffusers.pipelines.longcat_image.pipeline_longcat_image import prepare_pos_ids

    tr = flux_like("LongCatImageTransformer2DModel", pooled_projection_dim=D)
    h, w = 5, 9  # tokens (a 10 x 18 latent)
    inputs = dict(hidden_states=rand(1, h * w, 16), timestep=torch.tensor([0.7]),
                  guidance=None, encoder_hidden_states=rand(1, 5, D),
                  txt_ids=prepare_pos_ids(modality_id=0, type="text", start=(0, 0), num_token=5),
                  img_ids=prepare_pos_ids(modality_id=1, type="image", start=(512, 512), height=h, width=w))
    return tr, inputs


def ovis():
    from diffusers import OvisImagePipeline

    pipe = OvisImagePipeline(scheduler=flow(), vae=kl_vae(), text_encoder=None, tokenizer=None,
                             transformer=flux_like("OvisImageTransformer2DModel", out_channels=16))
    return pipe, neg(prompt_embeds=rand(1, 5, D), guidance_scale=2.0, height=24, width=40,
                     negative_prompt=None)


# ---- UNets -------------------------------------------------------------------------------------------------
UD = 32  # UNet cross-attention width


def sd_vae():
    return kl_vae(4, levels=2)


def ddpm():
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    unet = seeded(UNet2DModel, sample_size=12, in_channels=3, out_channels=3, block_out_channels=(32, 32),
                  layers_per_block=1, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                  up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8)
    return DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=10)), {}


def animatediff():
    from diffusers import AnimateDiffPipeline, MotionAdapter, UNet2DConditionModel

    unet = seeded(UNet2DConditionModel, block_out_channels=(32, 32), layers_per_block=1, sample_size=8,
                  in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=UD,
                  norm_num_groups=8)
    motion = seeded(MotionAdapter, block_out_channels=(32, 32), motion_layers_per_block=1,
                    motion_num_attention_heads=2, motion_norm_num_groups=8, motion_max_seq_length=16)
    pipe = AnimateDiffPipeline(vae=sd_vae(), text_encoder=None, tokenizer=None, unet=unet,
                               motion_adapter=motion, scheduler=ddim())
    return pipe, neg(prompt_embeds=rand(1, 5, UD), guidance_scale=2.0, height=24, width=40, num_frames=5)


def text_to_video():
    from diffusers import TextToVideoSDPipeline, UNet3DConditionModel

    unet = seeded(UNet3DConditionModel, block_out_channels=(32, 32), layers_per_block=1, in_channels=4,
                  out_channels=4, down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
                  up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), cross_attention_dim=UD,
                  norm_num_groups=8, attention_head_dim=8)
    pipe = TextToVideoSDPipeline(vae=sd_vae(), text_encoder=None, tokenizer=None, unet=unet, scheduler=ddim())
    return pipe, neg(prompt_embeds=rand(1, 5, UD), guidance_scale=2.0, height=24, width=40, num_frames=5)


def svd():
    """Stable Video Diffusion as its pipeline calls the UNet (its image encoder is a CLIP vision model):
    the image latents concatenated along channels, image embeddings and added_time_ids per row, CFG."""
    from diffusers import UNetSpatioTemporalConditionModel

    unet = seeded(UNetSpatioTemporalConditionModel, in_channels=8, out_channels=4,
                  block_out_channels=(32, 32),
                  down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
                  up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
                  addition_time_embed_dim=4, projection_class_embeddings_input_dim=12, layers_per_block=1,
                  cross_attention_dim=UD, num_attention_heads=(2, 2), num_frames=5)
    T, H, W = 5, 10, 14
    image = rand(1, 1, 4, H, W).expand(1, T, 4, H, W)
    x = torch.cat([rand(1, T, 4, H, W, seed=3), image], dim=2)
    emb = rand(1, 1, UD, seed=4)
    return unet, dict(sample=torch.cat([x, x]), timestep=torch.tensor(0.6),
                      encoder_hidden_states=torch.cat([torch.zeros_like(emb), emb]),
                      added_time_ids=torch.tensor([[6.0, 127.0, 0.02]] * 2))


def i2vgen_xl():
    """I2VGen-XL as its pipeline calls the UNet (image encoder and text encoder are CLIP models): the
    first frame's latents (zeros after it), image embeddings, fps, CFG."""
    from diffusers import I2VGenXLUNet

    unet = seeded(I2VGenXLUNet, in_channels=4, out_channels=4, block_out_channels=(32, 32),
                  down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
                  up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), layers_per_block=1, norm_num_groups=8,
                  cross_attention_dim=UD, attention_head_dim=8, num_attention_heads=2)
    T, H, W = 5, 10, 14
    first = torch.zeros(1, 4, T, H, W)
    first[:, :, :1] = rand(1, 4, 1, H, W)
    x = rand(1, 4, T, H, W, seed=3)
    return unet, dict(sample=torch.cat([x, x]), timestep=torch.tensor(600), fps=torch.tensor([16, 16]),
                      image_latents=torch.cat([first, first]), image_embeddings=rand(2, UD, seed=4),
                      encoder_hidden_states=rand(2, 5, UD, seed=5))


def stable_cascade():
    """Stable Cascade's decoder UNet as its pipeline calls it: effnet (the prior's latents, at a smaller
    size the model resizes), zero pixels, pooled text embeddings; CFG."""
    from diffusers import StableCascadeUNet

    blocks = (("SDCascadeResBlock", "SDCascadeTimestepBlock"),
              ("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"))
    unet = seeded(StableCascadeUNet, in_channels=4, out_channels=4, timestep_ratio_embedding_dim=8,
                  patch_size=2, conditioning_dim=16, block_out_channels=(16, 16), num_attention_heads=(2, 2),
                  down_num_layers_per_block=(1, 1), up_num_layers_per_block=(1, 1),
                  clip_text_pooled_in_channels=UD, effnet_in_channels=4, pixel_mapper_in_channels=3,
                  dropout=(0.0, 0.0), self_attn=True, block_types_per_layer=blocks)
    x = rand(1, 4, 12, 20, seed=3)
    effnet = rand(1, 4, 5, 7, seed=4)
    return unet, dict(sample=torch.cat([x, x]), timestep_ratio=torch.tensor([0.6, 0.6]),
                      clip_text_pooled=rand(2, 1, UD, seed=5), effnet=torch.cat([effnet, effnet]),
                      pixels=torch.zeros(2, 3, 8, 8))


def kandinsky22():
    from diffusers import KandinskyV22Pipeline, UNet2DConditionModel, VQModel

    unet = seeded(UNet2DConditionModel, block_out_channels=(32, 32), layers_per_block=1, sample_size=8,
                  in_channels=4, out_channels=8,
                  down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
                  up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
                  mid_block_type="UNetMidBlock2DSimpleCrossAttn", encoder_hid_dim=UD,
                  encoder_hid_dim_type="image_proj", addition_embed_type="image", cross_attention_dim=UD,
                  norm_num_groups=8, attention_head_dim=8, class_embed_type=None)
    movq = seeded(VQModel, block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                  layers_per_block=1, num_vq_embeddings=8, vq_embed_dim=4)
    from diffusers import DDPMScheduler

    pipe = KandinskyV22Pipeline(unet=unet, scheduler=DDPMScheduler(), movq=movq)
    return pipe, dict(image_embeds=rand(1, UD), negative_image_embeds=rand(1, UD, seed=8), guidance_scale=2.0,
                      height=24, width=40)


def controlnet_xs():
    from diffusers import ControlNetXSAdapter, StableDiffusionControlNetXSPipeline, UNet2DConditionModel

    unet = seeded(UNet2DConditionModel, block_out_channels=(32, 32), layers_per_block=2, sample_size=8,
                  in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=UD,
                  norm_num_groups=8)
    torch.manual_seed(1)
    adapter = ControlNetXSAdapter.from_unet(unet, size_ratio=0.5, learn_time_embedding=True,
                                            conditioning_embedding_out_channels=(4, 8))
    pipe = StableDiffusionControlNetXSPipeline(vae=sd_vae(), text_encoder=None, tokenizer=None, unet=unet,
                                               controlnet=adapter, scheduler=ddim(), safety_checker=None,
                                               feature_extractor=None, requires_safety_checker=False)
    return pipe, neg(prompt_embeds=rand(1, 5, UD), guidance_scale=2.0, height=24, width=40,
                     image=image(24, 40))


def chronoedit():
    """ChronoEdit as its pipeline calls the transformer (the pipeline needs a CLIP image encoder): the
    edited image's latents as channels of the sample, image embeddings per row."""
    tr = wan_transformer("ChronoEditTransformer3DModel", in_channels=8, image_dim=8)
    T, H, W = 3, 6, 10
    x = torch.cat([rand(1, 4, T, H, W, seed=3), rand(1, 4, T, H, W, seed=4)], dim=1)
    return tr, dict(hidden_states=x, timestep=torch.tensor([700]), encoder_hidden_states=rand(1, 5, D),
                    encoder_hidden_states_image=rand(1, 3, 8, seed=5))


def wan_animate():
    """Wan 2.2 Animate as its pipeline calls the transformer (the pipeline needs a CLIP image encoder): the
    reference image's latent frame first, pose latents one frame fewer, a face video in pixels."""
    from diffusers import WanAnimateTransformer3DModel

    tr = seeded(WanAnimateTransformer3DModel, patch_size=(1, 2, 2), num_attention_heads=2,
                attention_head_dim=8, latent_channels=4, in_channels=12, out_channels=4, text_dim=D,
                freq_dim=16, ffn_dim=32, num_layers=1, image_dim=8, rope_max_seq_len=32,
                motion_encoder_size=16, motion_encoder_channel_sizes={"4": 8, "8": 8, "16": 8},
                motion_style_dim=8, motion_dim=4,
                motion_encoder_dim=8, face_encoder_hidden_dim=8, face_encoder_num_heads=2,
                inject_face_latents_blocks=1, motion_encoder_batch_size=4)
    T, H, W = 3, 6, 10
    return tr, dict(hidden_states=rand(1, 12, T + 1, H, W, seed=3), timestep=torch.tensor([700]),
                    encoder_hidden_states=rand(1, 5, D), encoder_hidden_states_image=rand(1, 3, 8, seed=5),
                    pose_hidden_states=rand(1, 4, T, H, W, seed=6),
                    face_pixel_values=rand(1, 3, 9, 16, 16, seed=7))


def allegro():
    """Allegro as its pipeline calls the transformer (its text encoder is T5-XXL, its VAE large): the
    pipeline's rotary positions for the whole latent."""
    from diffusers import AllegroPipeline, AllegroTransformer3DModel

    tr = seeded(AllegroTransformer3DModel, num_attention_heads=2, attention_head_dim=12, in_channels=4,
                out_channels=4, num_layers=1, cross_attention_dim=24, sample_height=6, sample_width=10,
                sample_frames=3, caption_channels=D)
    T, H, W = 3, 6, 10
    holder = type("Pipe", (), {"transformer": tr, "vae_scale_factor_spatial": 8})()
    rope = AllegroPipeline._prepare_rotary_positional_embeddings(holder, 1, H * 8, W * 8, T, "cpu")
    return tr, dict(hidden_states=rand(1, 4, T, H, W, seed=3), encoder_hidden_states=rand(1, 5, D),
                    timestep=torch.tensor([700]), encoder_attention_mask=torch.ones(1, 5),
                    image_rotary_emb=rope)


def consisid():
    """ConsisID (CogVideoX with identity conditioning, off here) as its pipeline calls the transformer (its
    pipeline needs face models): the 2B-like sinusoidal table in the patch embedding."""
    from diffusers import ConsisIDTransformer3DModel

    tr = seeded(ConsisIDTransformer3DModel, num_attention_heads=2, attention_head_dim=16, in_channels=4,
                out_channels=4, time_embed_dim=4, text_embed_dim=D, num_layers=1, sample_width=10,
                sample_height=6, sample_frames=9, patch_size=2, max_text_seq_length=5, is_train_face=False)
    return tr, dict(hidden_states=rand(1, 3, 4, 6, 10, seed=3), encoder_hidden_states=rand(1, 5, D),
                    timestep=torch.tensor([700]))


def easyanimate():
    """EasyAnimate (V5.1) as its pipeline calls the transformer (its text encoder is Qwen2-VL): inpaint
    latents (mask and masked video) on the latent's grid."""
    from diffusers import EasyAnimateTransformer3DModel

    tr = seeded(EasyAnimateTransformer3DModel, num_attention_heads=2, attention_head_dim=16, in_channels=4,
                out_channels=4, patch_size=2, num_layers=1, mmdit_layers=1, time_embed_dim=8,
                text_embed_dim=D, sample_width=10, sample_height=6)
    return tr, dict(hidden_states=rand(1, 4, 3, 6, 10, seed=3), timestep=torch.tensor([700]),
                    encoder_hidden_states=rand(1, 5, D))


def image(h: int = 32, w: int = 32, seed: int = 0):
    """A seeded random RGB picture, h x w."""
    import numpy as np
    import PIL.Image

    return PIL.Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


CASES: dict[str, Case] = {
    "wan": Case(wan),
    "wan-vace": Case(wan_vace),
    "skyreels-v2": Case(skyreels),
    "hunyuan-video": Case(hunyuan_video),
    "hunyuan-video-1.5": Case(hunyuan_video15),
    "sana-video": Case(sana_video),
    "mochi": Case(mochi, steps=2),  # Mochi's sigma schedule needs two steps
    "cosmos": Case(cosmos, direct=True),
    "cogvideox": Case(cogvideox),
    "cogvideox-2b": Case(lambda: cogvideox(rope=False)),
    "ltx-video": Case(ltx),
    "kandinsky5": Case(kandinsky5),
    "kandinsky6": Case(kandinsky6),
    "pixart-sigma": Case(pixart, video=False),
    "dit": Case(dit, video=False),
    "auraflow": Case(auraflow, video=False),
    "sana": Case(sana, video=False),
    "cogview3plus": Case(cogview3plus, video=False),
    "cogview4": Case(cogview4, video=False),
    "hunyuan-image-2.1": Case(hunyuan_image, video=False),
    "lumina2": Case(lumina2, video=False),
    "hunyuan-dit": Case(hunyuan_dit, video=False, direct=True),
    "qwen-image-2.1": Case(qwen_image21, video=False, direct=True),
    "hidream": Case(hidream, video=False, tiles=dict(tile_size=(4, 6))),  # non-square tiles: padded
    "chroma": Case(chroma, video=False),
    "bria": Case(bria, video=False),
    "longcat-image": Case(longcat, video=False, direct=True),
    "ovis-image": Case(ovis, video=False),
    "chronoedit": Case(chronoedit, direct=True),
    "wan-animate": Case(wan_animate, direct=True, tile_frames=None),  # its reference frame: no windows
    "consisid": Case(consisid, direct=True),
    "allegro": Case(allegro, direct=True),
    "easyanimate": Case(easyanimate, direct=True),
    "ddpm": Case(ddpm, slot="unet", video=False, positions=False, extra=dict(batch_size=1)),
    "animatediff": Case(animatediff, slot="unet", positions=False),
    "text-to-video-sd": Case(text_to_video, slot="unet", positions=False),
    "svd": Case(svd, slot="unet", direct=True, positions=False),
    "i2vgen-xl": Case(i2vgen_xl, slot="unet", direct=True, positions=False),
    "stable-cascade": Case(stable_cascade, slot="unet", direct=True, video=False, positions=False),
    "kandinsky-2.2": Case(kandinsky22, slot="unet", video=False, positions=False),
    "controlnet-xs": Case(controlnet_xs, slot="unet", video=False, positions=False),
}
