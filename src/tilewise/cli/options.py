"""The typed options the commands share: choice enums, annotated option types, and the WxH parser."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from ..errors import BadRequest
from . import checks


class Method(str, Enum):
    multidiffusion = "multidiffusion"
    mixture = "mixture"
    spot = "spot"


class Mode(str, Enum):
    exact = "exact"
    fast = "fast"


class Staging(str, Enum):
    auto = "auto"
    device = "device"
    host = "host"
    disk = "disk"


class Scheduler(str, Enum):
    ddim = "ddim"
    euler = "euler"
    euler_a = "euler_a"
    dpm = "dpm"


class Policy(str, Enum):
    pad = "pad"
    resize = "resize"
    crop = "crop"
    auto = "auto"


Model = Annotated[
    Path | None,
    typer.Option(
        help="diffusers pipeline folder or .safetensors checkpoint (default: the embedded model), "
        "e.g. --model sd15-folder or --model sd15.safetensors --config sd15-folder"
    ),
]
Config = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="diffusers pipeline folder (model_index.json, configs, tokenizer) of the same architecture "
        "as a single-file --model; needed offline, e.g. --model sd15.safetensors --config sd15-folder",
    ),
]
Device = Annotated[
    str, typer.Option(help="torch device, e.g. cpu, cuda, cuda:1; auto: cuda when one is present, else cpu")
]
DType = Annotated[
    str, typer.Option(help="float32 | float16 | bfloat16 (keep the VAE in float32 on fp16 overflow)")
]
Report = Annotated[
    Path | None,
    typer.Option("--report", help="write a run folder with plan, pictures and an HTML report here"),
]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="no progress bars")]
NoClobber = Annotated[
    bool,
    typer.Option("--no-clobber", help="refuse to replace an existing output file (by default it is replaced "
                 "only once the new one is complete)"),
]
Nproc = Annotated[
    int,
    typer.Option(
        min=1,
        help="processes to split the tiles over (one per GPU), launched with torchrun on this machine; "
        "rank 0 writes the output. Several machines: run torchrun yourself, e.g. torchrun --nnodes 2 "
        "--nproc-per-node 8 --rdzv-endpoint HOST:29500 -m tilewise.cli generate ...",
    ),
]


def resolve_device(device: str, present: bool = True) -> str:
    """The torch device a command runs on (or plans for): "auto" is CUDA when one is present (under
    torchrun the rank's own, cuda:LOCAL_RANK), else the CPU. `present`: the device must be on this
    machine (`checks.device`; plans need not run where they are made)."""
    import torch  # (lazy: `tilewise --help` must not import torch, ~2 s)

    if device == "auto":
        if not torch.cuda.is_available():
            return "cpu"
        return f"cuda:{os.environ['LOCAL_RANK']}" if "LOCAL_RANK" in os.environ else "cuda"
    if present:
        checks.device(device)
        return device
    try:
        torch.device(device)
    except (RuntimeError, ValueError):
        raise BadRequest(f"--device {device!r} is not a torch device: give auto, cpu, cuda or cuda:N") \
            from None
    return device


def parse_size(text: str, option: str = "size") -> tuple[int, int]:
    """'WxH' -> (W, H), both positive."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise BadRequest(f"{option} {text!r} must look like WIDTHxHEIGHT, e.g. 1024x768") from None
    if w < 1 or h < 1:
        raise BadRequest(f"{option} {text!r}: width and height must be positive, e.g. 1024x768")
    return w, h
