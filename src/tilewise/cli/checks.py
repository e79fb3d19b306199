"""The checks every command makes before loading a model: outputs, input files, model paths, sizes.

They raise the library's errors (`tilewise.errors`) with the option's name and the user's own value, so
`main` prints one line and exits with the kind's status; nothing is written by a check.

sinks and sources (numpy) and torch are imported inside the checks that use them: `import tilewise.cli`, what
`tilewise --help` runs, imports neither numpy nor torch (~2 s).
"""

from __future__ import annotations

from pathlib import Path

import typer

from ..atomic import check_target
from ..errors import BadRequest

IMAGE_SUFFIXES = (".png", ".tif", ".tiff", ".npy")


def output(path: Path | None, option: str = "--out", suffixes: tuple[str, ...] = IMAGE_SUFFIXES,
           no_clobber: bool = False, bits: int | None = None) -> None:
    """An output file: a suffix the command writes, a folder that takes it, not replaced with --no-clobber.

    An existing file is replaced only once the new one is complete; a note on stderr says it will be."""
    if path is None:
        return
    if _is_pattern(str(path)):
        raise BadRequest(f"{option} {str(path)!r} is a frame pattern, but this writes one file: give a file "
                         "name (frame patterns are for the videos of the 3-D VAEs)")
    suffix = path.suffix.lower()
    if suffix not in suffixes:
        what = "no suffix" if not suffix else f"suffix {suffix!r}"
        raise BadRequest(f"{option} {str(path)!r}: {what} is not one this command writes; use one of "
                         f"{', '.join(suffixes)} (the bytes always match the name)")
    if bits is not None:
        from ..sinks import sink_for

        try:
            sink_for(path, bits)
        except ValueError as e:
            raise BadRequest(f"--bits {bits} with {option} {str(path)!r}: {e}") from None
    check_target(path, option, replace=not no_clobber)
    if path.exists():
        typer.echo(f"note: {option} {str(path)!r} exists; it is replaced once the new file is complete "
                   "(--no-clobber keeps it)", err=True)


def video_output(path: Path, no_clobber: bool = False, bits: int = 8, frames: int = 1) -> None:
    """The output of a 3-D VAE's decode: an image (one frame), a frame pattern with a {} field
    ("frames/f{:04d}.png": its folder must take the frames), a .npy or a .tif stack; bits 8, 16 or 32
    (float: .npy / .tif). `frames`: the latents' frames, which the decode makes at least (each
    decoder makes 1 or more frames of each): those targets are checked now, the rest once the VAE says
    how many (`sinks.video.FrameSequenceSink`)."""
    name = str(path)
    suffix = Path(name.replace("{", "").replace("}", "")).suffix.lower()
    if suffix not in IMAGE_SUFFIXES:
        what = "no suffix" if not suffix else f"suffix {suffix!r}"
        raise BadRequest(f"--out {name!r}: {what} is not one this command writes; use one of "
                         f"{', '.join(IMAGE_SUFFIXES)}, or a frame pattern such as 'frames/f{{:04d}}.png'")
    if "{" not in name:
        output(path, no_clobber=no_clobber, bits=bits)
        return
    from ..sinks.video import frame_targets, video_sink_for

    try:
        video_sink_for(name, bits)
    except BadRequest as e:
        raise BadRequest(f"--bits {bits} with --out {name!r}: {e}") from None
    targets = frame_targets(name, max(frames, 2))[:frames]
    for target in {str(Path(t).parent): t for t in reversed(targets)}.values():  # each folder's first
        check_target(Path(target), "--out (its frames)")
    there = [t for t in targets if Path(t).exists()]
    if there and no_clobber:
        raise BadRequest(f"--out {name!r}: frame {there[0]!r} exists ({len(there)} of the first {frames} "
                         "frames do) and replacing them was refused (--no-clobber); remove them or choose "
                         "another pattern")


def _is_pattern(name: str) -> bool:
    """Whether a name is a frame pattern (a {} field whose frame number changes the name)."""
    if "{" not in name:
        return False
    try:
        return name.format(0) != name.format(1)
    except (IndexError, KeyError, ValueError):
        return False


def video_input(path: Path) -> None:
    """The input of a 3-D VAE's encode: an image, a frame pattern (no gaps, frames of one size), a .npy or
    a .tif stack, checked from names and headers (`pipelines.frames.check_video`)."""
    from ..pipelines.frames import check_video

    check_video(path)


def picture(path: Path | None, option: str, no_clobber: bool = False) -> None:
    """A picture output (tile grid, heatmap, plot): always PNG, so the name must end in .png."""
    output(path, option, (".png",), no_clobber)


def report_folder(path: Path | None) -> None:
    """--report DIR: a folder (made if missing, its parent must take it), not a file."""
    if path is None:
        return
    if path.exists() and not path.is_dir():
        raise BadRequest(f"--report {str(path)!r} is a file; give a folder (made if missing)")
    parent = path if path.exists() else next((q for q in path.parents if q.exists()), Path("."))
    if not parent.is_dir():
        raise BadRequest(f"--report {str(path)!r}: {str(parent)!r} is a file, not a folder")
    check_target(parent / ".tilewise-report-check", "--report", replace=True)


def model_paths(model: Path | None, config: Path | None, vae_folder: bool = False,
                controlnet: Path | None = None) -> None:
    """--model / --config / --controlnet name things that are there, and what their JSON says holds
    (`pipelines.folders`: model_index.json, each component's folder, config and weights; a VAE folder
    with `vae_folder`); a single-file checkpoint is checked when it loads."""
    from ..pipelines.folders import check_controlnet_folder, check_model_folder

    for option, p in (("--model", model), ("--config", config)):
        if p is not None and not p.exists():
            single = " or a single .safetensors checkpoint" if option == "--model" else ""
            raise BadRequest(f"{option} {str(p)!r} does not exist: give a diffusers pipeline folder (with "
                             f"model_index.json){single}")
    if model is None and config is not None:
        raise BadRequest(f"--config {str(config)!r} needs a single-file --model checkpoint to apply to")
    if model is not None and model.is_dir() and config is not None:
        raise BadRequest(f"--config {str(config)!r} applies to a single-file --model only, but --model "
                         f"{str(model)!r} is a folder (it carries its own configs)")
    check_model_folder(model, config, vae_folder=vae_folder)
    if controlnet is not None:
        check_controlnet_folder(controlnet)


def image_input(path: Path, option: str = "image", decode: bool = False, alpha: bool = False):
    """An input image whose header opens; with `decode`, read whole at its depth (a truncated or corrupt
    image is refused now, not after the model loads): its `Picture` then (`alpha`: its alpha is used)."""
    from ..sources import check_image, read_image

    what = "image" if option == "image" else f"{option} image"
    if decode:
        return read_image(path, what, alpha=alpha)
    check_image(path, what)
    return None


def latents_input(path: Path, video: bool = False, channels: int | None = None) -> tuple[int, ...]:
    """A latents file whose .safetensors header opens and holds a float 'latents' tensor of one image (of
    one video: (1, C, T, h, w) or (C, T, h, w), with video=True) of `channels` channels, finite values
    (read: latents are small); its shape."""
    from ..sources.latents import read_latents

    return tuple(read_latents(path, channels=channels, video=video).shape)


def budget(text: str | None) -> None:
    """--budget: a byte count such as 2GiB or 512MB."""
    if text is None:
        return
    from ..memory import parse_bytes

    try:
        parse_bytes(text)
    except ValueError as e:
        raise BadRequest(f"--budget {text!r}: {e}") from None


def regions(boxes: list, width: int, height: int) -> None:
    """Every --region box inside the image, neither empty nor inverted."""
    from ..pipelines.recipes import check_region

    for box, _ in boxes:
        check_region(box, width, height)


def ranks(nproc: int, device: str) -> None:
    """--nproc N within what this machine runs at once: one rank per CUDA device, or per CPU core."""
    import os

    if nproc <= 1 or "RANK" in os.environ:  # (under torchrun: the launch was checked by its parent)
        return
    if device.startswith("cuda"):
        import torch

        n, what = torch.cuda.device_count(), "CUDA devices"
    else:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        what = "CPU cores for this process (ranks on the CPU, gloo)"
    if nproc > n:
        raise BadRequest(f"--nproc {nproc}: this machine has {n} {what}; use --nproc 1..{n} (several "
                         "machines: run torchrun yourself)")


def output_room(out: Path | str | None, height: int, width: int, channels: int, bits: int,
                frames: int = 1) -> None:
    """An uncompressed output (.npy, .tif; frames of a pattern too) against the free disk of its folder
    (PNG is compressed: its size is not known before)."""
    if out is None:
        return
    from ..pipelines.fits import check_output_disk

    check_output_disk(str(out), height, width, channels, bits, frames)


def device(name: str) -> None:
    """--device names a torch device this machine has."""
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise BadRequest(f"--device {name!r} is not a torch device; e.g. cpu, cuda, cuda:1, mps") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            why = " was built without CUDA" if torch.version.cuda is None else ""
            raise BadRequest(f"--device {name!r}: no CUDA device here (torch {torch.__version__}{why}); use "
                             "--device cpu")
        if dev.index is not None and dev.index >= n:
            raise BadRequest(f"--device {name!r}: this machine has {n} CUDA device(s), cuda:0..cuda:{n - 1}")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise BadRequest(f"--device {name!r}: MPS is not available here; use --device cpu")


def pixels_fit(model, config, w: int, h: int, copies: int, option: str, value: str, device: str) -> None:
    """Refuse (WontFit) a latent size whose decoded images (`copies` float32 RGB images, a lower bound of
    what the command holds) cannot fit the memory there is, before the model loads."""
    from ..limits import check_memory
    from ..pipelines.folders import part_config, vae_factor_of

    f = vae_factor_of(part_config(model, "vae", config)) or 8
    check_memory(copies * 3 * 4 * (h * f) * (w * f), f"{option} {value}: {copies} images of {w * f}x{h * f} "
                 "float32 RGB", device, hint=f"a smaller {option}")
