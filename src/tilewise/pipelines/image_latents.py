"""The latents files of the image VAEs (`decode` / `encode` with a 2-D VAE): per family, what the VAE's
decode takes ("raw") and the `latents` tensor of a .safetensors file, as the family's stock pipeline
hands latents to its denoiser (unpacked from its tokens, where it packs them).

- AutoencoderKL, AutoencoderTiny, AsymmetricAutoencoderKL, AutoencoderDC (Sana), VQModel (LDM),
  AutoencoderKLKVAE, AutoencoderKLHunyuanImage: z = (raw - shift_factor) * scaling_factor, (1, C, h, w),
  each factor where the VAE's config names it (else 1 and 0). VQModel's decode quantises z / sf as
  LDMPipeline's does (VQModel.decode's default).
- AutoencoderKLFlux2: the raw latent patchified 2x2 and normalised with the VAE's batch-norm running
  statistics, z = (patchify(raw) - running_mean) / sqrt(running_var + batch_norm_eps), (1, 4C, h/2, w/2),
  as Flux2Pipeline._encode_vae_image returns it and its decode step takes it (its tokens unpacked).
- AutoencoderKLQwenImage21: z = (raw - latents_mean) / latents_std per channel, (1, C, 1, h, w), as
  QwenImage21Pipeline's (the layout of Qwen-Image's 3-D latents files; (C, 1, h, w) is read too).

An encode writes the raw latent of its own output class: the posterior's mean (`latent_dist`), DC-AE's
`latent`, VQModel's and AutoencoderTiny's `latents`. torch is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

from ..errors import BadInputFile

PATCHED = ("AutoencoderKLFlux2",)  # latents files patchified 2x2 and batch-norm normalised
FRAMED = ("AutoencoderKLQwenImage21",)  # latents files (1, C, 1, h, w), normalised by mean and std


def _name(vae) -> str:
    return type(vae).__name__


def latent_scale(vae) -> tuple[float, float]:
    """(scaling_factor, shift_factor) of a VAE config (SD: 0.18215, 0; SD3/Flux have a shift)."""
    cfg = vae.config
    return float(getattr(cfg, "scaling_factor", 1.0) or 1.0), float(getattr(cfg, "shift_factor", 0.0) or 0.0)


def file_channels(vae) -> int:
    """The channels of a latents file of `vae` (Flux.2: 4 x its latent channels, patchified)."""
    return channels_of(_name(vae), vae.config)


def channels_of(name: str, cfg: dict) -> int | None:
    """The channels of a latents file of VAE class `name` from its config (None: it names none)."""
    c = next((cfg[k] for k in ("latent_channels", "z_channels", "z_dim") if cfg.get(k)), None)
    if not isinstance(c, int):
        return None
    return 4 * c if name in PATCHED else c


def patch(vae) -> int:
    """Latent pixels per latents-file pixel along each side (Flux.2: 2, its 2x2 patches; else 1)."""
    return 2 if _name(vae) in PATCHED else 1


def read(vae, path: str):
    """The latents of file `path` for `vae`, in the file's layout (module docstring), checked as they are
    read (`sources.read_latents`); BadInputFile naming the file otherwise."""
    from ..sources import read_latents

    framed = _name(vae) in FRAMED
    z = read_latents(path, channels=file_channels(vae), video=framed)
    if framed and z.shape[2] != 1:
        raise BadInputFile(f"'latents' in {path!r} has shape {list(z.shape)}: {_name(vae)} codes one image, "
                           "its latents are (1, C, 1, h, w) (T must be 1)")
    return z


def from_file(vae, z) -> Any:
    """A latents file's tensor as the VAE decodes it (raw), on its device and in its dtype."""
    z = z.float()
    name = _name(vae)
    if name in PATCHED:
        mean, std = _bn(vae)
        z = _unpatchify(z * std + mean)
    elif name in FRAMED:
        mean, std = _norm(vae)
        z = z * std + mean
    else:
        sf, shift = latent_scale(vae)
        z = z / sf + shift
    return z.to(vae.device, vae.dtype)


def to_file(vae, raw) -> tuple[Any, dict[str, str]]:
    """An encode's raw latent as its latents file holds it (on the CPU, float32), and the file's metadata
    (how it is normalised: `file_metadata`)."""
    raw = raw.detach().float().cpu()
    name = _name(vae)
    if name in PATCHED:
        mean, std = _bn(vae)
        z = (_patchify(raw) - mean) / std
    elif name in FRAMED:
        mean, std = _norm(vae)
        z = (raw - mean) / std
    else:
        sf, shift = latent_scale(vae)
        z = (raw - shift) * sf
    return z.contiguous(), file_metadata(vae)


def file_metadata(vae) -> dict[str, str]:
    """How a latents file of `vae` is normalised (its metadata; the same for every file of the VAE)."""
    name = _name(vae)
    if name in PATCHED:
        how = "(patchify_2x2(z) - bn.running_mean) / sqrt(bn.running_var + batch_norm_eps)"
    elif name in FRAMED:
        how = "(z - latents_mean) / latents_std"
    else:
        sf, shift = latent_scale(vae)
        return {"normalised": "(z - shift_factor) * scaling_factor", "scaling_factor": str(sf),
                "shift_factor": str(shift), "vae": name}
    return {"normalised": how, "vae": name}


def as_input(vae, x) -> Any:
    """A (1, C, H, W) image as the VAE's encode takes it: (1, C, 1, H, W) for Qwen-Image 2.1."""
    return x.unsqueeze(2) if _name(vae) in FRAMED else x


def encoded(out) -> Any:
    """The raw latent of an encode's output: its posterior's mean, or its `latent` / `latents` field."""
    if hasattr(out, "latent_dist"):
        return out.latent_dist.mean
    return out.latent if hasattr(out, "latent") else out.latents


def _bn(vae):
    """Flux.2's batch-norm running mean and std, (1, 4C, 1, 1) float32 on the CPU."""
    import torch

    bn = vae.bn
    mean = bn.running_mean.detach().float().cpu().view(1, -1, 1, 1)
    var = bn.running_var.detach().float().cpu().view(1, -1, 1, 1)
    return mean, torch.sqrt(var + float(vae.config.batch_norm_eps))


def _norm(vae):
    """Qwen-Image 2.1's latents_mean and latents_std, (1, C, 1, 1, 1) float32."""
    import torch

    cfg = vae.config
    shape = (1, -1, 1, 1, 1)
    return torch.tensor(cfg.latents_mean).view(shape), torch.tensor(cfg.latents_std).view(shape)


def _patchify(z):
    """(B, C, H, W) -> (B, 4C, H/2, W/2), as Flux2Pipeline._patchify_latents."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def _unpatchify(z):
    """(B, 4C, h, w) -> (B, C, 2h, 2w), as Flux2Pipeline._unpatchify_latents."""
    b, c, h, w = z.shape
    return z.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)
