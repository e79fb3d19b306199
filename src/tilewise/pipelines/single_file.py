"""A single checkpoint file (.safetensors, .ckpt) via diffusers' from_single_file; no weight left out.

diffusers (~4 s) and torch are imported inside the functions that use them, so that `import
tilewise.pipelines` imports no torch, diffusers or numpy: the CLI's commands import it before they check their
arguments, and a bad argument fails before ~4 s of torch and diffusers imports.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

from safetensors import safe_open

from ..errors import BadRequest, ModelProblem
from .folders import components, shape_mismatch


def load_single_file(path: Path, config: str | os.PathLike | None, local_files_only: bool):
    """One original-format checkpoint through diffusers' from_single_file, configured by a local folder."""
    if config is None:
        if local_files_only:
            # diffusers would infer the model family and fetch its configs from the Hub (it even turns
            # local_files_only off to do so): refuse here, in one line, instead
            raise BadRequest(
                f"--model {str(path)!r} is a single checkpoint: loading it offline needs --config FOLDER, "
                "a local diffusers pipeline folder of the same architecture (model_index.json, component "
                "configs, tokenizer), or downloads allowed (load_pipeline(..., local_files_only=False))"
            )
        from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

        cls = StableDiffusionXLPipeline if "xl" in path.name.lower() else StableDiffusionPipeline
        return cls.from_single_file(str(path), local_files_only=False)
    folder = Path(config)
    cls = _pipeline_class(folder)
    from diffusers.loaders.single_file_utils import SingleFileComponentError

    _check_fits(path, folder)  # before loading: with accelerate, a weight the file lacks fails late as "meta"
    try:
        pipe = cls.from_single_file(str(path), config=str(folder), local_files_only=local_files_only)
    except (RuntimeError, ValueError, SingleFileComponentError) as e:
        if mismatch := shape_mismatch(e):
            key, want, got = mismatch
            detail = f"size mismatch for {key}: the config gives shape {want}, the checkpoint {got}"
        elif isinstance(e, SingleFileComponentError):
            detail = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        else:
            raise
        raise ModelProblem(
            f"--model {str(path)!r} does not fit the architecture of --config {str(folder)!r}: {detail}"
        ) from e
    return pipe


def _checkpoint_shapes(path: Path) -> dict:
    """Every tensor of a checkpoint file as a meta tensor of its shape (weights are not loaded)."""
    import torch

    if path.suffix == ".safetensors":
        with safe_open(str(path), "pt") as f:
            return {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}
    state = torch.load(path, map_location="meta", weights_only=True, mmap=zipfile.is_zipfile(path))
    while "state_dict" in state:
        state = state["state_dict"]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _meta_components(folder: Path) -> dict:
    """{name: meta-device module} of the UNet, VAE and CLIP-L text encoder config folder `folder` lists:
    their weights' names and shapes, nothing allocated."""
    import diffusers
    import torch
    import transformers

    index = json.loads((folder / "model_index.json").read_text())
    out = {}
    for name, cls in components(index).items():
        if cls in ("UNet2DConditionModel", "AutoencoderKL") and (folder / name / "config.json").is_file():
            model_cls = getattr(diffusers, cls)
            with torch.device("meta"):
                out[name] = model_cls.from_config(model_cls.load_config(str(folder / name)))
        elif cls.startswith("CLIPTextModel") and (folder / name / "config.json").is_file():
            config = transformers.CLIPTextConfig.from_pretrained(str(folder / name))
            with torch.device("meta"):
                out[name] = getattr(transformers, cls)(config)
    return out


def _check_fits(path: Path, folder: Path) -> None:
    """Every UNet, VAE and CLIP-L text-encoder weight of the config's architecture is in the checkpoint, in
    its shape (diffusers' key conversion run on shapes only): diffusers loads with strict=False, so a weight
    the file lacks would stay random, and a shape that differs fails deep in the load."""
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_ldm_unet_checkpoint,
        convert_ldm_vae_checkpoint,
    )

    ckpt = _checkpoint_shapes(path)
    for name, module in _meta_components(folder).items():
        kind = type(module).__name__
        if kind == "UNet2DConditionModel":
            converted = convert_ldm_unet_checkpoint(ckpt, module.config)
        elif kind == "AutoencoderKL":
            converted = convert_ldm_vae_checkpoint(ckpt, module.config)
        else:
            converted = convert_ldm_clip_checkpoint(ckpt)  # empty for OpenCLIP layouts (SD 2.x): not checked
            if not converted:
                continue
        have = {k.removeprefix("text_model."): v for k, v in converted.items() if v is not None}
        want = {k.removeprefix("text_model."): v for k, v in module.state_dict().items()}
        for key, tensor in want.items():
            if key in have and tuple(have[key].shape) != tuple(tensor.shape) \
                    and have[key].numel() != tensor.numel():  # (1x1 convolutions stored for linears)
                raise ModelProblem(
                    f"--model {str(path)!r} does not fit the architecture of --config {str(folder)!r}: size "
                    f"mismatch for {key} of the {name}: the config gives shape {list(tensor.shape)}, the "
                    f"checkpoint {list(have[key].shape)}"
                )
        missing = sorted(set(want) - set(have))
        if missing:
            raise ModelProblem(
                f"--model {str(path)!r} lacks {len(missing)} of the {len(want)} {name} weights that --config "
                f"{str(folder)!r} describes (e.g. {missing[0]!r}); they would stay random: give the config "
                "folder of the checkpoint's own architecture"
            )


def _pipeline_class(folder: Path):
    """The pipeline class a diffusers folder names in model_index.json ('_class_name')."""
    import diffusers

    index = folder / "model_index.json"
    if not folder.is_dir() or not index.is_file():
        what = "does not exist" if not folder.exists() else "has no model_index.json"
        raise (BadRequest if not folder.exists() else ModelProblem)(
            f"--config {str(folder)!r} {what}: give a diffusers pipeline folder (model_index.json, "
            "component configs, tokenizer) of the checkpoint's architecture"
        )
    try:
        name = json.loads(index.read_text()).get("_class_name")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise ModelProblem(f"{str(index)!r} is not a valid model_index.json (a JSON object with "
                           f"'_class_name'): {e}") from e
    cls = getattr(diffusers, str(name), None)
    if cls is None or not hasattr(cls, "from_single_file"):
        raise ModelProblem(
            f"{str(index)!r} names pipeline class {name!r}, which diffusers cannot load from a single file"
        )
    return cls
