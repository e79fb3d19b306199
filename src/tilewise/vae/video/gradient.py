"""Exact gradients through a 3-D causal VAE's tiled decode and encode (issue #30): causal steps reversed.

The forward is the frame-order `VideoExecutor` run (the plain run's tiles, staging and boxes) under
no_grad; before each causal step it keeps the causal caches entering that step: every tile's cache
frames of every temporal op, as the run holds them (on the device, or the host with staging="host";
the run replaces a cache with a new tensor each step, so the kept ones are references, not copies).
A step's input frames are a slice of the input, which the graph holds anyway.

The backward walks the steps last to first (`video.reverse`): step s is run again without autograd from
its entering caches, every staged value of the step kept, then its segments are reversed last to first,
each tile by tile from crops of the staged values and the tile's entering caches as leaves, with the
gradients of its output frames and of the caches it leaves (the cache leaves' gradients of step s + 1);
that gives the step's input frames', the parameters' and its entering caches' gradients (carried to step
s - 1). GroupNorm statistics (HunyuanVideo's of the step, Mochi's and Cosmos' of each frame) are leaves
of every tile, their gradients applied to their inputs' after the segment's last tile; a global attention
segment's keys and values of the step are recomputed, their gradients summed over the tiles. A
timestep-conditioned LTX decode's per-call values (`trace.percall`, bound with autograd) are inputs of
the node too: the recomputed steps read them as leaves, their gradients go on through their graph to temb
and the embedders' parameters; so are SVD's AlphaBlender weights (their graph reaching mix_factor).

Held by the backward (planned by `video.backward`, which also picks the tile within a memory budget): the
kept caches of every step (`stored_bytes`, freed step by step as the reverse passes them), one step's
staged values and the gradients of those staged across the segment being reversed, one tile's
recomputed graph, and the gradients of one step's entering and left caches. Process groups are refused
(the reverse runs in one process).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..settings import Job, Place, Settings
from .backward import choose_backward, param_bytes
from .executor import VideoExecutor, _VideoRun
from .fast import FastSplit, fast_split
from .plan import choose_video
from .reverse import StepReverse
from .stores import nbytes
from .units import Order

__all__ = ["run"]


def run(settings: Settings, job: Job, t, vae) -> tuple:
    """(output with its graph, most staged bytes) of a 3-D VAE's job on t (module doc)."""
    if settings.process_group is not None:
        raise RuntimeError(f"TiledVAE {job.kind} of a {job.model} has no backward with a process group (the "
                           "reverse runs in one process); use the wrapped VAE to train")
    if isinstance(fast_split(settings, job, tuple(t.shape)), FastSplit):
        raise RuntimeError(f"TiledVAE {job.kind} of a {job.model} has no backward in fast mode (its "
                           "statistics are estimated by passes of their own); use mode='exact' to train")
    if settings.staging is Place.DISK:
        raise ValueError(f"TiledVAE {job.kind} of a {job.model} with gradients keeps every staged value of "
                         "the step it reverses in memory: staging='disk' is for no_grad calls; use "
                         "staging='auto', 'device' or 'host' (or call it under torch.no_grad())")
    params = tuple(q for q in vae.parameters() if q.requires_grad)
    if settings.memory_budget is None:
        tile, staging, _ = choose_video(settings, job, tuple(t.shape), order=Order.FRAMES)
    else:  # (the largest tile whose forward and backward both fit the budget)
        tile, staging = choose_backward(settings, job, tuple(t.shape), param_bytes(params))
    ex = VideoExecutor(job.program, tile, job.ref, attention=settings.attention, staging=staging,
                       order=Order.FRAMES, device=t.device, query_chunk=settings.query_chunk,
                       progress=settings.progress)
    call = Call(ex)
    values = _call_values(job, call)
    return _Steps.apply(t, call, *params, *values), call.staged_peak


def _call_values(job: Job, call: Call) -> tuple:
    """The running call's per-call values that carry a graph (a timestep-conditioned LTX decode's, bound
    with autograd by `face.bound`: to temb and the embedders' parameters), kept on `call` with the others
    (detached) for the backward, which reads them as leaves; inputs of the autograd node, so their
    gradients continue through that graph."""
    pc = job.program.call
    if pc is None or not pc.current:
        return ()
    call.values = {n: v.detach() for n, v in pc.current.items()}
    call.graphed = tuple(n for n, v in pc.current.items() if v.requires_grad)
    return tuple(pc.current[n] for n in call.graphed)


@dataclass
class Call:
    """One differentiable call: its executor, and what its forward staged and kept."""

    ex: VideoExecutor
    staged_peak: int = 0
    stored_bytes: int = 0  # the caches kept for the backward (every step's)
    used: bool = False
    values: dict = field(default_factory=dict)  # the call's per-call values, detached (`_call_values`)
    graphed: tuple = ()  # those of them that are inputs of the autograd node (their nodes)


def _bar(ex: VideoExecutor, run: _VideoRun, what: str, passes: int = 1):
    """A progress bar over the units of `passes` passes."""
    return tqdm(total=passes * len(run.grid) * len(run.segs) * len(run.chunks), desc=what, unit="unit",
                disable=not ex.progress, leave=False)


def _snapshot(caches: dict) -> dict:
    """The caches entering a step: (segment, tile) -> {id(op): (box, frames)} (references)."""
    return {key: dict(d) for key, d in caches.items()}


def _stored(states: list[dict]) -> int:
    """Bytes of the kept caches (each tensor once)."""
    seen = {id(f): nbytes(f) for st in states for d in st.values() for _, f in d.values()}
    return sum(seen.values())


class _Steps(torch.autograd.Function):
    """The tiled 3-D decode / encode as one autograd node (module doc)."""

    @staticmethod
    def forward(ctx, x, call: Call, *params):
        run = _VideoRun(call.ex, x, None)
        states = []
        bar = _bar(call.ex, run, "tiles x steps")
        try:
            for k in range(len(run.chunks)):
                states.append(_snapshot(run.caches))
                run.step(k, bar)
        finally:
            bar.close()
        call.staged_peak, call.stored_bytes = run.store.peak, _stored(states)
        ctx.call, ctx.x, ctx.states, ctx.params = call, x.detach(), states, params
        return run.out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        if ctx.call.used:
            raise RuntimeError("TiledVAE's 3-D backward frees the kept caches as it runs: a second backward "
                               "through the same call (retain_graph=True) is not supported; call decode / "
                               "encode again")
        call = ctx.call
        call.used = True
        with _leaves(call) as leaves:  # (the per-call values the recomputed steps read, as leaves)
            n = len(ctx.params) - len(leaves)
            rev = StepReverse(call.ex, ctx.x, ctx.states, ctx.params[:n] + leaves, ctx.needs_input_grad[0])
            bar = _bar(call.ex, rev.run, "backward steps", 2)  # (each step recomputed, then reversed)
            try:
                gx, gp = rev.go(grad_out.contiguous(), bar)
            finally:
                bar.close()
        return (gx, None, *gp)


@contextmanager
def _leaves(call: Call):
    """The call's per-call values bound for the program's ops while the backward recomputes (the
    forward's `bound` has closed): those that are node inputs as fresh leaves, which it yields."""
    pc = call.ex.program.call
    if pc is None or not call.values:
        yield ()
        return
    leaves = {n: call.values[n].detach().requires_grad_(True) for n in call.graphed}
    before, pc.current = pc.current, {**call.values, **leaves}
    try:
        yield tuple(leaves.values())
    finally:
        pc.current = before
