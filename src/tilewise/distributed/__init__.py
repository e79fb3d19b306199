"""Tile-parallel transport over torch.distributed: groups, tile sharding, fused reductions, a spawner.

Every rank plans the same tiles, runs only its shard (`shard`), and the ranks combine what they computed
with one collective: the value and weight buffers of a blending accumulator are summed in one packed
all-reduce (`all_reduce_accumulator`, float64 by default, so the sum hardly depends on how the tiles were
split); exact GroupNorm moments are merged with Chan et al.'s pairwise update in rank order
(`all_merge_moments`); variable-length pieces (attention keys/values) are concatenated in rank order
(`all_gather_cat`); the halo rows a rank's next tiles read are fetched from the ranks that computed
them, each pixel once (`exchange_boxes`, also the gather of an output to rank 0). Collectives run on CPU
tensors for gloo and on the current CUDA device for NCCL.

Multi-GPU (NCCL), one process per GPU, launched by PyTorch's own launcher:

    torchrun --standalone --nproc-per-node 2 -m tilewise.cli generate --prompt grass --width 4096 ...

Each rank calls `init_from_env()` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set by torchrun; NCCL
when CUDA is available, else gloo; the CUDA device is LOCAL_RANK) and builds its denoiser and VAE with
`TiledDenoiser(..., process_group="default")` and `TiledVAE(..., process_group="default")`; every rank
then holds the same latents and image, and rank 0 alone writes the output (`TiledVAE.decode_to` streams
the other ranks' rows through rank 0; `tilewise.vae.run.sharding` has the VAE's row-band plan). `tilewise
generate|decode ... --nproc N` is that line made for you: the CLI re-executes itself as
`torchrun_command(sys.argv[1:], N)`, i.e. `python -m tilewise.distributed.torchrun --standalone
--nproc-per-node=N -m tilewise.cli ...` with `--nproc` removed (torchrun, ending on a signal without its
traceback), so one machine needs no launcher of its
own; several machines use torchrun's `--nnodes/--rdzv-endpoint` directly. torchrun stops every worker
when one exits with an error and prints that worker's traceback.

Failure: `init_process_group` gets a timeout, so a collective that a dead or diverged rank never joins
raises instead of hanging; `spawn` (tests, benchmarks) stops every rank as soon as one raises and
re-raises in the parent as `RankError` with that rank's traceback.

One file per job: `groups` (resolving a process group, rank and world, the collective device),
`shards` (which tiles a rank runs), `collectives` (reductions, gathers, moments, broadcast, barrier),
`boxes` (halo exchange) and `launch` (torchrun, `spawn`); this package re-exports them.
"""

from __future__ import annotations

# `X as X`: private names other modules use through this package, re-exported on purpose:
# tilewise.vae.run.sharding (_comm_device, _global), tests/test_distributed.py (_disjoint_union,
# _first_failure)
from ..geometry import Box
from .boxes import _disjoint_union as _disjoint_union
from .boxes import exchange_boxes, exchange_plan
from .collectives import (
    all_gather_cat,
    all_merge_moments,
    all_reduce_accumulator,
    all_reduce_max,
    all_reduce_sum,
    barrier,
    broadcast,
    merge_moments,
)
from .groups import BACKENDS, DEFAULT_TIMEOUT, rank_world, resolve_group
from .groups import _comm_device as _comm_device
from .groups import _global as _global
from .launch import START_METHODS, RankError, free_port, init_from_env, spawn, torchrun_command
from .launch import _first_failure as _first_failure
from .shards import shard

__all__ = ["BACKENDS", "DEFAULT_TIMEOUT", "START_METHODS", "Box", "RankError", "all_gather_cat",
           "all_merge_moments", "all_reduce_accumulator", "all_reduce_max", "all_reduce_sum", "barrier",
           "broadcast", "exchange_boxes", "exchange_plan", "free_port", "init_from_env", "merge_moments",
           "rank_world", "resolve_group", "shard", "spawn", "torchrun_command"]
