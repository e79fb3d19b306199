"""The driver: capture, place every live call (rules, else measured), schedule (package docstring)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..build import LoweringError
from ..program import Program
from ..program3d import VideoProgram
from .capture import capture, needed
from .measured import enclosing, inline_region, opaque
from .percall import per_call
from .rules import lower_call
from .schedule import live_ops, schedule
from .state import Lowering, is_attention, refused, tainted

RANDOM = {"randn", "rand", "randint", "randn_like", "rand_like", "randint_like", "normal", "bernoulli",
          "multinomial", "randperm", "poisson", "normal_", "uniform_", "exponential_", "bernoulli_"}


def lower_traced(root: torch.nn.Module, run: Callable, example: torch.Tensor, units=None,
                 name: str | None = None, inputs: dict[str, torch.Tensor] | None = None) -> Program:
    """The tile program of `run(x)`, a computation of `root` (`root(x)`, `vae.decode(x).sample`, ...),
    as it computes on `example` (module docstring); `units`: modules whose calls are lowered whole
    (default: diffusers' Attention). Of a video example (B, C, T, H, W): a one-step video program (every
    frame in one step, as the computation ran on them: `trace.video`). `inputs`: the call's other
    inputs by name, with real examples (`run(x, *inputs)`: LTX-Video's decode timestep); what the program
    reads of them is computed once per call (`program.call`: `percall.CallValues`)."""
    inputs = inputs or {}
    try:
        cap = capture(root, run, (example, *inputs.values()), units or is_attention)
    except Exception as e:  # (its forward on the example: a 3-D module given 4-D values, a value test, ...)
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise LoweringError(f"cannot lower {type(root).__name__}: running it on an example of shape "
                            f"{tuple(example.shape)} (meta) failed: {why}. Use "
                            "tilewise.probe_receptive_field(module, example) to measure its locality "
                            "empirically.") from None
    low = Lowering(cap, root)
    live = low.live = needed(cap)
    low.per_call = per_call(cap, live, tuple(inputs))
    if low.per_call is not None:  # (the example's values: the measured ops run on them)
        low.per_call.current = low.per_call.evaluate(*inputs.values())
    drawn = next((c for i, c in enumerate(cap.calls) if i in live and c.name in RANDOM), None)
    if drawn is not None:  # (noise injected by the forward: a fresh draw each call, nothing to be exact to)
        raise refused(low, drawn, "it draws random numbers (noise injection: a fresh draw each call, which "
                      "no tile program reproduces)")
    for i, call in enumerate(cap.calls):
        if i in live:
            for n in call.refs():
                low.readers[n] = low.readers.get(n, 0) + 1
    low.set(cap.input, "input")
    low.tainted = tainted(cap)
    i = 0
    while i < len(cap.calls):
        if i in live:
            try:
                lower_call(low, i, cap.calls[i])
            except LoweringError as e:  # (a run of calls back to a spatial value, or the module around it)
                if getattr(e, "final", False):
                    raise
                end = inline_region(low, i)
                if end is not None:
                    i = end
                    continue
                span = enclosing(low, i)
                if span is None:
                    raise
                opaque(low, span, cap.calls[i])
                i = span.last
                continue
        i += 1
    out = low.spatial(cap.output)
    if out is None:
        raise LoweringError(f"{type(root).__name__}: its output is not a spatial value of the program")
    ops = schedule(live_ops(low.b.ops, out), "input")
    kw = dict(ops=ops, input="input", output=out, in_channels=int(example.shape[1]),
              name=name or type(root).__name__, call=low.per_call)
    if low.per_call is not None:
        low.per_call.current = {}
    if example.ndim == 5:  # (a video value: every frame in one step, as the computation ran)
        return VideoProgram(**kw, first=0, every=0)
    return Program(**kw)
