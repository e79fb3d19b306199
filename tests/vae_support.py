"""Small seeded diffusers VAEs shared by the locality, executor and TiledVAE tests (no tests here)."""

from __future__ import annotations


def kl_vae(kind: str = "sd", seed: int = 0):
    """A narrow AutoencoderKL shaped like SD 1.x ("sd"), SDXL ("sdxl") or SD3/Flux ("sd3", "flux")."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    blocks = {"sd": (16, 32, 32, 32), "sdxl": (16, 32, 32), "sd3": (16, 32), "flux": (16, 32)}[kind]
    kw = dict(
        block_out_channels=blocks,
        down_block_types=("DownEncoderBlock2D",) * len(blocks),
        up_block_types=("UpDecoderBlock2D",) * len(blocks),
        layers_per_block=1,
        norm_num_groups=8,
        latent_channels=16 if kind in ("sd3", "flux") else 4,
    )
    if kind == "sdxl":
        kw.update(scaling_factor=0.13025, layers_per_block=2)
    if kind in ("sd3", "flux"):
        kw.update(use_quant_conv=kind == "sd3", use_post_quant_conv=kind == "sd3", scaling_factor=1.5305,
                  shift_factor=0.0609)
    vae = AutoencoderKL(**kw).eval()
    _randomize_norms(vae)
    return vae


def tiny_vae(seed: int = 0):
    """A narrow AutoencoderTiny (TAESD layout, 16 channels)."""
    import torch
    from diffusers import AutoencoderTiny

    torch.manual_seed(seed)
    return AutoencoderTiny(encoder_block_out_channels=(16, 16, 16, 16),
                           decoder_block_out_channels=(16, 16, 16, 16)).eval()


def _randomize_norms(module) -> None:
    """Give GroupNorm affine parameters non-trivial values so a wrong statistic cannot hide."""
    import torch

    g = torch.Generator().manual_seed(1)
    for m in module.modules():
        if isinstance(m, torch.nn.GroupNorm) and m.affine:
            with torch.no_grad():
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))


def structured_latent(b: int, c: int, h: int, w: int, seed: int = 0):
    """0.5 randn + 2 x bilinear-upsampled 4x4 randn grid + a horizontal ramp -2..2 (tile means differ)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(b, c, 4, 4, generator=g)
    coarse = F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
    ramp = torch.linspace(-2, 2, w).view(1, 1, 1, w)
    return 0.5 * torch.randn(b, c, h, w, generator=g) + 2 * coarse + ramp


def family_vae(name: str, seed: int = 0):
    """A narrow seeded VAE of one of the 2-D families the traced lowering covers beyond AutoencoderKL:
    "vq" (VQModel, GroupNorm), "movq" (VQModel with MoVQ's spatial norm), "movq64" (the
    same at 64 and 128 channels: two per group of the spatial norm's fixed 32; at 32 channels a per-channel
    bias there has a zero gradient, float noise only), "asym" (AsymmetricAutoencoderKL),
    "flux2" (AutoencoderKLFlux2), "kvae" (AutoencoderKLKVAE), "hunyuan" (AutoencoderKLHunyuanImage),
    "dc" (AutoencoderDC, its linear attention at the latent's resolution only)."""
    import diffusers as d
    import torch

    torch.manual_seed(seed)
    two = dict(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
    build = {
        "vq": lambda: d.VQModel(block_out_channels=(16, 32), layers_per_block=1, latent_channels=4,
                                norm_num_groups=8, num_vq_embeddings=32, vq_embed_dim=4, **two),
        "movq": lambda: d.VQModel(block_out_channels=(32, 64), layers_per_block=1, latent_channels=4,
                                  norm_num_groups=32, num_vq_embeddings=32, vq_embed_dim=4,
                                  norm_type="spatial", **two),
        "movq64": lambda: d.VQModel(block_out_channels=(64, 128), layers_per_block=1, latent_channels=4,
                                    norm_num_groups=32, num_vq_embeddings=32, vq_embed_dim=4,
                                    norm_type="spatial", **two),
        "asym": lambda: d.AsymmetricAutoencoderKL(
            down_block_out_channels=(16, 32), up_block_out_channels=(16, 32), layers_per_down_block=1,
            layers_per_up_block=1, latent_channels=4, norm_num_groups=8, **two),
        "flux2": lambda: d.AutoencoderKLFlux2(block_out_channels=(16, 32), layers_per_block=1,
                                              latent_channels=8, norm_num_groups=8, **two),
        "kvae": lambda: d.AutoencoderKLKVAE(channels=32, num_enc_blocks=1, num_dec_blocks=1, z_channels=4,
                                            ch_mult=(1, 2)),
        "hunyuan": lambda: d.AutoencoderKLHunyuanImage(
            in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(32, 64), layers_per_block=1,
            spatial_compression_ratio=4, sample_size=64),
        "dc": lambda: d.AutoencoderDC(
            latent_channels=8, attention_head_dim=8, encoder_block_types=("ResBlock", "EfficientViTBlock"),
            decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(16, 32),
            decoder_block_out_channels=(16, 32), encoder_layers_per_block=(1, 1),
            decoder_layers_per_block=(1, 1), encoder_qkv_multiscales=((), (5,)),
            decoder_qkv_multiscales=((), (5,))),
    }
    vae = build[name]().eval()
    _randomize_norms(vae)
    return vae
