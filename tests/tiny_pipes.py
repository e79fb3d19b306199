"""Eleven stock diffusers pipelines from tiny seeded configs, each with one call (no tests here).

Prompt embeddings are passed directly (no tokenizer or text encoder); every pipeline runs 2 steps on a
small image. `CASES[name]` is (build() -> pipeline, run(pipeline) -> np image, the denoiser attribute,
the VAE attribute). Builders are seeded, so two builds hold the same weights.
"""

from __future__ import annotations

import numpy as np
import torch

D = 32  # cross-attention / text width


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _unet(in_channels: int = 4, sdxl: bool = False, **extra):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    if sdxl:
        extra.update(addition_embed_type="text_time", addition_time_embed_dim=8, use_linear_projection=True,
                     projection_class_embeddings_input_dim=8 * 6 + D, attention_head_dim=(2, 4))
    return UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=16, in_channels=in_channels,
        out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=D, norm_num_groups=32,
        **extra).eval()


def live(module, seed: int = 3, scale: float = 0.1):
    """A ControlNet's zero-initialised layers (zero convolutions, as diffusers builds it) filled with seeded
    noise: a ControlNet straight from its config adds nothing, so a test of its residuals could not fail."""
    g = _g(seed)
    with torch.no_grad():
        for p in module.parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return module


def _controlnet(sdxl: bool = False, seed: int = 2):
    from diffusers import ControlNetModel

    torch.manual_seed(seed)
    extra = {}
    if sdxl:
        extra = dict(addition_embed_type="text_time", addition_time_embed_dim=8, use_linear_projection=True,
                     projection_class_embeddings_input_dim=8 * 6 + D, attention_head_dim=(2, 4))
    return live(ControlNetModel(block_out_channels=(32, 64), layers_per_block=1, in_channels=4,
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                cross_attention_dim=D, conditioning_embedding_out_channels=(8, 8, 8, 8),
                                norm_num_groups=32,
                                **extra).eval(), seed=seed + 1)


def _vae(blocks=(8, 8, 8, 8), latent: int = 4, **extra):
    from diffusers import AutoencoderKL

    torch.manual_seed(1)
    return AutoencoderKL(block_out_channels=blocks, down_block_types=("DownEncoderBlock2D",) * len(blocks),
                         up_block_types=("UpDecoderBlock2D",) * len(blocks), latent_channels=latent,
                         norm_num_groups=4, layers_per_block=1, **extra).eval()


def _tiny_vae():
    from diffusers import AutoencoderTiny

    torch.manual_seed(1)
    return AutoencoderTiny(encoder_block_out_channels=(8, 8, 8, 8),
                           decoder_block_out_channels=(8, 8, 8, 8)).eval()


def _ddim():
    from diffusers import DDIMScheduler

    return DDIMScheduler(clip_sample=False, steps_offset=1)


def _sd_kwargs(unet, vae):
    return dict(vae=vae, text_encoder=None, tokenizer=None, unet=unet, scheduler=_ddim(), safety_checker=None,
                feature_extractor=None, requires_safety_checker=False)


def _embeds(n: int = 5, width: int = D, seed: int = 7):
    g = _g(seed)
    return torch.randn(1, n, width, generator=g), torch.randn(1, n, width, generator=g)


def _image(h: int, w: int, seed: int = 3):
    """A (1, 3, h, w) image in [0, 1] with structure (a ramp plus noise)."""
    ramp = torch.linspace(0, 1, w).view(1, 1, 1, w).expand(1, 3, h, w)
    return (0.6 * ramp + 0.4 * torch.rand(1, 3, h, w, generator=_g(seed))).clamp(0, 1)


def _ready(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---- builders ------------------------------------------------------------------------------------------

def sd():
    from diffusers import StableDiffusionPipeline

    return _ready(StableDiffusionPipeline(**_sd_kwargs(_unet(), _vae())))


def sd_img2img():
    from diffusers import StableDiffusionImg2ImgPipeline

    return _ready(StableDiffusionImg2ImgPipeline(**_sd_kwargs(_unet(), _vae())))


def sd_inpaint():
    from diffusers import StableDiffusionInpaintPipeline

    return _ready(StableDiffusionInpaintPipeline(**_sd_kwargs(_unet(in_channels=9), _vae())))


def sd_tiny_vae():
    from diffusers import StableDiffusionPipeline

    return _ready(StableDiffusionPipeline(**_sd_kwargs(_unet(), _tiny_vae())))


def _sdxl_kwargs():
    from diffusers import EulerDiscreteScheduler

    return dict(vae=_vae(), text_encoder=None, text_encoder_2=None, tokenizer=None, tokenizer_2=None,
                unet=_unet(sdxl=True), scheduler=EulerDiscreteScheduler())


def sdxl():
    from diffusers import StableDiffusionXLPipeline

    return _ready(StableDiffusionXLPipeline(**_sdxl_kwargs()))


def sdxl_img2img():
    from diffusers import StableDiffusionXLImg2ImgPipeline

    return _ready(StableDiffusionXLImg2ImgPipeline(**_sdxl_kwargs(), requires_aesthetics_score=False))


def sd_controlnet():
    from diffusers import StableDiffusionControlNetPipeline

    return _ready(StableDiffusionControlNetPipeline(**_sd_kwargs(_unet(), _vae()), controlnet=_controlnet()))


def sdxl_controlnet():
    from diffusers import StableDiffusionXLControlNetPipeline

    return _ready(StableDiffusionXLControlNetPipeline(**_sdxl_kwargs(), controlnet=_controlnet(sdxl=True)))


def x4_upscale():
    from diffusers import DDPMScheduler, StableDiffusionUpscalePipeline

    unet = _unet(in_channels=7, num_class_embeds=100)
    return _ready(StableDiffusionUpscalePipeline(
        vae=_vae(blocks=(8, 8, 8), scaling_factor=0.08333), text_encoder=None, tokenizer=None, unet=unet,
        low_res_scheduler=DDPMScheduler(), scheduler=_ddim(), max_noise_level=100))


def sd3():
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, caption_projection_dim=16, joint_attention_dim=D, pooled_projection_dim=D,
        out_channels=16, pos_embed_max_size=32).eval()
    vae = _vae(blocks=(8, 16), latent=16, use_quant_conv=True, use_post_quant_conv=True,
               scaling_factor=1.5305, shift_factor=0.0609)
    nones = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                 text_encoder_3=None, tokenizer_3=None)
    scheduler = FlowMatchEulerDiscreteScheduler()
    return _ready(StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae, **nones))


def flux():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=D,
                                         pooled_projection_dim=D, axes_dims_rope=[4, 4, 8]).eval()
    vae = _vae(blocks=(8, 16), latent=16, use_quant_conv=False, use_post_quant_conv=False,
               scaling_factor=1.5305, shift_factor=0.0609)
    nones = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    return _ready(FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, transformer=transformer,
                               **nones))


# ---- calls ---------------------------------------------------------------------------------------------

def _np(out) -> np.ndarray:
    return np.asarray(out.images, dtype=np.float32)


def _sd_call(pipe, **kw):
    pe, ne = _embeds()
    dtype = pipe.unet.dtype
    return _np(pipe(prompt_embeds=pe.to(dtype), negative_prompt_embeds=ne.to(dtype), num_inference_steps=2,
                    guidance_scale=2.0, generator=_g(), output_type="np", **kw))


def _sdxl_call(pipe, **kw):
    pe, ne = _embeds()
    pooled, npooled = torch.randn(1, D, generator=_g(8)), torch.randn(1, D, generator=_g(9))
    dtype = pipe.unet.dtype
    return _np(pipe(prompt_embeds=pe.to(dtype), negative_prompt_embeds=ne.to(dtype),
                    pooled_prompt_embeds=pooled.to(dtype), negative_pooled_prompt_embeds=npooled.to(dtype),
                    num_inference_steps=2, guidance_scale=2.0, generator=_g(), output_type="np", **kw))


def run_sd(pipe):
    return _sd_call(pipe, height=64, width=48)


def run_sd_img2img(pipe):
    return _sd_call(pipe, image=_image(64, 48), strength=0.75)


def run_sd_inpaint(pipe):
    mask = torch.zeros(1, 1, 64, 48)
    mask[..., 16:48, 8:40] = 1
    return _sd_call(pipe, image=_image(64, 48), mask_image=mask, height=64, width=48, strength=1.0)


def run_sdxl(pipe):
    return _sdxl_call(pipe, height=64, width=48)


def run_sdxl_img2img(pipe):
    return _sdxl_call(pipe, image=_image(64, 48), strength=0.75)


def run_sd_controlnet(pipe):
    return _sd_call(pipe, image=_image(64, 48, seed=5), height=64, width=48)


def run_sdxl_controlnet(pipe):
    return _sdxl_call(pipe, image=_image(64, 48, seed=5), height=64, width=48)


def run_x4_upscale(pipe):
    return _sd_call(pipe, image=_image(16, 12))


def _flow_call(pipe, n_text: int, **kw):
    dtype = pipe.transformer.dtype
    pe, _ = _embeds(n=n_text)
    pooled = torch.randn(1, D, generator=_g(8))
    return _np(pipe(prompt_embeds=pe.to(dtype), pooled_prompt_embeds=pooled.to(dtype), num_inference_steps=2,
                    generator=_g(), output_type="np", height=32, width=48, **kw))


def run_sd3(pipe):
    pe, ne = _embeds()
    dtype = pipe.transformer.dtype
    pooled, npooled = torch.randn(1, D, generator=_g(8)), torch.randn(1, D, generator=_g(9))
    return _np(pipe(prompt_embeds=pe.to(dtype), negative_prompt_embeds=ne.to(dtype),
                    pooled_prompt_embeds=pooled.to(dtype), negative_pooled_prompt_embeds=npooled.to(dtype),
                    num_inference_steps=2, guidance_scale=2.0, generator=_g(), output_type="np", height=32,
                    width=48))


def run_flux(pipe):
    return _flow_call(pipe, n_text=5, guidance_scale=3.5)


CASES = {
    "sd": (sd, run_sd, "unet"),
    "sd_img2img": (sd_img2img, run_sd_img2img, "unet"),
    "sd_inpaint": (sd_inpaint, run_sd_inpaint, "unet"),
    "sdxl": (sdxl, run_sdxl, "unet"),
    "sdxl_img2img": (sdxl_img2img, run_sdxl_img2img, "unet"),
    "sd_controlnet": (sd_controlnet, run_sd_controlnet, "unet"),
    "sdxl_controlnet": (sdxl_controlnet, run_sdxl_controlnet, "unet"),
    "x4_upscale": (x4_upscale, run_x4_upscale, "unet"),
    "sd3": (sd3, run_sd3, "transformer"),
    "flux": (flux, run_flux, "transformer"),
    "sd_tiny_vae": (sd_tiny_vae, run_sd, "unet"),
}
