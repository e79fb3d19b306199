"""Tiny stock transformer pipelines (no download): SD3, Flux, Flux.2, Qwen-Image, Z-Image.

Real diffusers classes from tiny configs with seeded random weights; no text encoder (the pipelines take
`prompt_embeds`), VAEs of one or two levels so the latent of a 32 px image is 16 or 32 latent pixels.
`FAMILIES[name]()` -> (pipe, call kwargs for a prompt); `embeds(...)` are the prompt embeddings.
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    FluxPipeline,
    FluxTransformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    ZImagePipeline,
    ZImageTransformer2DModel,
)

D = 16  # text embedding width
POOLED = 8


def embeds(seed: int = 7, n: int = 1, tokens: int = 5):
    """(prompt (n, tokens, D), pooled (n, POOLED)) from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, tokens, D, generator=g), torch.randn(n, POOLED, generator=g)


def kl_vae(latent_channels: int, levels: int = 1, seed: int = 1) -> AutoencoderKL:
    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(4,) * levels,
                         down_block_types=("DownEncoderBlock2D",) * levels,
                         up_block_types=("UpDecoderBlock2D",) * levels, layers_per_block=1,
                         latent_channels=latent_channels, norm_num_groups=1, use_quant_conv=False,
                         use_post_quant_conv=False, shift_factor=0.06, scaling_factor=1.5).eval()


def sd3_transformer(seed: int = 0) -> SD3Transformer2DModel:
    torch.manual_seed(seed)
    return SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                 attention_head_dim=8, num_attention_heads=2, caption_projection_dim=16,
                                 joint_attention_dim=D, pooled_projection_dim=POOLED,
                                 pos_embed_max_size=24).eval()


def flux_transformer(seed: int = 0, in_channels: int = 16) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    return FluxTransformer2DModel(patch_size=1, in_channels=in_channels, out_channels=16, num_layers=1,
                                  num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                                  joint_attention_dim=D, pooled_projection_dim=POOLED,
                                  axes_dims_rope=(4, 6, 6)).eval()


def flux2_transformer(seed: int = 0) -> Flux2Transformer2DModel:
    torch.manual_seed(seed)
    return Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=D,
                                   timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4)).eval()


def qwen_transformer(seed: int = 0) -> QwenImageTransformer2DModel:
    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
                                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=D,
                                       axes_dims_rope=(4, 6, 6)).eval()


def zimage_transformer(seed: int = 0) -> ZImageTransformer2DModel:
    torch.manual_seed(seed)
    return ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32,
                                    n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=D,
                                    axes_dims=[8, 4, 4], axes_lens=[64, 64, 64]).eval()


def sd3():
    pipe = StableDiffusion3Pipeline(transformer=sd3_transformer(),
                                    scheduler=FlowMatchEulerDiscreteScheduler(), vae=kl_vae(4),
                                    text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                    text_encoder_3=None, tokenizer_3=None)
    pe, pp = embeds()
    ne, npool = embeds(seed=8)
    return pipe, dict(prompt_embeds=pe, pooled_prompt_embeds=pp, negative_prompt_embeds=ne,
                      negative_pooled_prompt_embeds=npool)


def flux():
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=kl_vae(4), text_encoder=None,
                        tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=flux_transformer())
    pe, pp = embeds()
    return pipe, dict(prompt_embeds=pe, pooled_prompt_embeds=pp)


def flux2():
    torch.manual_seed(1)
    vae = AutoencoderKLFlux2(block_out_channels=(4,), down_block_types=("DownEncoderBlock2D",),
                             up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=1,
                             layers_per_block=1, use_quant_conv=False, use_post_quant_conv=False).eval()
    pipe = Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                         tokenizer=None, transformer=flux2_transformer())
    return pipe, dict(prompt_embeds=embeds()[0])


def qwen():
    torch.manual_seed(1)
    vae = AutoencoderKLQwenImage(base_dim=4, z_dim=4, dim_mult=[1, 1], num_res_blocks=1,
                                 temperal_downsample=[False], latents_mean=[0.0] * 4,
                                 latents_std=[1.0] * 4).eval()
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                             tokenizer=None, transformer=qwen_transformer())
    pe = embeds()[0]
    return pipe, dict(prompt_embeds=pe, prompt_embeds_mask=torch.ones(1, pe.shape[1], dtype=torch.long))


def zimage():
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=kl_vae(4, levels=2),
                          text_encoder=None, tokenizer=None, transformer=zimage_transformer())
    pe, ne = embeds()[0], embeds(seed=8, tokens=3)[0]
    return pipe, dict(prompt_embeds=[pe[0]], negative_prompt_embeds=[ne[0]])


def image(px: int = 32):
    """A seeded random RGB picture, px x px."""
    import numpy as np
    import PIL.Image

    return PIL.Image.fromarray((np.random.default_rng(0).random((px, px, 3)) * 255).astype("uint8"))


def sd3_img2img():
    from diffusers import StableDiffusion3Img2ImgPipeline

    pipe, kw = sd3()
    return StableDiffusion3Img2ImgPipeline(**pipe.components), dict(kw, image=image(), strength=0.7)


def flux_img2img():
    from diffusers import FluxImg2ImgPipeline

    pipe, kw = flux()
    return FluxImg2ImgPipeline(**pipe.components), dict(kw, image=image(), strength=0.7)


def flux_kontext():
    """Kontext with a reference image of the output's size (no resize to Kontext's preferred sizes)."""
    from diffusers import FluxKontextPipeline

    pipe, kw = flux()
    kontext = FluxKontextPipeline(**pipe.components)
    return kontext, dict(kw, image=image(), _auto_resize=False, max_area=32 * 32)


def flux_fill():
    """Fill: every token carries the masked image's and the mask's channels (16 + 16 + 4 at VAE scale 1)."""
    import numpy as np
    import PIL.Image
    from diffusers import FluxFillPipeline

    pipe, kw = flux()
    fill = FluxFillPipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=None, tokenizer=None,
                            text_encoder_2=None, tokenizer_2=None,
                            transformer=flux_transformer(in_channels=36))
    mask = np.zeros((32, 32), dtype="uint8")
    mask[8:24, 8:24] = 255
    return fill, dict(kw, image=image(), mask_image=PIL.Image.fromarray(mask))


def flux2_klein():
    from diffusers import Flux2KleinPipeline

    pipe, kw = flux2()
    klein = Flux2KleinPipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=None, tokenizer=None,
                               transformer=pipe.transformer)
    return klein, dict(kw, negative_prompt_embeds=embeds(seed=8)[0])  # real CFG: two calls per step


FAMILIES = {"sd3": sd3, "flux": flux, "flux2": flux2, "qwen": qwen, "zimage": zimage}
VARIANTS = {"sd3-img2img": sd3_img2img, "flux-img2img": flux_img2img, "flux-fill": flux_fill,
            "flux-kontext": flux_kontext, "flux2-klein": flux2_klein}
