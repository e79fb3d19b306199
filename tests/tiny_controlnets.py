"""Tiny stock ControlNet and T2I-Adapter pipelines (no download): SD 1.x, SDXL, SD3, Flux (no tests here).

`CASES[name]` = (build() -> pipeline, call keyword arguments, the denoiser's attribute, the keyword
arguments that switch the control off). The ControlNets' zero-initialised layers are filled with seeded
noise (`tiny_pipes.live`), so their residuals change the image. SD / SDXL: 64x48 px (latent 8x6), SD3 and
Flux: 32x32 px (latent 32x32, VAE factor 1); 2 steps, prompt embeddings passed directly.
"""

from __future__ import annotations

import numpy as np
import tiny_pipes as tp
import tiny_transformers as tt
import torch


def _sd(controlnet):
    from diffusers import StableDiffusionControlNetPipeline

    return tp._ready(StableDiffusionControlNetPipeline(**tp._sd_kwargs(tp._unet(), tp._vae()),
                                                       controlnet=controlnet))


def sd():
    return _sd(tp._controlnet())


def sd_multi():
    return _sd([tp._controlnet(), tp._controlnet(seed=5)])


def sdxl():
    return tp.sdxl_controlnet()


def t2i():
    """SD with a full T2I-Adapter: a UNet whose blocks take the adapter's two feature maps (latent, 1/2)."""
    from diffusers import StableDiffusionAdapterPipeline, T2IAdapter, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=1, sample_size=16,
                                in_channels=4, out_channels=4,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=tp.D,
                                norm_num_groups=32).eval()
    torch.manual_seed(4)
    adapter = T2IAdapter(in_channels=3, channels=[32, 64], num_res_blocks=1, downscale_factor=8,
                         adapter_type="full_adapter").eval()
    return tp._ready(StableDiffusionAdapterPipeline(adapter=adapter, **tp._sd_kwargs(unet, tp._vae())))


def sd3():
    """SD3 with a two-block transformer (the last block takes no ControlNet residual) and a ControlNet."""
    from diffusers import SD3ControlNetModel, SD3Transformer2DModel, StableDiffusion3ControlNetPipeline

    pipe, _ = tt.sd3()
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4,
                                        num_layers=2, attention_head_dim=8, num_attention_heads=2,
                                        caption_projection_dim=16, joint_attention_dim=tt.D,
                                        pooled_projection_dim=tt.POOLED,
                                        pos_embed_max_size=24).eval()
    torch.manual_seed(5)
    controlnet = SD3ControlNetModel(sample_size=16, patch_size=2, in_channels=4, num_layers=1,
                                    attention_head_dim=8, num_attention_heads=2, joint_attention_dim=tt.D,
                                    caption_projection_dim=16, pooled_projection_dim=tt.POOLED,
                                    out_channels=4, pos_embed_max_size=24).eval()
    parts = dict(pipe.components, transformer=transformer)
    return tp._ready(StableDiffusion3ControlNetPipeline(controlnet=tp.live(controlnet, seed=6), **parts))


def flux():
    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    pipe, _ = tt.flux()
    torch.manual_seed(5)
    controlnet = FluxControlNetModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                     attention_head_dim=16, num_attention_heads=2, joint_attention_dim=tt.D,
                                     pooled_projection_dim=tt.POOLED, axes_dims_rope=(4, 6, 6)).eval()
    return tp._ready(FluxControlNetPipeline(controlnet=tp.live(controlnet, seed=6), **pipe.components))


def _sd_kw(**kw):
    pe, ne = tp._embeds()
    return {"prompt_embeds": pe, "negative_prompt_embeds": ne, "num_inference_steps": 2,
            "guidance_scale": 2.0, "height": 64, "width": 48, "image": tp._image(64, 48, seed=5), **kw}


def _sdxl_kw(**kw):
    pooled, npooled = torch.randn(1, tp.D, generator=tp._g(8)), torch.randn(1, tp.D, generator=tp._g(9))
    return _sd_kw(pooled_prompt_embeds=pooled, negative_pooled_prompt_embeds=npooled, **kw)


def _flow_kw(name: str, **kw):
    pe, pp = tt.embeds()
    if name == "sd3":
        ne, npool = tt.embeds(seed=8)
        kw.update(negative_prompt_embeds=ne, negative_pooled_prompt_embeds=npool)
    return dict(prompt_embeds=pe, pooled_prompt_embeds=pp, control_image=tt.image(), num_inference_steps=2,
                height=32, width=32, **kw)


OFF = dict(controlnet_conditioning_scale=0.0)
CASES = {
    "sd": (sd, _sd_kw(), "unet", OFF),
    "sd-guess-mode": (sd, _sd_kw(guess_mode=True), "unet", OFF),
    "sd-scale-start-end": (sd, _sd_kw(controlnet_conditioning_scale=0.6, control_guidance_end=0.5), "unet",
                           OFF),
    "sd-multi": (sd_multi, _sd_kw(image=[tp._image(64, 48, seed=5), tp._image(64, 48, seed=6)],
                                  controlnet_conditioning_scale=[1.0, 0.5]), "unet",
                 dict(controlnet_conditioning_scale=[0.0, 0.0])),
    "sdxl": (sdxl, _sdxl_kw(), "unet", OFF),
    "sdxl-guess-mode": (sdxl, _sdxl_kw(guess_mode=True), "unet", OFF),
    "sd3": (sd3, _flow_kw("sd3", guidance_scale=2.0), "transformer", OFF),
    "flux": (flux, _flow_kw("flux", guidance_scale=3.5), "transformer", OFF),
    "t2i-adapter": (t2i, _sd_kw(), "unet", dict(adapter_conditioning_scale=0.0)),
}


def run(pipe, kw: dict, **extra) -> np.ndarray:
    """The pipeline's image (np); the global seed is set because SD3's pipeline samples its control latent
    from the VAE without a generator."""
    torch.manual_seed(0)
    with torch.no_grad():
        out = pipe(**{**kw, **extra}, generator=tp._g(), output_type="np")
    return np.asarray(out.images, dtype=np.float32)
