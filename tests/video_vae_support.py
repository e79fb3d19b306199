"""Small seeded 3-D causal VAEs (Qwen-Image, Wan 2.1 / 2.2, LTX-Video 0.9.0 / 0.9.5, LTX-2, the HunyuanImage
refiner, HunyuanVideo, HunyuanVideo 1.5, Mochi, Cosmos, Magvit) for the video tests.

Real diffusers classes from tiny configs (few channels, one layer per block) with seeded random weights;
the RMS norms' gains are randomised so a wrong normalisation cannot hide. No tests here.
"""

from __future__ import annotations


def _gains(vae, seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return vae.eval()


def latent(frames: int, h: int, w: int, seed: int = 0, batch: int = 1, channels: int = 4):
    """A seeded (batch, channels, frames, h, w) Gaussian latent."""
    import torch

    return torch.randn(batch, channels, frames, h, w, generator=torch.Generator().manual_seed(seed))


def video(frames: int, h: int, w: int, seed: int = 0):
    """A seeded (1, 3, frames, h, w) video, uniform in [-1, 1]."""
    import torch

    return torch.rand(1, 3, frames, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def same_gradients(vae, tv, inp, params, loss, tol: float = 1e-4):
    """The gradients of `loss(m, inp)` for inp and `params`, through the stock `vae` and the TiledVAE `tv`,
    each within tol of its scale: its max abs, floored at 1e-3 of the largest parameter gradient's (as
    tests/test_vae_gradients.py: an attention key projection's gradient is near zero, softmax being shift
    invariant, and the float noise of a sum over many tiles there has no scale of its own)."""
    import torch

    grads = []
    for m in (vae, tv):
        t = inp.clone().requires_grad_(True)
        grads.append(torch.autograd.grad(loss(m, t), [t, *params]))
    floor = 1e-3 * max(float(w.abs().max()) for w in grads[0][1:])
    for a, b in zip(*grads, strict=True):
        assert (a - b).abs().max() <= tol * max(float(b.abs().max()), floor)


def wan(version: str = "2.1", seed: int = 0):
    """AutoencoderKLWan: 8x spatial / 4x temporal (2.1), or 2.2's 16x with patchify and residual blocks."""
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    kw = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
              temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    if version == "2.2":
        kw.update(decoder_base_dim=8, is_residual=True, patch_size=2, in_channels=12, out_channels=12,
                  scale_factor_spatial=16)
    return _gains(AutoencoderKLWan(**kw))


def qwen(seed: int = 0):
    """AutoencoderKLQwenImage (8x spatial, 4x temporal)."""
    import torch
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    return _gains(AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                         temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                                         latents_std=[1.0] * 4))


def qwen21(seed: int = 0):
    """AutoencoderKLQwenImage21 (an image VAE in a video's layout; RGBA as its pipeline gives it, 4x spatial
    here), Wan 2.2-like residual blocks with AvgDown3D / DupUp3D shortcuts."""
    import torch
    from diffusers import AutoencoderKLQwenImage21

    torch.manual_seed(seed)
    return _gains(AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 2, 2],
                                           num_res_blocks=1, temperal_downsample=[False, True],
                                           latents_mean=[0.1, -0.2, 0.3, 0.0],
                                           latents_std=[1.5, 0.5, 2.0, 1.0],
                                           in_channels=4, out_channels=4, scale_factor_spatial=4))


def ltx(version: str = "0.9.0", seed: int = 0, timestep: bool = False):
    """AutoencoderKLLTXVideo: 0.9.0 blocks (8x spatial, 4x temporal here), or 0.9.5's down blocks and
    residual upsamplers (16x, 8x); `timestep`: its decoder conditioned on the decode timestep (0.9.5+)."""
    import torch
    from diffusers import AutoencoderKLLTXVideo

    torch.manual_seed(seed)
    kw = dict(in_channels=3, out_channels=3, latent_channels=4, patch_size=2, patch_size_t=1)
    if version == "0.9.0":
        kw.update(block_out_channels=(8, 8, 16, 16), decoder_block_out_channels=(8, 8, 16, 16),
                  layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
                  spatio_temporal_scaling=(True, True, False, False),
                  decoder_spatio_temporal_scaling=(True, True, False, False),
                  decoder_inject_noise=(False,) * 5)
    else:
        kw.update(block_out_channels=(4, 8, 16, 16, 16), down_block_types=("LTXVideo095DownBlock3D",) * 4,
                  decoder_block_out_channels=(8, 16, 32), layers_per_block=(1, 1, 1, 1, 1),
                  decoder_layers_per_block=(1, 1, 1, 1), spatio_temporal_scaling=(True,) * 4,
                  decoder_spatio_temporal_scaling=(True,) * 3, decoder_inject_noise=(False,) * 4,
                  downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
                  upsample_residual=(True,) * 3, upsample_factor=(2, 2, 2), spatial_compression_ratio=16,
                  temporal_compression_ratio=8, timestep_conditioning=timestep)
    return AutoencoderKLLTXVideo(**kw).eval()


def ltx2(seed: int = 0, timestep: bool = False, **config):
    """AutoencoderKLLTX2Video: 0.9.5-like blocks with per-channel RMS norms, the decoder's reflect padding
    in space (16x spatial, 8x temporal here); `timestep`: its decoder conditioned on the decode timestep;
    `config` overrides (its compression ratio properties say 32x / 16x unless given)."""
    import torch
    from diffusers import AutoencoderKLLTX2Video

    torch.manual_seed(seed)
    return AutoencoderKLLTX2Video(latent_channels=4, block_out_channels=(8, 16, 16, 16),
                                  decoder_block_out_channels=(8, 16, 32), layers_per_block=(1, 1, 1, 1, 1),
                                  decoder_layers_per_block=(1, 1, 1, 1), patch_size=2,
                                  timestep_conditioning=timestep, **config).eval()


def refiner(seed: int = 0):
    """AutoencoderKLHunyuanImageRefiner (HunyuanImage 2.1's refiner: 16x spatial, causal in time)."""
    import torch
    from diffusers import AutoencoderKLHunyuanImageRefiner

    torch.manual_seed(seed)
    return AutoencoderKLHunyuanImageRefiner(latent_channels=4, block_out_channels=(8, 8, 16, 16, 16),
                                            layers_per_block=1).eval()


def _group_norms(vae, seed: int):
    """The VAE with its GroupNorms' weights and biases randomised (so a wrong statistic cannot hide)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in vae.modules():
            if isinstance(m, torch.nn.GroupNorm):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
    return vae.eval()


def hunyuan(seed: int = 0):
    """AutoencoderKLHunyuanVideo (8x spatial, 4x temporal here): GroupNorms over frames x space, the
    mid-block's attention over every frame's tokens with a causal mask between frames; its norms'
    weights and biases randomised."""
    import torch
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanVideo(latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
                                    up_block_types=("HunyuanVideoUpBlock3D",) * 4,
                                    block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4)
    return _group_norms(vae, seed + 1)


def mochi(seed: int = 0, **config):
    """AutoencoderKLMochi (8x spatial, 6x temporal; 32 channels: its GroupNorms have 32 groups): GroupNorms
    of each frame (the frames folded into the batch, in chunks of 8), the encoder's Fourier features and
    attention over each position's frames; its norms' weights and biases randomised; `config` overrides."""
    import torch
    from diffusers import AutoencoderKLMochi

    torch.manual_seed(seed)
    vae = AutoencoderKLMochi(latent_channels=4, encoder_block_out_channels=(32,) * 4,
                             decoder_block_out_channels=(32,) * 4, layers_per_block=(1, 1, 1, 1, 1),
                             **config)
    return _group_norms(vae, seed + 1)


def cosmos(seed: int = 0):
    """AutoencoderKLCosmos (8x spatial, 8x temporal: its haar wavelet patcher of 4 and one resampling):
    GroupNorms of each frame, attention over each frame's tokens and causal attention over each position's
    frames in its mid blocks and the blocks at resolution 8; its norms' weights and biases randomised."""
    import torch
    from diffusers import AutoencoderKLCosmos

    torch.manual_seed(seed)
    vae = AutoencoderKLCosmos(latent_channels=4, encoder_block_out_channels=(8, 16, 16, 16),
                              decode_block_out_channels=(8, 16, 16, 16), num_layers=1, resolution=64,
                              attention_resolutions=(8,))
    return _group_norms(vae, seed + 1)


def hunyuan15():
    """AutoencoderKLHunyuanVideo15 (`tiny_denoisers.hunyuan15_vae`: 8x spatial, 4x temporal): RMS norms over
    the channels, its samplers' channel / frame / space rearrangements with the first frame apart and
    channel-repeat (or channel-mean) shortcuts, the mid-block's attention over every token with a causal
    mask between frames; its RMS norms' gains randomised."""
    from tiny_denoisers import hunyuan15_vae

    return _gains(hunyuan15_vae())


def magvit(seed: int = 0, spatial_group_norm: bool = True):
    """AutoencoderKLMagvit (EasyAnimate; 8x spatial, 4x temporal): causal convolutions looping over their
    windows of frames, GroupNorms of each frame, its decode / encode a chunked loop with the convolutions'
    caches; its GroupNorms' weights and biases randomised."""
    import torch
    from diffusers import AutoencoderKLMagvit

    torch.manual_seed(seed)
    vae = AutoencoderKLMagvit(
        latent_channels=4, block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=4,
        down_block_types=("SpatialDownBlock3D",) + ("SpatialTemporalDownBlock3D",) * 3,
        up_block_types=("SpatialUpBlock3D",) + ("SpatialTemporalUpBlock3D",) * 3,
        spatial_group_norm=spatial_group_norm)
    return _group_norms(vae, seed + 1)


VAES = {"qwen": qwen, "magvit": magvit, "mochi": mochi, "cosmos": cosmos, "hunyuan15": hunyuan15,
        "hunyuan": hunyuan, "wan2.1": lambda: wan("2.1"), "wan2.2": lambda: wan("2.2"),
        "ltx0.9.0": lambda: ltx("0.9.0"), "ltx0.9.5": lambda: ltx("0.9.5"), "ltx2": ltx2, "refiner": refiner,
        "ltx0.9.5-t": lambda: ltx("0.9.5", timestep=True), "ltx2-t": lambda: ltx2(timestep=True)}

_CACHE: dict = {}


def video_vae(name: str):
    """A shared instance per name (built once per test session: the tests never change it)."""
    if name not in _CACHE:
        _CACHE[name] = VAES[name]()
    return _CACHE[name]


def factor(vae) -> int:
    """Image pixels per latent pixel."""
    return int(vae.spatial_compression_ratio)


def cogvideox_vae():
    """A tiny seeded CogVideoX VAE (4 blocks: 8x in space, 4x in time; its chunked loop of 2 latent frames
    a decode call and 8 video frames an encode call)."""
    import diffusers as d
    import torch

    torch.manual_seed(0)
    return d.AutoencoderKLCogVideoX(
        down_block_types=("CogVideoXDownBlock3D",) * 4, up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 16, 16), latent_channels=4, layers_per_block=1, norm_num_groups=4).eval()


def refused_family(name: str):
    """Tiny seeded video VAEs of configurations TiledVAE refuses (what they compute cannot be tiled
    exactly yet): CogVideoX with calls of odd latent frames (each resamples its first frame apart)."""
    vae = cogvideox_vae()
    if name == "cogvideox-odd-calls":
        vae.num_latent_frames_batch_size = 3
    return vae


def kvae_video():
    """A tiny seeded KVAE video VAE (8x in space, 4x in time; its GroupNorms take 32 groups, so 32 and 64
    channels): every block type, its cached causal convolutions, spatial norms of the latent, resnets with
    a 1x1 shortcut, downsamplers and upsamplers in space and time and in space only; its decode a loop of
    5 then 4 latent frames a call, encode of 17 then 16 video frames."""
    import diffusers as d
    import torch

    torch.manual_seed(0)
    return d.AutoencoderKLKVAEVideo(ch=32, ch_mult=(1, 1, 2, 2), num_res_blocks=1, z_channels=4).eval()


def kandinsky6_sr(seed: int = 0):
    """A tiny seeded Kandinsky 6 SR VAE (8x in space, 4x in time): its cached causal convolutions, RMS
    norms (gains randomised), spatial norms of the latent, resnets with a 1x1 shortcut, downsamplers and
    upsamplers in space and time and in space only; its decode / encode a loop over 16-frame segments."""
    import diffusers as d
    import torch

    torch.manual_seed(seed)
    return _gains(d.Kandinsky6SRVAE(latent_channels=4, encoder_block_out_channels=(8, 16, 16, 32),
                                    decoder_block_out_channels=(8, 16, 16, 32), layers_per_block=1))


def vidtok(seed: int = 0, **config):
    """A tiny seeded VidTok VAE (4x in space, 4x in time, causal; `config` overrides: regularizer="fsq",
    is_causal=False, ...): its resnets' 2-D and 1-D halves, LayerNorms over the channels (their weights
    and biases randomised so a wrong normalisation cannot hide), temporal samplers mixing a pooled /
    interpolated path and a convolution (their mix factors randomised) and a mid-block attention."""
    import diffusers as d
    import torch

    torch.manual_seed(seed)
    kw = dict(ch=8, ch_mult=[1, 2, 2], z_channels=4, num_res_blocks=1)
    if config.get("regularizer") == "fsq":
        kw.update(codebook_size=8**4, double_z=False)
    vae = d.AutoencoderVidTok(**{**kw, **config})
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.bias") or name.endswith("mix_factor"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return vae.eval()


def allegro(seed: int = 0, blocks: int = 2):
    """A tiny seeded Allegro VAE (AutoencoderKLAllegro; `blocks` 2: 2x in space, 4x in time, both blocks
    resampling in time; 4: its default layout, 8x in space, 4x in time): 2-D resnets on the frames in the
    batch, temporal convolutions with their edge frames repeated, GroupNorms over every frame, a mid-block
    attention over each frame's tokens; its GroupNorms' weights and biases randomised."""
    import torch
    from diffusers import AutoencoderKLAllegro

    torch.manual_seed(seed)
    kw = dict(block_out_channels=(8, 16), temporal_downsample_blocks=(True, True),
              temporal_upsample_blocks=(True, True), down_block_types=("AllegroDownBlock3D",) * 2,
              up_block_types=("AllegroUpBlock3D",) * 2) if blocks == 2 else \
        dict(block_out_channels=(8, 16, 16, 16))
    vae = AutoencoderKLAllegro(latent_channels=4, layers_per_block=1, norm_num_groups=4, sample_size=32, **kw)
    return _group_norms(vae, seed + 1)


def svd():
    """A tiny seeded SVD VAE: two blocks of 32 channels (its GroupNorms have 32 groups), two layers a block
    (the mid-block's attention, one head, runs between its two resnets only); its AlphaBlenders'
    mix_factor (0 at init) set apart per block, so the temporal and spatial paths both count and differ
    block by block; time_conv_out's weights perturbed (it mixes neighbouring frames more)."""
    import diffusers as d
    import torch

    torch.manual_seed(0)
    vae = d.AutoencoderKLTemporalDecoder(block_out_channels=(32, 32), latent_channels=4, layers_per_block=2,
                                         down_block_types=("DownEncoderBlock2D",) * 2).eval()
    with torch.no_grad():
        blenders = [m for m in vae.modules() if hasattr(m, "mix_factor")]
        for k, m in enumerate(blenders):
            m.mix_factor.fill_(0.4 * k - 0.7)
        vae.decoder.time_conv_out.weight.add_(torch.randn_like(vae.decoder.time_conv_out.weight) * 0.3)
    return vae
