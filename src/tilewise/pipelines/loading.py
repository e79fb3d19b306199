"""Loading a pipeline: the embedded default, a local diffusers folder, or one checkpoint file; `Loaded`.

diffusers (~4 s) and torch are imported inside the loaders, so that `import tilewise.pipelines` imports no
torch, diffusers or numpy: the CLI's commands import it before they check their arguments, and a bad argument
fails before ~4 s of torch and diffusers imports.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadRequest, ModelProblem
from ..models import SCHEDULERS, default_prompt_embeds, load_default_pipeline
from .folders import (
    ALONE_VAES,
    check_controlnet_folder,
    check_vae_class,
    components,
    model_errors,
    read_json,
    read_model_index,
    vae_component,
)
from .prompts import embeds_for_regions, encode
from .single_file import load_single_file

DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class Loaded:
    """A pipeline and how to turn text into its conditioning."""

    pipe: Any
    source: str
    embedded: bool
    sdxl: bool

    @property
    def denoiser(self) -> str:
        """The pipeline's denoiser attribute: "unet" (SD family) or "transformer" (SD3, Flux, ...)."""
        return "unet" if getattr(self.pipe, "unet", None) is not None else "transformer"

    def encode(self, prompt: str, negative: str = "") -> dict[str, Any]:
        """{prompt_embeds, negative_prompt_embeds[, pooled_prompt_embeds, negative_pooled_prompt_embeds]}
        (`tilewise.pipelines.prompts`: per family; other pipelines get the text)."""
        if self.embedded:
            return default_prompt_embeds(self.pipe, prompt, negative)
        return encode(self.pipe, prompt, negative)

    def region_embeds(self, prompt: str, negative: str = "") -> dict[str, Any]:
        """A regional prompt's embeddings (refused in one line where tilewise does not encode prompts)."""
        if self.embedded:
            return self.encode(prompt, negative)
        return embeds_for_regions(self.pipe, prompt, negative)


def _saved_as_none(path: Path) -> dict[str, None]:
    """Components model_index.json lists as null (e.g. SD3 without T5): stock loading wants them as None."""
    index = json.loads((path / "model_index.json").read_text())
    return {k: None for k, v in index.items() if isinstance(v, list) and v and v[0] is None}


def load_controlnet(folder: str | os.PathLike, device: str = "cpu", dtype: str = "float32"):
    """A ControlNet saved with save_pretrained (config.json naming its class, e.g. ControlNetModel)."""
    import diffusers

    path = Path(folder)
    check_controlnet_folder(path)
    name = read_json(path / "config.json", "a ControlNet's config.json names its _class_name").get(
        "_class_name", "")
    if not isinstance(name, str) or not name.endswith(("ControlNetModel", "ControlNetUnionModel")) or \
            not hasattr(diffusers, name):
        raise ModelProblem(f"--controlnet {str(folder)!r} holds a {name or 'model without _class_name'}, not "
                           "a diffusers ControlNet (ControlNetModel, SD3ControlNetModel, "
                           "FluxControlNetModel, ...)")
    with model_errors(f"--controlnet {str(folder)!r}"):
        model = getattr(diffusers, name).from_pretrained(path, local_files_only=True)
    return model.to(device, _torch_dtype(dtype)).eval()


def _torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    return getattr(torch, name)


def load_pipeline(
    model: str | os.PathLike | None = None,
    *,
    config: str | os.PathLike | None = None,
    scheduler: str = "ddim",
    device: str = "cpu",
    dtype: str = "float32",
    local_files_only: bool = True,
) -> Loaded:
    """The embedded default pipeline (model=None), a diffusers pipeline folder, or one .safetensors file.

    A single file takes its architecture from `config`, a local diffusers pipeline folder of the same
    model family (diffusers' from_single_file(config=...)); offline, a single file needs one.
    """
    torch_dtype = _torch_dtype(dtype)
    # 1. the embedded default
    if model is None:
        if config is not None:
            raise ValueError(f"--config {str(config)!r} needs a single-file --model checkpoint to apply to")
        pipe = load_default_pipeline(scheduler=scheduler, device=device, dtype=torch_dtype)
        return Loaded(pipe, "embedded default (tilewise/models)", embedded=True, sdxl=False)
    # 2. a local pipeline folder or one checkpoint file
    path = Path(model)
    pipe = _load_local(model, config, local_files_only)
    # 3. what tilewise needs of it: a denoiser beside a VAE, and the scheduler asked for
    _check_parts(pipe, path, scheduler)
    if scheduler != "ddim":
        _set_scheduler(pipe, scheduler)
    pipe.to(device, torch_dtype)
    sdxl = "XL" in type(pipe).__name__
    return Loaded(pipe, str(path), embedded=False, sdxl=sdxl)


def _load_local(model: str | os.PathLike, config: str | os.PathLike | None, local_files_only: bool) -> Any:
    """A diffusers pipeline folder (from_pretrained) or a .safetensors/.ckpt file (`load_single_file`)."""
    path = Path(model)
    if not path.exists():
        raise BadRequest(
            f"--model {str(model)!r} does not exist: give a diffusers pipeline folder (with "
            "model_index.json) or a single .safetensors checkpoint"
        )
    if path.is_dir():
        if config is not None:
            raise ValueError(
                f"--config {str(config)!r} applies to a single-file --model only, but --model "
                f"{str(path)!r} is a folder (it carries its own configs)"
            )
        _check_accelerate(read_model_index(path, "--model"), path)
        from diffusers import DiffusionPipeline

        nones = _saved_as_none(path)
        with model_errors(f"--model {str(path)!r}", folder=path):
            pipe = DiffusionPipeline.from_pretrained(path, local_files_only=local_files_only, **nones)
    elif path.suffix in (".safetensors", ".ckpt"):
        with model_errors(f"--model {str(path)!r}"):
            pipe = load_single_file(path, config, local_files_only)
    else:
        raise BadRequest(f"--model {str(model)!r}: expected a folder or a .safetensors/.ckpt file")
    return pipe


def _check_accelerate(index: dict, path: Path) -> None:
    """Refuse, before loading, a folder with a model diffusers loads only with the accelerate package: one
    keeping modules in float32 (Wan 2.x, SkyReels-V2, Cosmos, Kandinsky 5: `_keep_in_fp32_modules`), which
    diffusers 0.42's from_pretrained refuses without low_cpu_mem_usage, itself needing accelerate."""
    import importlib.util

    if importlib.util.find_spec("accelerate") is not None:
        return
    import diffusers

    classes = {k: getattr(diffusers, str(v[1]), None) for k, v in index.items()
               if isinstance(v, list) and len(v) == 2 and v[0] == "diffusers"}
    need = [f"{k} ({type_.__name__})" for k, type_ in classes.items()
            if getattr(type_, "_keep_in_fp32_modules", None)]
    if need:
        raise ModelProblem(f"--model {str(path)!r}: diffusers loads {', '.join(need)} only with the "
                           "accelerate package (its float32-kept modules need low_cpu_mem_usage); install "
                           "it: pip install accelerate (or tilewise[video])")


def _check_parts(pipe: Any, path: Path, scheduler: str) -> None:
    """Refuse a pipeline without a UNet or transformer beside a VAE, or --scheduler for a transformer."""
    denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
    if denoiser is None or getattr(pipe, "vae", None) is None:
        raise ModelProblem(
            f"{type(pipe).__name__} from {str(path)!r} has no unet or transformer beside a vae: tilewise "
            "needs a diffusers pipeline with a UNet (SD 1.x / 2.x, SDXL) or a transformer (SD3, Flux, ...)"
        )
    if scheduler != "ddim" and getattr(pipe, "unet", None) is None:
        raise BadRequest(
            f"--scheduler {scheduler} applies to UNet pipelines; {type(pipe).__name__} keeps its own "
            f"{type(pipe.scheduler).__name__}"
        )


def _set_scheduler(pipe: Any, scheduler: str) -> None:
    """The pipeline's scheduler replaced by the named one (`SCHEDULERS`), from the pipeline's config."""
    import diffusers

    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {sorted(SCHEDULERS)}, got {scheduler!r}")
    pipe.scheduler = getattr(diffusers, SCHEDULERS[scheduler]).from_config(pipe.scheduler.config)




def vae_class(model: str | os.PathLike | None) -> str | None:
    """The VAE class a --model folder names (a VAE folder's config.json, or a pipeline's model_index.json:
    its VAE component, `folders.vae_component`), read from its JSON without loading anything; None for
    the embedded model, a file, no VAE entry, or JSON that does not parse (loading then says what is
    wrong with it). A pipeline folder with two VAE components and no "vae" is a ModelProblem."""
    if model is None or not Path(model).is_dir():
        return None
    path = Path(model)
    try:
        if (path / "config.json").is_file() and not (path / "model_index.json").is_file():
            name = json.loads((path / "config.json").read_text()).get("_class_name")
            return name if isinstance(name, str) else None
        if (path / "model_index.json").is_file():
            index = json.loads((path / "model_index.json").read_text())
            part = vae_component(index, path) if isinstance(index, dict) else None
            return None if part is None else components(index)[part]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return None


def _vae_part(path: Path | None) -> str:
    """The subfolder of a pipeline folder's VAE ("vae", or Kandinsky's movq, LDM's vqvae, ...)."""
    if path is None or not (path / "model_index.json").is_file():
        return "vae"
    try:
        index = json.loads((path / "model_index.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "vae"
    return (vae_component(index, path) if isinstance(index, dict) else None) or "vae"


def load_vae(
    model: str | os.PathLike | None = None,
    *,
    config: str | os.PathLike | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    local_files_only: bool = True,
):
    """The VAE of --model for decode / encode: a VAE folder (config.json of a diffusers VAE class) loaded
    alone; a pipeline folder whose VAE is a 3-D VAE (Qwen-Image, Wan, LTX-Video) or an image VAE other
    than AutoencoderKL / AutoencoderTiny (Flux.2, Sana's DC-AE, Qwen-Image 2.1, ...), or sits in another
    component than vae/ (Kandinsky's movq, LDM's vqvae: `folders.vae_component`): that folder alone (no
    transformer or text encoder); anything else as `load_pipeline` loads it (its .vae)."""
    import diffusers

    torch_dtype = _torch_dtype(dtype)
    name = vae_class(model)
    path = None if model is None else Path(model)
    part = _vae_part(path)  # (a VAE in another component than vae/ loads alone: the pipeline has no .vae)
    if path is not None and path.is_dir() and not (path / "model_index.json").is_file() and name is not None:
        check_vae_class(name, f"{str(path)!r}")
        if config is not None:
            raise BadRequest(f"--config {str(config)!r} applies to a single-file --model only, but --model "
                             f"{str(path)!r} is a VAE folder (it carries its own config)")
        with model_errors(f"VAE folder {str(path)!r}"):
            vae = getattr(diffusers, name).from_pretrained(path, local_files_only=local_files_only)
    elif name is not None and config is None and (name in ALONE_VAES or part != "vae"):
        check_vae_class(name, f"the {part} of {str(path)!r}")
        with model_errors(f"the VAE of {str(path)!r}", folder=path):
            vae = getattr(diffusers, name).from_pretrained(path, subfolder=part,
                                                           local_files_only=local_files_only)
    else:
        return load_pipeline(model, config=config, device=device, dtype=dtype,
                             local_files_only=local_files_only).pipe.vae
    vae = vae.to(device)  # (cast only when asked: diffusers' to(dtype) warns about its float32 modules)
    return (vae if vae.dtype == torch_dtype else vae.to(torch_dtype)).eval()
