"""Lower a module into a tile program: from what it computes (`traced`), or for the 3-D causal VAEs by
their known structure (`lowering3d`: the traced lowering does not follow their temporal caches, which
their forwards keep across the calls of a causal loop).

`lower(module, example)` traces a 2-D module (a diffusers Encoder, Decoder, EncoderTiny, DecoderTiny,
or any module made of the operators `traced` places) on an example input (made from its first
convolution when none is given); `lower_conv` is one convolution; `chain` joins programs.

diffusers' classes are imported inside the functions that check for them: importing diffusers takes ~4 s,
and `tilewise.locality` (the analysis and the empirical probe) works on any module without it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .build import Builder, LoweringError
from .lowering3d import is_video_module, lower3d
from .program import Program
from .trace import lower_traced
from .units import conv

__all__ = ["LoweringError", "chain", "example_for", "lower", "lower_conv"]  # LoweringError: from build

EXAMPLE_HW = (13, 11)  # the example's latent-sized sides: uncommon, so a size fixed by the module shows


def example_for(module, factor: int = 1) -> torch.Tensor:
    """An example input of a 2-D module: its first convolution's channels, EXAMPLE_HW times `factor`
    (an encoder's downsampling), on the meta device."""
    conv = next((m for m in module.modules() if isinstance(m, nn.Conv2d)), None)
    if conv is None:
        raise LoweringError(f"cannot lower {type(module).__name__}: it has no Conv2d to take its input "
                            "channels from; give lower() an example input")
    h, w = EXAMPLE_HW
    return torch.empty(1, conv.in_channels, h * factor, w * factor, device="meta", dtype=conv.weight.dtype)


def lower(module, example: torch.Tensor | None = None) -> Program:
    """Lower a module into a tile program: a 3-D causal VAE's encoder or decoder (Qwen-Image, Wan,
    LTX-Video) into a video program, any other from what it computes on `example` (module docstring)."""
    if is_video_module(module):
        return lower3d(module)
    if example is None:  # (a module that downsamples is an encoder: its example is image-sized)
        downsamples = any(isinstance(m, nn.Conv2d) and m.stride[0] > 1 for m in module.modules())
        example = example_for(module, 64 if downsamples else 1)
    return lower_traced(module, module, example)


def lower_conv(module, name: str = "conv") -> Program:
    """Lower a single nn.Conv2d (quant_conv / post_quant_conv) into a one-op program."""
    b = Builder()
    out = conv(b, module, "input", name)
    return Program(ops=b.ops, input="input", output=out, in_channels=module.in_channels, name=name)


def chain(first: Program, second: Program) -> Program:
    """Concatenate two programs: the output of `first` feeds the input of `second`."""
    ops = list(first.ops)
    rename = {second.input: first.output}
    for op in second.ops:
        new_src = tuple(rename.get(s, s) for s in op.src)
        dst = f"{second.name}.{op.dst}"
        rename[op.dst] = dst
        clone = type(op).__new__(type(op))
        clone.__dict__.update(op.__dict__)
        clone.src, clone.dst = new_src, dst
        ops.append(clone)
    return Program(ops=ops, input=first.input, output=rename[second.output], in_channels=first.in_channels,
                   name=f"{first.name}+{second.name}")
