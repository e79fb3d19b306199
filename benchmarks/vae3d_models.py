"""The seeded video VAEs of `benchmarks/vae3d.py`, their inputs, their own tiling and how each is called.

--family (seeded random weights, fp32; widths scaled by --base-dim, one layer per block except Wan):
- wan / qwen: AutoencoderKLWan with Wan 2.1's layout (dim_mult 1,2,4,4, num_res_blocks 2, z_dim 16, 4x
  temporal, 8x spatial) / AutoencoderKLQwenImage (the same layout) at base width --base-dim (Wan 2.1: 96);
- ltx: AutoencoderKLLTXVideo with LTX-Video 0.9.0's blocks (latent 128 channels, patch 4: 32x spatial,
  8x temporal) at --base-dim / 96 of its widths (128, 256, 512, 512);
- ltx2: AutoencoderKLLTX2Video with LTX-2's blocks (latent 128, 32x spatial, 8x temporal) at --base-dim /
  256 of its widths (256, 512, 1024, 2048; decoder 256, 512, 1024);
- hunyuan: AutoencoderKLHunyuanVideo (latent 16, 8x spatial, 4x temporal, GroupNorms of 32 groups,
  mid-block attention over every frame) at --base-dim / 128 of its widths (128, 256, 512, 512); untiled
  in one pass (use_framewise_decoding / _encoding = False: its stock default goes framewise, a blended
  temporal tiling, past 4 latent / 16 video frames), which is what tilewise computes;
- mochi: AutoencoderKLMochi (latent 12, 8x spatial, 6x temporal) at --base-dim / 128 of its widths (128,
  256, 512, 768, multiples of 32);
- cosmos: AutoencoderKLCosmos (latent 16, 8x spatial, 8x temporal, its haar wavelet patcher) at --base-dim /
  128 of its widths (128, 256, 512, 512); no spatial tiling of its own (enable_tiling sets a flag its
  decode never reads), so no 'diffusers' variant;
- hunyuan15: AutoencoderKLHunyuanVideo15 (latent 32, 16x spatial, 4x temporal, RMS norms, mid-block
  attention over every token with a causal mask between frames) at --base-dim / 128 of its widths (128,
  256, 512, 1024, 1024);
- magvit: AutoencoderKLMagvit (EasyAnimate; latent 16, 8x spatial, 4x temporal, GroupNorms of each frame)
  at --base-dim / 128 of its widths (128, 256, 512, 512);
- cogvideox: AutoencoderKLCogVideoX (latent 16, 8x spatial, 4x temporal, its chunked loop of 2 latent
  frames a decode call) at --base-dim / 128 of its widths (128, 256, 256, 512);
- svd: AutoencoderKLTemporalDecoder (SVD; latent 4, 8x spatial, no temporal compression: its decode
  takes the frames in the batch, decode(z, num_frames)) at --base-dim / 128 of its widths (128, 256, 512,
  512); no spatial tiling of its own, so no 'diffusers' variant;
- kvae: AutoencoderKLKVAEVideo (latent 16, 8x spatial, 4x temporal, its chunked loop of 5 then 4 latent
  frames a decode call, GroupNorms over each call's frames) at --base-dim / 128 of its width (ch 128,
  ch_mult 1, 2, 4, 8); no spatial tiling of its own (use_tiling is a flag its decode never reads);
- k6sr: Kandinsky6SRVAE (latent 64, 16x spatial, 4x temporal, RMS norms, cached causal convolutions) at
  --base-dim / 128 of its widths (encoder 16, 128, 256, 512, 1024; decoder 16, 256, 512, 1024, 2048); no
  spatial tiling of its own;
- vidtok: AutoencoderVidTok (causal, KL; latent 4, 8x spatial, 4x temporal, LayerNorms over the channels,
  its resnets' 1-D halves along time) at --base-dim / 128 of its width (ch 128, ch_mult 1, 2, 4, 4); its
  own tiling overlaps 1/4 of a tile (its default overlap is 0: tiles side by side, unblended).
- allegro: AutoencoderKLAllegro (latent 4, 8x spatial, 4x temporal, GroupNorms over every frame, mid-block
  attention over each frame's tokens) at --base-dim / 128 of its widths (128, 256, 512, 512); its own
  decode / encode run only through its tiling, so untiled is the one pass that tiling approximates
  (`tilewise.vae.video_allegro`), and its 'diffusers' row its own cubes (vae.kernel / vae.stride set by
  hand: the whole video in time, tiles of --tile latent px every 3/4 of a tile in space, which must cover
  the side exactly: --latent = tile + k stride); it encodes 4 k frames (4 --frames).
"""

from __future__ import annotations

# family -> (class name, latent channels, temporal compression, spatial compression)
FAMILIES = {"wan": ("AutoencoderKLWan", 16, 4, 8), "qwen": ("AutoencoderKLQwenImage", 16, 4, 8),
            "ltx": ("AutoencoderKLLTXVideo", 128, 8, 32), "ltx2": ("AutoencoderKLLTX2Video", 128, 8, 32),
            "hunyuan": ("AutoencoderKLHunyuanVideo", 16, 4, 8), "mochi": ("AutoencoderKLMochi", 12, 6, 8),
            "cosmos": ("AutoencoderKLCosmos", 16, 8, 8),
            "hunyuan15": ("AutoencoderKLHunyuanVideo15", 32, 4, 16),
            "magvit": ("AutoencoderKLMagvit", 16, 4, 8), "cogvideox": ("AutoencoderKLCogVideoX", 16, 4, 8),
            "svd": ("AutoencoderKLTemporalDecoder", 4, 1, 8), "kvae": ("AutoencoderKLKVAEVideo", 16, 4, 8),
            "k6sr": ("Kandinsky6SRVAE", 64, 4, 16), "vidtok": ("AutoencoderVidTok", 4, 4, 8),
            "allegro": ("AutoencoderKLAllegro", 4, 4, 8)}
# families whose stock VAE has no spatial tiling of its own to compare with (Cosmos' enable_tiling sets
# use_tiling, which its _decode never reads; SVD's temporal decoder, KVAE video's and Kandinsky 6 SR's have
# none)
NO_OWN_TILING = ("cosmos", "svd", "kvae", "k6sr")


def _widths(base_dim: int, full: tuple[int, ...], least: int = 32) -> tuple[int, ...]:
    """A family's widths at base_dim / 128 of `full`, multiples of 32 (GroupNorms of 32 groups)."""
    return tuple(max(least, c * base_dim // 128 // 32 * 32) for c in full)


def build_vae(family: str, base_dim: int):
    """The seeded VAE of a family (module docstring)."""
    import diffusers
    import torch

    torch.manual_seed(0)
    cls = getattr(diffusers, FAMILIES[family][0])
    if family == "ltx":
        widths = tuple(max(8, c * base_dim // 96) for c in (128, 256, 512, 512))
        return cls(block_out_channels=widths, decoder_block_out_channels=widths,
                   layers_per_block=(1,) * 5, decoder_layers_per_block=(1,) * 5).eval()
    if family == "ltx2":
        widths = tuple(max(16, c * base_dim // 256) for c in (256, 512, 1024, 2048))
        return cls(block_out_channels=widths, decoder_block_out_channels=widths[:3],  # (its ratios given:
                   layers_per_block=(1,) * 5, decoder_layers_per_block=(1,) * 4,  # derived, they count a
                   spatial_compression_ratio=32, temporal_compression_ratio=8).eval()  # time-only step)
    if family == "hunyuan":
        widths = tuple(max(32, c * base_dim // 128) for c in (128, 256, 512, 512))
        return cls(block_out_channels=widths, layers_per_block=1).eval()
    if family == "mochi":  # (its GroupNorms have 32 groups: widths a multiple of 32)
        widths = _widths(base_dim, (128, 256, 512, 768))
        return cls(encoder_block_out_channels=widths, decoder_block_out_channels=widths,
                   layers_per_block=(1,) * 5).eval()
    if family == "cosmos":  # (attention at latent resolution: its mid blocks and the last level)
        widths = tuple(max(16, c * base_dim // 128) for c in (128, 256, 512, 512))
        return cls(encoder_block_out_channels=widths, decode_block_out_channels=widths, num_layers=1).eval()
    return _build_more(family, cls, base_dim)


def _build_more(family: str, cls, base_dim: int):
    """The families added for #28's second table (HunyuanVideo 1.5, Magvit, CogVideoX, SVD, KVAE video,
    Kandinsky 6 SR), and Wan / Qwen-Image."""
    if family == "hunyuan15":
        widths = _widths(base_dim, (128, 256, 512, 1024, 1024))
        return cls(block_out_channels=widths, layers_per_block=1).eval()
    if family == "magvit":
        return cls(block_out_channels=_widths(base_dim, (128, 256, 512, 512)), layers_per_block=1).eval()
    if family == "cogvideox":
        return cls(block_out_channels=_widths(base_dim, (128, 256, 256, 512)), layers_per_block=1).eval()
    if family == "svd":
        return cls(block_out_channels=_widths(base_dim, (128, 256, 512, 512)), layers_per_block=1,
                   down_block_types=("DownEncoderBlock2D",) * 4).eval()
    if family == "kvae":
        return cls(ch=max(32, base_dim // 32 * 32), ch_mult=(1, 2, 4, 8), num_res_blocks=1).eval()
    if family == "k6sr":
        enc, dec = ((max(8, c * base_dim // 128) for c in full)
                    for full in ((16, 128, 256, 512, 1024), (16, 256, 512, 1024, 2048)))
        return cls(encoder_block_out_channels=tuple(enc), decoder_block_out_channels=tuple(dec),
                   layers_per_block=1).eval()
    if family == "vidtok":
        return cls(ch=max(8, base_dim), ch_mult=(1, 2, 4, 4), num_res_blocks=1).eval()
    if family == "allegro":
        return cls(block_out_channels=_widths(base_dim, (128, 256, 512, 512)), layers_per_block=1).eval()
    return cls(base_dim=base_dim, z_dim=16).eval()


def video_frames(family: str, frames: int) -> int:
    """The video frames of `frames` latent frames: 1 + t (frames - 1) (causal), Allegro's t frames (t: the
    family's temporal compression)."""
    tc = FAMILIES[family][2]
    return tc * frames if family == "allegro" else 1 + tc * (frames - 1)


def make_input(family: str, task: str, side: int, frames: int):
    """decode: a seeded randn latent (1, C, frames, side, side); encode: a smooth moving video in [-1, 1]
    of `video_frames` frames of s side px (s: the family's spatial compression)."""
    import torch
    import torch.nn.functional as F

    _, c, _, sc = FAMILIES[family]
    g = torch.Generator().manual_seed(1234)
    if task == "decode":
        return torch.randn(1, c, frames, side, side, generator=g)
    t = video_frames(family, frames)
    coarse = torch.randn(1, 3, 2, 6, 6, generator=g)
    x = F.interpolate(coarse, size=(t, sc * side, sc * side), mode="trilinear") + 0.1 * torch.randn(
        1, 3, t, sc * side, sc * side, generator=g)
    return x.clamp(-1, 1)


def own_tiling(vae, family: str, tile: int, video: tuple[int, int] | None = None) -> None:
    """The family's own spatial tiling (enable_tiling) with tiles of `tile` latent px, stride 3/4 of a
    tile in whole latent px, blended; in time the family's defaults (LTX, HunyuanVideo and Magvit tile
    long videos in time too). `video`: the run's (frames, side px), which Allegro's cubes span / cover."""
    sc = FAMILIES[family][3]
    px, stride = sc * tile, sc * (tile * 3 // 4)  # (a whole latent stride: LTX-2's floors a fractional one)
    if family == "allegro":
        _allegro_cubes(vae, video, px, stride)
    elif family == "hunyuan15":  # (its latent tile is given apart; overlap 1/4: a stride of int(3/4 tile))
        vae.enable_tiling(tile_sample_min_height=px, tile_sample_min_width=px, tile_latent_min_height=tile,
                          tile_latent_min_width=tile, tile_overlap_factor=0.25)
    elif family in ("cogvideox", "vidtok"):  # (overlap factors: a latent stride of int(3/4 tile))
        vae.enable_tiling(tile_sample_min_height=px, tile_sample_min_width=px,
                          tile_overlap_factor_height=0.25, tile_overlap_factor_width=0.25)
    else:
        vae.enable_tiling(tile_sample_min_height=px, tile_sample_min_width=px,
                          tile_sample_stride_height=stride, tile_sample_stride_width=stride)


def _allegro_cubes(vae, video: tuple[int, int], px: int, stride: int) -> None:
    """Allegro's own tiling (vae.kernel / vae.stride, in video frames x px): the video's frames in one cube,
    cubes of px every stride px in space; ValueError where they do not cover its side (its tiled_decode /
    tiled_encode leave the rest zero)."""
    t, side = video
    if side < px or (side - px) % stride:
        raise ValueError(f"Allegro's cubes of {px} px every {stride} px do not cover {side} px: give a side "
                         f"of {px} + k {stride} px")
    vae.kernel, vae.stride = (t, px, px), (t, stride, stride)
    vae.enable_tiling()


def call(model, family: str, task: str, x):
    """Decode (the sample) or encode (the posterior's mode) as the family's VAE takes its video; SVD's
    with its frames in the batch (decode(z, num_frames), each frame encoded as an image), returned as (1,
    C, T, H, W) again; Allegro's decode (frames first) as (1, C, T, H, W), its untiled VAE the one pass;
    VidTok's decode returns the frames tensor."""
    if family == "allegro":
        return _allegro_call(model, task, x)
    if family == "vidtok" and task == "decode":
        return model.decode(x)
    if family != "svd":
        return model.decode(x).sample if task == "decode" else model.encode(x).latent_dist.mode()
    rows = x[0].permute(1, 0, 2, 3)  # (T, C, H, W)
    y = (model.decode(rows, num_frames=rows.shape[0]).sample if task == "decode"
         else model.encode(rows).latent_dist.mode())
    return y.permute(1, 0, 2, 3)[None]


def _allegro_call(model, task: str, x):
    """Allegro's decode / encode (`call`): the bare VAE without its tiling (whose own decode / encode raise)
    the one pass (`video_allegro`); its decode's (B, T, C, H, W) permuted back."""
    from tilewise.vae.video_allegro import allegro_decode, allegro_encode

    if type(model).__name__ == "AutoencoderKLAllegro" and not model.use_tiling:
        return allegro_decode(model, x) if task == "decode" else allegro_encode(model, x).chunk(2, dim=1)[0]
    if task == "encode":
        return model.encode(x).latent_dist.mode()
    return model.decode(x).sample.permute(0, 2, 1, 3, 4)


def plan_shape(family: str, task: str, x) -> tuple[int, ...]:
    """The shape a TiledVAE plans the call on: the (1, C, T, H, W) video; SVD's encode one frame (its 2-D
    encoder, frame by frame)."""
    if family == "svd" and task == "encode":
        return (1, x.shape[1], *x.shape[3:])
    return tuple(x.shape)
