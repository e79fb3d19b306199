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


def video_output(path: Path, no_clobber: bool = False, bits: int = 8) -> None:
    """The output of a 3-D VAE's decode: an image (one frame), a frame pattern with a {} field
    ("frames/f{:04d}.png": its folder must take the frames), a .npy or a .tif stack; bits 8, 16 or 32
    (float: .npy / .tif)."""
    name = str(path)
    suffix = Path(name.replace("{", "").replace("}", "")).suffix.lower()
    if suffix not in IMAGE_SUFFIXES:
        what = "no suffix" if not suffix else f"suffix {suffix!r}"
        raise BadRequest(f"--out {name!r}: {what} is not one this command writes; use one of "
                         f"{', '.join(IMAGE_SUFFIXES)}, or a frame pattern such as 'frames/f{{:04d}}.png'")
    if "{" not in name:
        output(path, no_clobber=no_clobber, bits=bits)
        return
    from ..sinks.video import video_sink_for

    try:
        video_sink_for(name, bits)
    except BadRequest as e:
        raise BadRequest(f"--bits {bits} with --out {name!r}: {e}") from None
    check_target(Path(name.format(0)), "--out (its first frame)", replace=not no_clobber)


def video_input(path: Path) -> None:
    """The input of a 3-D VAE's encode: an image, a frame pattern whose first frame is there, a .npy or a
    .tif stack."""
    from ..sources.files import check_file

    name = str(path)
    if "{" in name:
        try:
            first = name.format(0)
        except (IndexError, KeyError, ValueError) as e:
            raise BadRequest(f"image {name!r} is not a frame pattern with one {{}} field ({e}); e.g. "
                             "'frames/f{:04d}.png'") from None
        check_file(first, f"first frame of {name!r}")
    elif path.suffix.lower() == ".npy":
        check_file(path, "video")
    else:
        image_input(path)


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


def model_paths(model: Path | None, config: Path | None) -> None:
    """--model / --config name things that are there (what they hold is checked when loading)."""
    for option, p in (("--model", model), ("--config", config)):
        if p is not None and not p.exists():
            single = " or a single .safetensors checkpoint" if option == "--model" else ""
            raise BadRequest(f"{option} {str(p)!r} does not exist: give a diffusers pipeline folder (with "
                             f"model_index.json){single}")


def image_input(path: Path, option: str = "image") -> None:
    """An input image whose header opens (decoded later, at its depth, by tilewise.sources)."""
    from ..sources import check_image

    check_image(path, "image" if option == "image" else f"{option} image")


def latents_input(path: Path, video: bool = False) -> None:
    """A latents file whose .safetensors header opens and holds a float 'latents' tensor of one image (of
    one video: (1, C, T, h, w) or (C, T, h, w), with video=True)."""
    from ..sources.latents import check_latents

    check_latents(path, video=video)


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
