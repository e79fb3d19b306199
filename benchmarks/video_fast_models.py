"""A trained 3-D VAE for benchmarks/video_fast.py: the embedded 2-D VAE inflated into HunyuanVideo's.

AutoencoderKLHunyuanVideo is the SD VAE with causal 3-D convolutions (HunyuanVideoCausalConv3d pads the
past: kt - 1 frames before the first, none after, so a (kt, kh, kw) kernel's last temporal tap reads the
current frame). Every trained 2-D conv kernel (O, I, kh, kw) goes on that tap, zeros on the others; norms,
attention and the quant convs are copied by name. On a video constant in time the inflated decoder is the
2-D decoder on every frame (GroupNorm over frames x space of equal frames is the per-frame GroupNorm, the
causal attention over equal frames is the per-frame attention), up to the border: HunyuanVideo pads
height and width by replicating the edge where the 2-D VAE pads zeros (`pad_mode="constant"` gives the 2-D
borders, for the check). The encoder differs more: HunyuanVideo's downsampling pads 1 px on every side
where the 2-D VAE's pads 1 px right and bottom, so its stride-2 taps sit one pixel earlier.
"""

from __future__ import annotations

import torch


def hunyuan_config(vae2d) -> dict:
    """AutoencoderKLHunyuanVideo's constructor arguments from the 2-D VAE's config (the same names)."""
    c = vae2d.config
    return dict(in_channels=c.in_channels, out_channels=c.out_channels, latent_channels=c.latent_channels,
                block_out_channels=tuple(c.block_out_channels), layers_per_block=c.layers_per_block,
                act_fn=c.act_fn, norm_num_groups=c.norm_num_groups, scaling_factor=c.scaling_factor,
                mid_block_add_attention=c.mid_block_add_attention)


def key_map(vae2d, vae3d) -> dict[str, str]:
    """Every 2-D state_dict key -> its 3-D key: the same name, or the causal conv's inner `.conv.`;
    asserts that the map is one to one and onto."""
    s3 = vae3d.state_dict()
    out = {}
    for k in vae2d.state_dict():
        head, leaf = k.rsplit(".", 1)
        out[k] = k if k in s3 else f"{head}.conv.{leaf}"
        assert out[k] in s3, f"2-D key {k} has no 3-D counterpart ({out[k]} is not in the 3-D state_dict)"
    missing = set(s3) - set(out.values())
    assert len(set(out.values())) == len(out) and not missing, f"3-D keys not mapped: {sorted(missing)}"
    return out


def inflate(w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """A 2-D weight into the 3-D one's shape: a conv kernel (O, I, kh, kw) on the last temporal tap (the
    current frame, HunyuanVideo's causal padding being all in the past), zeros elsewhere; others as is."""
    if w2.shape == w3.shape:
        return w2.clone()
    assert w2.dim() == 4 and w3.dim() == 5 and w3.shape[:2] + w3.shape[3:] == w2.shape, (w2.shape, w3.shape)
    out = torch.zeros_like(w3)
    out[:, :, -1] = w2
    return out


def inflated_hunyuan(vae2d, pad_mode: str | None = None):
    """AutoencoderKLHunyuanVideo with vae2d's trained weights inflated (fp32, eval); `pad_mode`: the causal
    convs' padding mode (None: HunyuanVideo's own, "replicate"). Returns (vae3d, the key map)."""
    from diffusers import AutoencoderKLHunyuanVideo
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import HunyuanVideoCausalConv3d

    vae3d = AutoencoderKLHunyuanVideo(**hunyuan_config(vae2d)).eval()
    names = key_map(vae2d, vae3d)
    s2, s3 = vae2d.state_dict(), vae3d.state_dict()
    vae3d.load_state_dict({names[k]: inflate(w, s3[names[k]]) for k, w in s2.items()}, strict=True)
    taps = {m.conv.kernel_size[0] - 1 - m.time_causal_padding[4] for m in vae3d.modules()
            if isinstance(m, HunyuanVideoCausalConv3d)}
    assert taps == {0}, f"a causal conv pads other than kt - 1 past frames: {taps}"
    if pad_mode is not None:
        for m in vae3d.modules():
            if isinstance(m, HunyuanVideoCausalConv3d):
                m.pad_mode = pad_mode
    return vae3d, names
