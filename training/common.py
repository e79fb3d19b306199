"""Shared helpers of the training scripts: seeding, atomic writes of weights, configs and metrics."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import torch

MODELS_DIR = Path(__file__).resolve().parents[1] / "src" / "tilewise" / "models"
RUNS_DIR = Path(__file__).resolve().parent / "runs"


def seed_everything(seed: int, threads: int) -> np.random.Generator:
    """Seed python, numpy and torch, fix the thread count, return the numpy generator for data."""
    random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    return np.random.default_rng(seed)


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def public_config(config) -> dict:
    """A model's diffusers config without private keys, as plain JSON types."""
    return json.loads(json.dumps({k: v for k, v in dict(config).items() if not k.startswith("_")}))


def save_json(obj, path: Path) -> None:
    """Write JSON atomically (temporary name, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic(path, lambda p: p.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n"))


def save_weights(module: torch.nn.Module, path: Path, dtype=torch.float16) -> None:
    """Write a module's state dict as safetensors in `dtype` (half precision keeps the wheel small)."""
    from safetensors.torch import save_file

    sd = {k: v.detach().to(dtype).contiguous() for k, v in module.state_dict().items()}
    _atomic(path, lambda p: save_file(sd, str(p)))


def load_weights(module: torch.nn.Module, path: Path) -> torch.nn.Module:
    """Load safetensors weights into a float32 module (strict)."""
    from safetensors.torch import load_file

    sd = {k: v.float() for k, v in load_file(str(path)).items()}
    module.load_state_dict(sd, strict=True)
    return module
