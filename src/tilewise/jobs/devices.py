"""Where a job's runner puts its model: the device named, or for 'auto' the one where the runner runs."""

from __future__ import annotations


def worker_device(device: str | None) -> str:
    """The device a runner loads its model on: 'auto' (or None) is resolved in the process that runs it,
    so that a Ray worker given a GPU (CUDA_VISIBLE_DEVICES set by Ray) uses it: 'cuda', else 'cpu'."""
    if device in (None, "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
