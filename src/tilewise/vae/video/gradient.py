"""Exact gradients through a 3-D causal VAE's tiled decode and encode (issue #30): causal steps reversed.

The forward is the frame-order `VideoExecutor` run (the plain run's tiles, staging and boxes) under
no_grad; before each causal step it keeps the causal caches entering that step: every tile's cache
frames of every temporal op, as the run holds them (on the device, or the host with staging="host";
the run replaces a cache with a new tensor each step, so the kept ones are references, not copies).
A step's input frames are a slice of the input, which the graph holds anyway.

The backward walks the steps last to first. Step s is run again with autograd, tiled as the forward ran
it (every segment on every tile, the same boxes and halos, attention keys of the whole frame), from its
input frames and its entering caches as leaves; the gradients of its output frames and of the caches it
leaves (the leaves' gradients of step s + 1) are backed through it in one `autograd.grad`, which gives
the step's input frames', the parameters' and its entering caches' gradients (carried to step s - 1).
A GroupNorm of a video value (HunyuanVideo's) takes its statistics, in the recomputed step, from its
whole staged input with autograd (nn.GroupNorm's gradient through the mean and variance); its programs
have one step, so that step's graph is the whole video's (tiled as the forward ran it). A
timestep-conditioned LTX decode's per-call values (`trace.percall`, bound with autograd) are inputs of
the node too: the recomputed steps read them as leaves, their gradients go on through their graph to temb
and the embedders' parameters; so are SVD's AlphaBlender weights (their graph reaching mix_factor).

Held by the backward (planned by `video.backward`, which also picks the tile within a memory budget): the
kept caches of every step (`stored_bytes`, freed step by step as the reverse
passes them), one step's recomputed graph (all of its tiles: the graph of one causal step, not of the
whole video), and the gradients of one step's caches. Process groups are refused (the reverse runs in
one process).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..settings import Job, Settings
from .backward import choose_backward, param_bytes
from .executor import Order, VideoExecutor, _VideoRun
from .plan import choose_video
from .stores import Store, nbytes

__all__ = ["run"]


def run(settings: Settings, job: Job, t, vae) -> tuple:
    """(output with its graph, most staged bytes) of a 3-D VAE's job on t (module doc)."""
    if settings.process_group is not None:
        raise RuntimeError(f"TiledVAE {job.kind} of a {job.model} has no backward with a process group (the "
                           "reverse runs in one process); use the wrapped VAE to train")
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


def _bar(ex: VideoExecutor, run: _VideoRun, what: str):
    """A progress bar over the units of one pass."""
    return tqdm(total=len(run.layout) * len(run.chunks), desc=what, unit="unit", disable=not ex.progress,
                leave=False)


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
            rev = _Reverse(call.ex, ctx.x, ctx.states, ctx.params[:n] + leaves, ctx.needs_input_grad[0])
            gx, gp = rev.go(grad_out.contiguous())
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


class _StepRun(_VideoRun):
    """A `_VideoRun` that reads the program input from one step's leaf (`xs`: that step's frames)."""

    xs = None

    def _read(self, v: str, k: int, box):
        if v == self.program.input:
            return self.xs[..., box[0] : box[1], box[2] : box[3]].to(self.ex.device, non_blocking=True)
        return super()._read(v, k, box)


class _Reverse:
    """The state of one backward: the recomputing run, the input's and the parameters' gradients."""

    def __init__(self, ex: VideoExecutor, x, states: list[dict], params: tuple, want_x: bool):
        self.ex, self.x, self.states, self.params, self.want_x = ex, x, states, params, want_x
        self.blocks: list = []
        self.run = _StepRun(ex, x, self._emit)
        self.gx = torch.zeros_like(x) if want_x else None
        self.pgrads: list = [None] * len(params)
        self.passed: dict = {}

    def _emit(self, t0: int, box, block) -> None:
        self.blocks.append((t0, box, block))

    def go(self, grad_out):
        carry: dict = {}
        bar = _bar(self.ex, self.run, "backward steps")
        try:
            for s in reversed(range(len(self.run.chunks))):
                carry = self._step(s, grad_out, carry, bar)
                self.states[s] = None  # (this step's kept caches are no longer needed)
        finally:
            bar.close()
        return self.gx, self.pgrads

    def _step(self, s: int, grad_out, carry: dict, bar) -> dict:
        """Step s recomputed with autograd and backed: the gradients of the caches entering it."""
        r, (a, b) = self.run, self.run.chunks[s]
        leaves = {(key, op): (box, f.detach().requires_grad_(True))
                  for key, d in self.states[s].items() for op, (box, f) in d.items()}
        r.caches = {}
        for (key, op), pair in leaves.items():
            r.caches.setdefault(key, {})[op] = pair
        r.store = Store(self.ex.staging, torch.device(self.ex.device))
        r.xs = self.x[:, :, a:b].detach().requires_grad_(self.want_x)
        self.blocks = []
        with torch.enable_grad():
            r.step(s, bar)
        roots, grads = self._roots(grad_out, carry, leaves)
        wrt = [r.xs] if self.want_x else []
        wrt += [f for _, f in leaves.values()] + list(self.params)
        gs = (torch.autograd.grad(roots, wrt, grads, allow_unused=True) if roots else [None] * len(wrt))
        del roots, grads
        r.caches, r.store, r.xs = {}, None, None
        if self.want_x:
            if gs[0] is not None:
                self.gx[:, :, a:b] += gs[0]
            gs = gs[1:]
        out = {k: g for k, g in zip(leaves, gs, strict=False) if g is not None}
        for k, g in self.passed.items():  # (a cache the step left as it found it)
            out[k] = out[k] + g if k in out else g
        self._params(gs[len(leaves):])
        return out

    def _roots(self, grad_out, carry: dict, leaves: dict) -> tuple[list, list]:
        """The step's outputs that need backing and their gradients: its output frames' cores, and the
        caches it leaves with a gradient from the step after (`passed`: those it left untouched)."""
        roots, grads = [], []
        for t0, box, block in self.blocks:
            if block.requires_grad:
                roots.append(block)
                grads.append(grad_out[:, :, t0 : t0 + block.shape[2], box[0] : box[1], box[2] : box[3]])
        self.blocks, self.passed = [], {}
        for key, d in self.run.caches.items():
            for op, (_, f) in d.items():
                g = carry.get((key, op))
                if g is None:
                    continue
                if leaves.get((key, op), (None, None))[1] is f:
                    self.passed[key, op] = g
                elif f.requires_grad:
                    roots.append(f)
                    grads.append(g.to(f.device))
        return roots, grads

    def _params(self, gs) -> None:
        """Add the parameters' gradients of one step (None: not used there)."""
        for i, g in enumerate(gs):
            if g is None:
                continue
            self.pgrads[i] = g if self.pgrads[i] is None else self.pgrads[i].add_(g)
