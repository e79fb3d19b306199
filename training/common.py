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


def denoiser_args(doc: str, steps: int, batch: int, bank: int, uncond: float, uncond_help: str):
    """The command line of a denoiser training script (train_unet.py, train_controlnet.py), parsed."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--bank", type=int, default=bank, help="number of pre-encoded crops")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--uncond", type=float, default=uncond, help=uncond_help)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(MODELS_DIR))
    return ap.parse_args()


def clipped_step(opt, loss, params, max_norm: float = 1.0) -> None:
    """One optimiser step on `loss` with the gradient norm of `params` clipped to `max_norm`."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()


def load_weights(module: torch.nn.Module, path: Path) -> torch.nn.Module:
    """Load safetensors weights into a float32 module (strict)."""
    from safetensors.torch import load_file

    sd = {k: v.float() for k, v in load_file(str(path)).items()}
    module.load_state_dict(sd, strict=True)
    return module
