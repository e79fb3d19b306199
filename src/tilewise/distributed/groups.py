"""Process groups: which group a `process_group=` argument names, a rank's place in it, where buffers live."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT = 300.0  # seconds a collective waits for the other ranks


def resolve_group(process_group: Any) -> Any:
    """None (single process), "default" (the initialised default group) or a ProcessGroup -> group or None."""
    if process_group is None:
        return None
    if isinstance(process_group, str):
        if process_group != "default":
            raise ValueError(f"process_group must be None, 'default' or a ProcessGroup, "
                             f"got {process_group!r}")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("process_group='default' needs torch.distributed initialised first (torchrun "
                             "+ tilewise.distributed.init_from_env(), or tilewise.distributed.spawn)")
        return dist.group.WORLD
    if not isinstance(process_group, dist.ProcessGroup):
        raise ValueError(f"process_group must be None, 'default' or a ProcessGroup, "
                         f"got {type(process_group).__name__}")
    return process_group


def rank_world(group: Any) -> tuple[int, int]:
    """(rank, world size) of this process in `group`; (0, 1) without a group."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _backend(group: Any) -> str:
    return str(dist.get_backend(group)).lower()


def _comm_device(group: Any, device: Any) -> Any:
    """Where a collective's buffer must live: the current CUDA device for NCCL, the CPU for gloo."""
    if "nccl" in _backend(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global(group: Any, rank: int) -> int:
    return rank if group is dist.group.WORLD else dist.get_global_rank(group, rank)
