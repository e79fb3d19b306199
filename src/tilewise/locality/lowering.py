"""Lower a module into a tile program from what it computes (`trace`). (A whole 3-D VAE's decode or encode,
its causal loop with the caches its calls carry over, is its family's: `vae.families`; a Wan /
Qwen-Image encoder or decoder module lowered here alone runs its frames in one call, without caches, as
its forward does with feat_cache=None.)

`lower(module, example)` traces a module (a diffusers Encoder, Decoder, EncoderTiny, DecoderTiny, an
LTX-Video encoder or decoder, or any module made of the operators `trace` places) on an example input
(made from its first convolution when none is given: a video one for a Conv3d); `lower_conv` is one
convolution; `chain` joins programs.

diffusers' classes are imported inside the functions that check for them: importing diffusers takes ~4 s,
and `tilewise.locality` (the analysis and the empirical probe) works on any module without it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .build import Builder, LoweringError
from .program import Program
from .trace import lower_traced
from .units import conv

__all__ = ["LoweringError", "chain", "example_for", "lower", "lower_conv"]  # LoweringError: from build

EXAMPLE_HW = (13, 11)  # the example's latent-sized sides: uncommon, so a size fixed by the module shows
# a video example's frames: a latent's, and an encoder input's (1 + 16: two chunks of a temporal
# compression up to 8), uncommon too (never a dim index, a patch or a kernel size)
EXAMPLE_FRAMES = (9, 17)


def example_for(module, factor: int = 1) -> torch.Tensor:
    """An example input of a module: its first convolution's channels, EXAMPLE_HW times `factor` (an
    encoder's downsampling), on the meta device; of a module whose first convolution is a Conv3d, a
    video (B, C, T, H, W) of EXAMPLE_FRAMES (an encoder's with factor > 1)."""
    conv = next((m for m in module.modules() if isinstance(m, nn.Conv2d | nn.Conv3d)), None)
    if conv is None:
        raise LoweringError(f"cannot lower {type(module).__name__}: it has no Conv2d or Conv3d to take "
                            "its input channels from; give lower() an example input")
    h, w = EXAMPLE_HW
    frames = (EXAMPLE_FRAMES[factor > 1],) if isinstance(conv, nn.Conv3d) else ()
    channels = conv.in_channels
    p = getattr(module, "patch_size", None)  # (an encoder that patchifies first: LTX-Video's)
    if isinstance(p, int) and getattr(module, "in_channels", None) == channels and channels % (p * p) == 0:
        channels //= p * p
    return torch.empty(1, channels, *frames, h * factor, w * factor, device="meta", dtype=conv.weight.dtype)


def lower(module, example: torch.Tensor | None = None) -> Program:
    """Lower a module into a tile program from what it computes on `example` (module docstring)."""
    if example is None or example.ndim == 5:  # (an encoder's example is image-sized; a video's frames are
        video = example_for(module, 64 if _downsamples(module) else 1)  # uncommon, as its sides are)
        example = video if example is None else video.new_empty((1, example.shape[1], *video.shape[2:]))
    return lower_traced(module, module, example)


def _downsamples(module) -> bool:
    """Whether a module is an encoder: a strided convolution, or a class named one (LTX-Video's encoder
    downsamples by rearranging space into channels)."""
    strided = any(isinstance(m, nn.Conv2d | nn.Conv3d) and max(m.stride[-2:]) > 1 for m in module.modules())
    return strided or "Encoder" in type(module).__name__


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
