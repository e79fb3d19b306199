"""The driver: capture, place every live call (rules, else measured), schedule (package docstring)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..build import LoweringError
from ..program import Program
from .capture import capture, needed
from .measured import enclosing, inline_region, opaque
from .rules import lower_call
from .schedule import live_ops, schedule
from .state import Lowering, is_attention, tainted


def lower_traced(root: torch.nn.Module, run: Callable, example: torch.Tensor, units=None,
                 name: str | None = None) -> Program:
    """The tile program of `run(x)`, a computation of `root` (`root(x)`, `vae.decode(x).sample`, ...),
    as it computes on `example` (module docstring); `units`: modules whose calls are lowered whole
    (default: diffusers' Attention)."""
    try:
        cap = capture(root, run, (example,), units or is_attention)
    except Exception as e:  # (its forward on the example: a 3-D module given 4-D values, a value test, ...)
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise LoweringError(f"cannot lower {type(root).__name__}: running it on an example of shape "
                            f"{tuple(example.shape)} (meta) failed: {why}. Use "
                            "tilewise.probe_receptive_field(module, example) to measure its locality "
                            "empirically.") from None
    low = Lowering(cap, root)
    live = needed(cap)
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
    return Program(ops=ops, input="input", output=out, in_channels=int(example.shape[1]),
                   name=name or type(root).__name__)
