"""What a module computes, captured: every torch call its forward makes on an example input, in order.

`capture(module, example)` runs the forward once under a `TorchFunctionMode` and records each outermost
torch call that returns tensors (`F.conv2d`, `F.group_norm`, `F.silu`, `x + y`, `x.view(...)`, ...) with
its arguments, tensors replaced by references (`Ref`) to the values they are: the input, the outputs of
earlier calls, or constants (parameters, buffers, tensors the forward made). Module hooks tag every call
with the module path it ran in, and record the calls of the modules a lowering treats as units
(`units`: diffusers' Attention, ...) as one call of the module itself. Python control flow is
specialised to the example's shape, as it ran.

`trace.lower` builds a tile program from the record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class Ref:
    """A tensor argument: the value `node` (of the capture's `values`)."""

    node: int


@dataclass
class Call:
    """One recorded call: `func(*args, **kwargs)` (tensors as `Ref`s) made `outs` (value nodes, in the
    order the result flattens to; `structure`: "tensor" or "tuple"), inside module `where`. A unit's
    call has `module` set (func is the module)."""

    func: Any
    args: tuple
    kwargs: dict
    outs: list[int]
    structure: str
    where: str
    module: torch.nn.Module | None = None

    @property
    def name(self) -> str:
        if self.module is not None:
            return type(self.module).__name__
        return getattr(self.func, "__name__", str(self.func))

    def refs(self) -> list[int]:
        """The value nodes this call reads (positional and keyword tensor arguments, nested)."""
        found: list[int] = []
        _walk((self.args, self.kwargs), lambda r: found.append(r.node))
        return found


@dataclass
class Span:
    """One module call of the forward: the module, its path, its tensor arguments (nodes), its output
    nodes, and the recorded calls [first, last) made inside it."""

    module: torch.nn.Module
    path: str
    args: tuple
    kwargs: dict
    outs: list[int] = field(default_factory=list)
    first: int = 0
    last: int = 0

    def refs(self) -> list[int]:
        found: list[int] = []
        _walk((self.args, self.kwargs), lambda r: found.append(r.node))
        return found


@dataclass
class Capture:
    """The record of one forward: its calls, the input and output nodes, every value's tensor as it was
    (`values`: node -> tensor), the constants among them (node -> name: parameters and buffers by their
    module path, other tensors the forward made as "constant")."""

    calls: list[Call] = field(default_factory=list)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    constants: dict[int, str] = field(default_factory=dict)
    input: int = 0
    inputs: list[int] = field(default_factory=list)  # every input's node (`input`: the first)
    output: int = -1
    producer: dict[int, int] = field(default_factory=dict)  # node -> index of the call that made it
    spans: list[Span] = field(default_factory=list)  # every module call (not inside a unit), in order


# calls whose output is a tensor like their first argument (shape, dtype, layout): on the meta device their
# shape needs no computing (group_norm's meta kernel alone costs ~10 ms a call)
_LIKE_INPUT = {torch.nn.functional.group_norm, torch.nn.functional.silu, torch.nn.functional.relu,
               torch.nn.functional.gelu, torch.nn.functional.mish, torch.nn.functional.dropout}


def _run(func, args, kwargs):
    """func on meta arguments (its shape alone where it is that of its input)."""
    if func in _LIKE_INPUT and args and isinstance(args[0], torch.Tensor) and not kwargs.get("inplace"):
        return torch.empty_like(args[0])
    return func(*args, **kwargs)


class _Recorder(TorchFunctionMode):
    def __init__(self, state: _State):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        st = self.state
        margs, mkwargs = st.meta(args), st.meta(kwargs)
        if st.paused:
            return _run(func, margs, mkwargs)
        args_r, kwargs_r = st.refer(args), st.refer(kwargs)  # (before the call: in-place ops re-bind)
        out = _run(func, margs, mkwargs)
        if func is torch.Tensor.__setitem__ and st.writes_input(args_r):  # (the written tensor, re-bound)
            st.record(func, args_r, kwargs_r, margs[0], None)
            return out
        st.record(func, args_r, kwargs_r, out, None)
        return out


@dataclass
class _State:
    cap: Capture
    names: dict[int, str]  # id(parameter or buffer) -> its name
    paused: int = 0
    stack: list[str] = field(default_factory=list)  # module paths of the calls running, innermost last
    pending: tuple = ()  # a unit's arguments, until its call returns
    open: list = field(default_factory=list)  # the spans of the module calls running, innermost last
    by_id: dict[int, int] = field(default_factory=dict)  # id(tensor) -> its latest node
    alive: list[torch.Tensor] = field(default_factory=list)  # (keeps ids from being reused)
    shadows: dict[int, torch.Tensor] = field(default_factory=dict)  # id(real tensor) -> its meta copy
    from_input: set[int] = field(default_factory=set)  # the nodes computed from the inputs so far

    def node(self, t: torch.Tensor) -> int:
        """The node of tensor t (a new constant if no call made it)."""
        n = self.by_id.get(id(t))
        if n is None:
            n = self._new(t)
            self.cap.constants[n] = self.names.get(id(t), "constant")
        return n

    def _new(self, t: torch.Tensor) -> int:
        n = len(self.cap.values)
        self.cap.values[n] = t
        self.by_id[id(t)] = n
        self.alive.append(t)
        return n

    def meta(self, obj):
        """obj with every tensor not on the meta device replaced by a meta copy (kept: one per tensor)."""
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta":
                return obj
            m = self.shadows.get(id(obj))
            if m is None:
                m = self.shadows[id(obj)] = obj.detach().to("meta")
                self.alive.append(obj)
            return m
        if isinstance(obj, dict):
            return {k: self.meta(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(self.meta(v) for v in obj)
        return obj

    def refer(self, obj):
        """obj with every tensor replaced by a Ref to its node."""
        if isinstance(obj, torch.Tensor):
            return Ref(self.node(obj))
        if isinstance(obj, dict):
            return {k: self.refer(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(self.refer(v) for v in obj)
        return obj

    def writes_input(self, args_r: tuple) -> bool:
        """Whether a write `t[index] = value` (refs) writes into or from a value computed from the inputs
        (recorded, as a call making the written tensor anew: `trace.video_writes`; a write of constants
        into a constant, a mask the forward builds, is part of that constant)."""
        found: list[int] = []
        _walk(args_r, lambda r: found.append(r.node))
        return bool(self.from_input.intersection(found))

    def record(self, func, args, kwargs, out, module) -> None:
        tensors = [out] if isinstance(out, torch.Tensor) else (
            [t for t in out if isinstance(t, torch.Tensor)] if isinstance(out, list | tuple) else [])
        if not tensors:
            return
        outs = [self._new(t) for t in tensors]
        call = Call(func, args, kwargs, outs, "tensor" if isinstance(out, torch.Tensor) else "tuple",
                    self.stack[-1] if self.stack else "", module)
        if self.from_input.intersection(call.refs()):
            self.from_input.update(outs)
        for n in outs:
            self.cap.producer[n] = len(self.cap.calls)
        self.cap.calls.append(call)


def capture(root: torch.nn.Module, run: Callable, examples: tuple[torch.Tensor, ...],
            units: Callable[[torch.nn.Module], bool]) -> Capture:
    """Run `run(*xs)` (a computation of `root`, e.g. `root(x)` or `vae.decode(x).sample`) once on the
    `examples` (their meta copies: nothing is computed) and record what it computes (module docstring).
    `units(m)`: whether a submodule's call is recorded as one call of the module itself. The output is
    the tensor `run` returns; `inputs` the examples' nodes (`input` the first)."""
    cap = Capture()
    names = {id(t): n for n, t in [*root.named_parameters(), *root.named_buffers()]}
    st = _State(cap, names)
    cap.inputs = [st._new(x.detach().to("meta")) for x in examples]
    cap.input = cap.inputs[0]
    st.from_input.update(cap.inputs)
    hooks = []
    for path, m in root.named_modules():
        if m is root:
            continue
        hooks.append(m.register_forward_pre_hook(_enter(st, path, m, units(m)), with_kwargs=True))
        hooks.append(m.register_forward_hook(_leave(st, m, units(m)), with_kwargs=True))
    try:
        with torch.no_grad(), _Recorder(st):
            out = run(*(cap.values[n] for n in cap.inputs))
    finally:
        for h in hooks:
            h.remove()
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the computation of {type(root).__name__} returned {type(out).__name__}, not a "
                        "tensor (a whole VAE, or a decoder returning its caches beside its frames: analyze "
                        "the VAE, tw.analyze(vae), which takes its decode / encode as TiledVAE runs them)")
    cap.output = st.node(out)
    return cap


def needed(cap: Capture) -> set[int]:
    """Indices of the calls the output depends on (the others, e.g. a posterior's std, are dead)."""
    want, keep = {cap.output}, set()
    for i in range(len(cap.calls) - 1, -1, -1):
        call = cap.calls[i]
        if want.intersection(call.outs):
            keep.add(i)
            want.update(call.refs())
    return keep


def _enter(st: _State, path: str, m, unit: bool):
    def hook(mod, args, kwargs):
        st.stack.append(path)
        if not st.paused:
            args_r, kwargs_r = st.refer(args), st.refer(kwargs)
            st.open.append(Span(mod, path, args_r, kwargs_r, first=len(st.cap.calls)))
            if unit:
                st.pending = (args_r, kwargs_r)
        else:
            st.open.append(None)
        if unit:
            st.paused += 1
    return hook


def _leave(st: _State, m, unit: bool):
    def hook(mod, args, kwargs, out):
        if unit:
            st.paused -= 1
            if not st.paused:
                a, k = st.pending
                st.record(mod, a, k, out, mod)
        span = st.open.pop()
        if span is not None:
            span.last = len(st.cap.calls)
            span.outs = [st.node(t) for t in (out if isinstance(out, list | tuple) else [out])
                         if isinstance(t, torch.Tensor)]
            st.cap.spans.append(span)
        st.stack.pop()
    return hook


def _walk(obj, fn) -> None:
    if isinstance(obj, Ref):
        fn(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk(v, fn)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _walk(v, fn)
