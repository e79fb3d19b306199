"""Will a recipe fit? Its outputs checked and its memory estimated before the denoiser or the VAE runs.

`sinks` (numpy) is imported inside the check that uses it, so that `import tilewise.pipelines` imports no
torch, diffusers or numpy: the CLI's commands import it before they check their arguments, and a bad argument
fails before ~4 s of torch and diffusers imports.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ..atomic import check_target
from ..errors import BadRequest, WontFit
from ..limits import check_disk, device_memory_available, fitting_size
from ..memory import dtype_itemsize, format_bytes

# latent-sized float tensors counted per guided denoising step, a lower bound of what grows with the area:
# measured on the CPU (embedded model, TiledDenoiser tile 64, one step, peak RSS growth in a fresh process)
# at 2048 px 304 MiB and 6144 px 452 MiB with 1 and 9 MiB latents, i.e. 18.5 latent-sized tensors per
# latent (the latents, the guidance batch of two, the fusion accumulator, the predictions, the scheduler's)
LATENT_COPIES = 12


def check_image_output(out: str | os.PathLike | None, bits: int, replace: bool) -> None:
    """An image output (.png / .tif / .npy) that can be written, at `bits`, before any work."""
    if out is None:
        return
    from ..sinks import sink_for

    sink_for(out, bits)
    check_target(out, "output", replace=replace)


def check_latents_output(out: str | os.PathLike, replace: bool) -> None:
    """A .safetensors output for latents (never safetensors bytes under an image's name)."""
    suffix = Path(out).suffix.lower()
    if suffix != ".safetensors":
        raise BadRequest(f"output {os.fspath(out)!r}: encode writes latents as a .safetensors file, and "
                         f"{suffix or 'no suffix'!r} names another format; use a name ending in .safetensors")
    check_target(out, "output", replace=replace)


def check_generate_fits(unet, width: int, height: int, factor: int, regions: int = 0,
                        frames: int = 1) -> None:
    """Refuse a generation whose full-size latents (of `frames` latent frames) alone cannot fit the UNet's
    device (WontFit naming the figure and the largest size of the same aspect that would)."""
    c = int(getattr(getattr(unet, "config", None), "in_channels", 4) or 4)
    check_generate_room(c, getattr(unet, "dtype", "float32"), getattr(unet, "device", "cpu"), width, height,
                        factor, regions, frames)


def check_generate_room(channels: int, dtype, device, width: int, height: int, factor: int,
                        regions: int = 0, frames: int = 1) -> None:
    """`check_generate_fits` from the denoiser's latent channels, dtype and device (what its config and
    the command's options say, before it loads)."""
    c, h, w = channels * frames, height // factor, width // factor
    per = c * h * w * dtype_itemsize(dtype)
    need = LATENT_COPIES * per + (regions + 1) * h * w * 4 * frames  # and one float32 weight per region
    room = device_memory_available(device)
    if need <= room:
        return
    fw, fh = fitting_size(width, height, need, room // 2, multiple=factor)
    dims = f"{c // frames}x{frames}x{h}x{w}" if frames > 1 else f"{c}x{h}x{w}"
    where = "host" if str(device).startswith("cpu") else str(device)
    raise WontFit(f"generate {width}x{height}: denoising holds at least {LATENT_COPIES} latent-sized tensors "
                  f"of {dims} {str(dtype).removeprefix('torch.')} ({format_bytes(per)} each: the "
                  f"latents, the guidance batch of two, the fusion, the predictions), {format_bytes(need)} "
                  f"in all, but {format_bytes(room)} of {where} memory is available; about {fw}x{fh} would "
                  "fit")


def check_upscale_fits(width: int, height: int, scale: float) -> None:
    """Refuse an upscale whose resized image (float32 RGB, a few copies) cannot fit in host memory."""
    ow, oh = max(1, round(width * scale)), max(1, round(height * scale))
    need = 3 * 4 * ow * oh * 3  # the resized input, its padded copy, the decoded output
    room = device_memory_available("cpu")
    if need > room:
        s = math.sqrt(room / 2 / need) * scale
        raise WontFit(f"upscale of {width}x{height} by {scale:g} to {ow}x{oh} holds at least "
                      f"{format_bytes(need)} of float32 pixels but {format_bytes(room)} of host memory is "
                      f"available; a scale of about {s:.2g} would fit")


def check_output_disk(out: str, height: int, width: int, channels: int, bits: int, frames: int = 1) -> None:
    """Refuse (WontFit) an uncompressed output whose bytes exceed the free disk of its folder: a .npy
    (image, stack, or the frames of a pattern) or an uncompressed TIFF holds every pixel; a PNG is
    compressed and has no known size before it is written."""
    suffix = Path(out.replace("{", "").replace("}", "")).suffix.lower()
    if suffix not in (".npy", ".tif", ".tiff"):
        return
    need = frames * height * width * channels * max(1, bits // 8)
    folder = os.path.dirname(out.format(0) if "{" in out else out) or "."
    check_disk(need, folder, f"output {out!r} ({frames} x {width}x{height}x{channels} at {bits} bits)",
               hint="free some space or write it elsewhere")
