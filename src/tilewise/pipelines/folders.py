"""Model folders checked from their JSON before anything loads, and loading errors told about the part.

A pipeline folder's model_index.json, each component it lists (its folder, every JSON file there, a weights
file), a VAE or ControlNet folder's config.json and weights: a `ModelProblem` names the file that is
missing or broken, never just the folder, and a path that is not there is a `BadRequest` saying so.
While diffusers or transformers load, their log notices are held back: shown after a load that works,
dropped after one that fails (its one line says what failed; `--verbose` logs them).

Only json, os, pathlib and safetensors' header reader here: the CLI runs these checks before torch or
diffusers are imported.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import BadRequest, ModelProblem, TilewiseError
from ..locality.classes import BATCHED_VAES, IMAGE_VAES, PYTHON_ONLY, REFUSED
from ..locality.video_classes import VIDEO_VAES

logger = logging.getLogger(__name__)

# what a VAE folder (or a pipeline's vae/) may hold: the classes tilewise tiles, less those only Python takes
VAE_CLASSES = tuple(n for n in (*IMAGE_VAES, *VIDEO_VAES, *BATCHED_VAES) if n not in PYTHON_ONLY)
# VAEs decode / encode load from a pipeline folder's vae/ alone (AutoencoderKL's and AutoencoderTiny's
# pipelines load whole, as `generate` loads them)
ALONE_VAES = tuple(name for name in VAE_CLASSES if name not in ("AutoencoderKL", "AutoencoderTiny"))
WEIGHTS = (".safetensors", ".bin", ".ckpt", ".pt", ".pth", ".msgpack", ".gguf")
LIBRARY_LOGGERS = ("diffusers", "transformers")


def read_json(path: Path, hint: str) -> dict:
    """A JSON file that parses to an object; ModelProblem naming the file (and `hint`) otherwise."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelProblem(f"{str(path)!r} is not valid JSON ({e}); {hint}") from e
    if not isinstance(data, dict):
        raise ModelProblem(f"{str(path)!r} holds a {type(data).__name__}, not a JSON object; {hint}")
    return data


def read_model_index(folder: Path, what: str) -> dict:
    """A pipeline folder's model_index.json as a dict naming its class; ModelProblem naming the file."""
    index = folder / "model_index.json"
    if not index.is_file():
        raise ModelProblem(f"{what} {str(folder)!r} is a folder without model_index.json: not a diffusers "
                           "pipeline")
    data = read_json(index, "a diffusers model_index.json maps '_class_name' and each component to "
                            "[library, class]")
    if not isinstance(data.get("_class_name"), str):
        raise ModelProblem(f"{str(index)!r} names no pipeline class: it needs a '_class_name' string, e.g. "
                           "\"StableDiffusionPipeline\"")
    return data


def components(index: dict) -> dict[str, str]:
    """{component: class} of the parts a model_index.json lists (null entries, saved as None, left out)."""
    return {k: v[1] for k, v in index.items()
            if isinstance(v, list) and len(v) == 2 and v[0] is not None and isinstance(v[1], str)}


def vae_component(index: dict, folder: str | os.PathLike) -> str | None:
    """The component of a pipeline's model_index.json that holds its VAE: "vae" where it lists one, else
    the one component whose class is a VAE class decode / encode take (`VAE_CLASSES`: Kandinsky's `movq`,
    LDM's `vqvae`), else the one whose class the family table refuses (refused then with the reason);
    None where there is none; ModelProblem naming them where there are two."""
    parts = components(index)
    if "vae" in parts:
        return "vae"
    found = [n for n, c in parts.items() if c in VAE_CLASSES] or [n for n, c in parts.items() if c in REFUSED]
    if len(found) > 1:
        named = ", ".join(f"{n!r} ({parts[n]})" for n in found)
        raise ModelProblem(f"pipeline folder {os.fspath(folder)!r} has no 'vae' component but {len(found)} "
                           f"VAE components ({named}): tilewise cannot tell which to use; give that "
                           f"component's folder as --model (a VAE folder, e.g. "
                           f"{str(Path(folder) / found[0])!r})")
    return found[0] if found else None


def check_component(folder: Path, what: str, weights: bool) -> None:
    """A model's folder: there, every JSON file in it parses, a config.json (or a scheduler's, a
    tokenizer's) and, with `weights`, a weights file beside a model's config.json."""
    if not folder.is_dir():
        raise ModelProblem(f"{what}: folder {str(folder)!r} is missing")
    jsons = sorted(folder.glob("*.json"))
    for path in jsons:
        read_json(path, f"the config of {what}")
    if not jsons:
        raise ModelProblem(f"{what}: {str(folder)!r} holds no config.json (nor any JSON config)")
    if not weights or not (folder / "config.json").is_file():
        return
    files = [p for p in sorted(folder.iterdir()) if p.is_file() and p.suffix in WEIGHTS]
    if not files:
        raise ModelProblem(f"{what}: {str(folder)!r} has a config.json but no weights file "
                           f"({', '.join(WEIGHTS)}): the model was saved without them, or they were moved")
    for path in files:
        if path.suffix == ".safetensors":
            check_safetensors(path, what)


def check_safetensors(path: Path, what: str) -> None:
    """A .safetensors weights file whose header reads and whose data covers it (a truncated or corrupt
    file is refused naming it; nothing but the header is read)."""
    from safetensors import safe_open  # (no torch: the numpy framework opens the header)

    try:
        with safe_open(str(path), "numpy"):
            pass
    except Exception as e:  # SafetensorError, OSError
        raise ModelProblem(f"{what}: weights {str(path)!r} are truncated or corrupt ({e})") from None


def check_pipeline_folder(path: Path, what: str, weights: bool = True) -> dict:
    """A pipeline folder's model_index.json and every component it lists; returns the index."""
    index = read_model_index(path, what)
    for name, cls in components(index).items():
        check_component(path / name, f"component {name!r} ({cls}) of {what} {str(path)!r}", weights)
    return index


def check_model_folder(model: str | os.PathLike | None, config: str | os.PathLike | None = None,
                       vae_folder: bool = False) -> None:
    """--model and --config checked from their files before anything loads: a pipeline folder (its index
    and components), with `vae_folder` a VAE folder (config.json and weights) too, a --config pipeline
    folder (configs only: its weights are not used). A single-file --model is checked when it loads."""
    if model is not None and Path(model).is_dir():
        path = Path(model)
        if vae_folder and (path / "config.json").is_file() and not (path / "model_index.json").is_file():
            name = read_json(path / "config.json", "a VAE folder's config.json names its _class_name").get(
                "_class_name")
            check_vae_class(name, f"{str(path)!r}")
            check_component(path, f"VAE folder {str(path)!r}", weights=True)
        else:
            index = check_pipeline_folder(path, "--model")
            part = vae_component(index, path) if vae_folder else None
            if part is not None:
                check_vae_class(components(index)[part], f"the {part} of {str(path)!r}")
    if config is not None:
        path = Path(config)
        if not path.is_dir():
            raise BadRequest(f"--config {str(config)!r} is a file: give a diffusers pipeline folder (with "
                             "model_index.json, component configs and tokenizer) of the checkpoint's model")
        check_pipeline_folder(path, "--config", weights=False)


def check_vae_class(name, what: str) -> None:
    """A VAE class `decode` / `encode` take (`VAE_CLASSES`); ModelProblem naming it, with the reason where
    the family table refuses it (`locality.classes.REFUSED`), else the classes that are taken."""
    if name in VAE_CLASSES:
        return
    if name in REFUSED:
        raise ModelProblem(f"{what} holds a {name}, which tilewise does not tile: {REFUSED[name]}")
    if name in PYTHON_ONLY:
        raise ModelProblem(f"{what} holds a {name}: tilewise tiles it from Python (tw.TiledVAE), but "
                           f"`decode` / `encode --model` do not take it yet ({PYTHON_ONLY[name]}); the CLI "
                           f"takes {', '.join(VAE_CLASSES)}")
    raise ModelProblem(f"{what} holds a {name or 'model without _class_name'}, not a VAE tilewise tiles: one "
                       f"of {', '.join(VAE_CLASSES)}")


def check_controlnet_folder(folder: str | os.PathLike) -> None:
    """--controlnet: a folder there, holding a ControlNet's config.json and its weights."""
    path = Path(folder)
    if not path.exists():
        raise BadRequest(f"--controlnet {str(folder)!r} does not exist: give a ControlNet folder saved with "
                         "save_pretrained (config.json and weights)")
    if not path.is_dir():
        raise BadRequest(f"--controlnet {str(folder)!r} is a file: give a ControlNet folder saved with "
                         "save_pretrained (config.json and weights)")
    if not (path / "config.json").is_file():
        raise ModelProblem(f"--controlnet {str(folder)!r} is not a diffusers model folder: it has no "
                           "config.json")
    check_component(path, f"--controlnet {str(folder)!r}", weights=True)


# how diffusers says a weight's shape differs from its config's: with accelerate (low_cpu_mem_usage) and
# without it (torch's load_state_dict)
_MISMATCH = (
    re.compile(r"Cannot load because (?P<key>\S+) expected shape (?:torch\.Size)?\((?P<want>\[[0-9, ]*\])\), "
               r"but got (?:torch\.Size)?\((?P<got>\[[0-9, ]*\])\)"),
    re.compile(r"size mismatch for (?P<key>[^:\s]+): copying a param with shape (?:torch\.Size)?"
               r"\((?P<got>\[[0-9, ]*\])\) from checkpoint, the shape in current model is "
               r"(?:torch\.Size)?\((?P<want>\[[0-9, ]*\])\)"),
)


def shape_mismatch(error: BaseException) -> tuple[str, str, str] | None:
    """(weight name, shape its config gives, shape its file holds) of a load that failed on a weight's
    shape, in either of diffusers' wordings; None for other errors."""
    text = " ".join(str(error).split())
    for pattern in _MISMATCH:
        if m := pattern.search(text):
            return m["key"], m["want"], m["got"]
    return None


def _holder_of(key: str, path: Path, index: dict) -> str | None:
    """The component of pipeline folder `path` whose .safetensors weights hold a tensor named `key`."""
    from safetensors import safe_open  # (headers only, numpy framework: no torch)

    for name in components(index):
        for file in sorted((path / name).glob("*.safetensors")) if (path / name).is_dir() else ():
            try:
                with safe_open(str(file), "numpy") as f:
                    if key in f.keys():
                        return name
            except Exception:  # a corrupt file: its own check names it
                continue
    return None


def component_of(error: BaseException, path: Path) -> str | None:
    """The component of pipeline folder `path` an error while loading it is about (its folder named in
    the error's text, its class, or the file holding a weight of the wrong shape), or None."""
    try:
        index = read_model_index(path, "--model")
    except ModelProblem:
        return None
    mismatch = shape_mismatch(error)
    holder = _holder_of(mismatch[0], path, index) if mismatch else None
    if holder is not None:
        return f"component {holder!r} ({components(index)[holder]}, {str(path / holder)!r})"
    text = str(error)
    for name, cls in components(index).items():
        if str(path / name) in text or f"/{name}/" in text or f" {cls}" in text or f"{cls}:" in text:
            return f"component {name!r} ({cls}, {str(path / name)!r})"
    return None


@contextmanager
def held_library_logs() -> Iterator[None]:
    """While loading: diffusers' and transformers' notices are held; replayed after a load that works,
    logged at debug level after one that fails (the failure's one line comes alone)."""
    held: list[logging.LogRecord] = []

    class _Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    saved = {}
    for name in LIBRARY_LOGGERS:
        lib = logging.getLogger(name)
        saved[name] = lib.handlers[:]
        lib.handlers = [_Hold()]
    ok = False
    try:
        yield
        ok = True
    finally:
        for name, handlers in saved.items():
            logging.getLogger(name).handlers = handlers
        for record in held:
            if ok:
                for h in saved[record.name.split(".")[0]]:
                    if record.levelno >= h.level:
                        h.handle(record)
            else:
                logger.debug("while loading: %s", " ".join(record.getMessage().split()))


@contextmanager
def model_errors(what: str, folder: Path | None = None) -> Iterator[None]:
    """Errors of diffusers while loading a model (KeyError, OSError, a corrupt weight file) as one
    ModelProblem naming the model (and the component of pipeline `folder` it is about); out-of-memory
    errors, tilewise's own errors and signals pass through. Library notices are held meanwhile."""
    try:
        with held_library_logs():
            yield
    except (TilewiseError, MemoryError):
        raise
    except Exception as e:
        if type(e).__name__ == "OutOfMemoryError":
            raise
        detail = " ".join(str(e).split()) or type(e).__name__
        if mismatch := shape_mismatch(e):
            key, want, got = mismatch
            detail = f"size mismatch for {key}: its config gives shape {want}, its weights {got}"
        part = component_of(e, folder) if folder is not None else None
        where = f"{what}: {part}" if part else what
        raise ModelProblem(f"{where} cannot be loaded: {type(e).__name__}: {detail[:400]}") from e


def part_config(model: str | os.PathLike | None, part: str, config: str | os.PathLike | None = None
                ) -> dict | None:
    """The JSON config of one part ("vae", "unet", "transformer") of --model, read without loading
    anything: the embedded model's, a pipeline folder's `part/config.json` (of --config for a single
    file; "vae": its VAE component, `vae_component`), a VAE folder's own; None where there is none (or
    it does not parse: the checks say so)."""
    from ..models import load_config  # (json only)

    if model is None:
        return load_config(part) if part in ("vae", "unet") else None
    path = Path(model)
    if path.is_file():
        path = Path(config) if config is not None else None
    if path is None or not path.is_dir():
        return None
    own, index = path / "config.json", path / "model_index.json"
    if part == "vae" and index.is_file():  # (the pipeline's VAE component: vae/, Kandinsky's movq/, ...)
        try:
            part = vae_component(read_json(index, ""), path) or part
        except ModelProblem:
            pass  # (the folder checks say what is wrong with it)
    file = own if (own.is_file() and not index.is_file() and part == "vae") else path / part / "config.json"
    try:
        return read_json(file, "") if file.is_file() else None
    except ModelProblem:
        return None


def scheduler_sigma_data(model: str | os.PathLike | None) -> float | None:
    """The sigma_data of a --model pipeline folder's scheduler config (scheduler/scheduler_config.json:
    the EDMEulerScheduler of Cosmos' pipelines), read without loading anything; None where there is none
    (a VAE folder, a file, no scheduler, no positive number there)."""
    if model is None or not Path(model).is_dir():
        return None
    file = Path(model) / "scheduler" / "scheduler_config.json"
    try:
        value = read_json(file, "").get("sigma_data") if file.is_file() else None
    except ModelProblem:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < float("inf")
    return float(value) if ok else None


def vae_factor_of(cfg: dict | None) -> int | None:
    """Pixels per latent pixel of an AutoencoderKL config (2 ** (blocks - 1)); None for another VAE."""
    if not cfg or cfg.get("_class_name", "AutoencoderKL") != "AutoencoderKL":
        return None
    blocks = cfg.get("block_out_channels")
    return 2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else None
