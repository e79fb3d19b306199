"""`tw.analyze` of a whole VAE: the decode or encode program its TiledVAE runs, analysed statically.

`locality.analyze` lowers one module's forward; a diffusers VAE's forward is an encode and a decode with
a sample between, returning a DecoderOutput, and some decoders (Mochi's, CogVideoX's) return their caches
beside their frames, so neither lowers as a module. The VAE's family (`families`) says what its decode
and encode compute, with its own call signature: that program is what the engine tiles, and what is
analysed here. Any other module or program goes to `locality.analyze` unchanged.
"""

from __future__ import annotations

import torch.nn as nn

from ..locality.analysis import Report, analyze_program, cumulative_stride
from ..locality.analysis import analyze as analyze_module
from ..locality.program import Program
from .tiled import TiledVAE


def analyze(module, example_input=None, kind: str = "decode") -> Report:
    """Segments between sync points, their halos, the sync ops and the exact-tileability verdict of
    `module`: a VAE (or a TiledVAE) by its `kind` ("decode" or "encode") program, as the engine tiles it;
    `example_input` (optional) sets the sides analysed and, for a video VAE, the frames of the call (its
    T, (B, C, T, H, W)); any other module lowered from its forward (`locality.analyze`). A VAE family the
    engine refuses raises its reason, by name (LoweringError / ValueError from TiledVAE)."""
    if isinstance(module, Program) or not (isinstance(module, TiledVAE) or _is_vae(module)):
        return analyze_module(module, example_input)
    tv = module if isinstance(module, TiledVAE) else TiledVAE(module, progress=False)
    frames = int(example_input.shape[2]) if example_input is not None and example_input.ndim == 5 else None
    program = tv.program(kind, frames)
    hw = (64, 64) if example_input is None else tuple(int(s) for s in example_input.shape[-2:])
    grow = cumulative_stride(program)  # (large enough that the halo is not clipped, as locality.analyze)
    return analyze_program(program, (max(hw[0], 64 * grow), max(hw[1], 64 * grow)))


def _is_vae(module) -> bool:
    """A whole VAE rather than one of its parts: a module with both a decode and an encode method."""
    return isinstance(module, nn.Module) and callable(getattr(module, "decode", None)) and callable(
        getattr(module, "encode", None))


__all__ = ["analyze"]
