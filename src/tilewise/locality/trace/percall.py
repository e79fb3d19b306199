"""Values a traced program reads that its call computes from inputs other than the tiled one (LTX-Video
0.9.1+'s decode timestep: its embedding, the per-channel scales and shifts of the decoder's norms,
pointwise in space): the recorded calls that make them, replayed once per call on the call's inputs
(untiled, tiny), and read by the program's ops from `current` while the call runs (`bound`). A program
lowered for one call's inputs is never run with another's values baked in."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .capture import Capture, Ref
from .measured import SIZE_CALLS, _batch_size


@dataclass
class CallValues:
    """The per-call values of a program (module docstring): the recorded calls making them (`calls`, in
    order; every live call that does not read the tiled input), the inputs they read per call (`inputs`:
    nodes, `names`: the call's argument names), the example's batch (a size of it in a recorded view or
    reshape is the call's batch)."""

    cap: Capture
    calls: list[int]
    inputs: list[int]
    names: tuple[str, ...]
    batch: int = 1
    nodes: set[int] = field(default_factory=set)  # the values made (what ops may read)
    current: dict[int, torch.Tensor] = field(default_factory=dict)  # the running call's values

    def __post_init__(self):
        self.nodes = {n for i in self.calls for n in self.cap.calls[i].outs}

    def value(self, node: int) -> torch.Tensor:
        """The running call's value of a node (RuntimeError outside a call's `bound`)."""
        if node not in self.current:
            raise RuntimeError(f"this program reads values its call computes from {', '.join(self.names)}: "
                               f"run it under program.call.bound({', '.join(self.names)})")
        return self.current[node]

    def evaluate(self, *xs: torch.Tensor, batch: int | None = None,
                 grad: bool = False) -> dict[int, torch.Tensor]:
        """The values of a call whose per-call inputs are xs (the recorded calls replayed on them) and
        whose tiled input has `batch` samples (default: the first input's first size); `grad`: replayed
        with autograd (their graph reaches xs and the parameters they read)."""
        if len(xs) != len(self.inputs):
            raise ValueError(f"{len(self.inputs)} per-call inputs ({', '.join(self.names)}), got {len(xs)}")
        env = dict(zip(self.inputs, xs, strict=True))
        if batch is None:
            batch = int(xs[0].shape[0]) if xs[0].ndim else 1
        device = xs[0].device
        values = self.cap.values

        with torch.set_grad_enabled(grad):
            for i in self.calls:
                c = self.cap.calls[i]
                args, kwargs = _bind(c.args, env, values, device), _bind(c.kwargs, env, values, device)
                if c.name in SIZE_CALLS:
                    args = _batch_size(args, self.batch, batch)
                out = c.func(*args, **kwargs)
                env.update(zip(c.outs, [out] if isinstance(out, torch.Tensor) else list(out), strict=False))
        return {n: env[n] for n in self.nodes}

    @contextmanager
    def bound(self, *xs: torch.Tensor, batch: int | None = None, grad: bool = False) -> Iterator[None]:
        """The program's ops read this call's values (computed here, once; `grad`: with autograd) while
        the block runs."""
        self.current = self.evaluate(*xs, batch=batch, grad=grad)
        try:
            yield
        finally:
            self.current = {}


def _bind(obj, env: dict, values: dict, device):
    """A recorded argument on the call's values (`env`; else as recorded), the trace's meta device made
    the call's (a module-level function: a recursive closure would keep `env` alive in a cycle)."""
    if isinstance(obj, Ref):
        return env[obj.node] if obj.node in env else values[obj.node]
    if isinstance(obj, torch.device) and obj.type == "meta":  # (made on the trace's meta device)
        return device
    if isinstance(obj, dict):
        return {k: _bind(v, env, values, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_bind(v, env, values, device) for v in obj)
    return obj


def per_call(cap: Capture, live: set[int], names: tuple[str, ...]) -> CallValues | None:
    """The per-call values of a capture whose inputs after the first are given per call (None: none)."""
    if len(cap.inputs) < 2:
        return None
    tiled = {cap.input}
    for call in cap.calls:
        if tiled.intersection(call.refs()):
            tiled.update(call.outs)
    calls = [i for i, c in enumerate(cap.calls) if i in live and not tiled.intersection(c.outs)]
    return CallValues(cap, calls, list(cap.inputs[1:]), names, int(cap.values[cap.input].shape[0]))
