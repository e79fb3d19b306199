"""A video program: a tile program over the frames of one causal step, with the model's step structure.

The ops are those of `ops3d` (and the 2-D pointwise and add ops) over (B, C, t, H, W) values; the
program's spatial structure (shapes, channels, segments, halos) is a 2-D program's. What time adds is
here: which input frames each causal step takes (`chunks`), how many frames every value has in every
step (`frames`), and the untiled reference run, step after step with the caches over the whole frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ops3d import StepContext, frames_of
from .program import Program


@dataclass
class VideoProgram(Program):
    """A tile program over the frames of one causal step, with the model's step structure: `first` input
    frames in step 0, then `every` per step (0: one step holds every frame), frames of an incomplete
    last step dropped when `drop` (as the model does). `chunked`: the steps are the model's own calls of
    a chunked loop (CogVideoX's `_decode` / `_encode`): `every` frames a call, the first taking the
    remainder too (max(T // every, 1) calls; with `tail`, KVAE's: the first `first` frames, the last the
    remainder), its reductions over a call's frames (GroupNorms) the step's,
    and the program traced on the first call (`trace`: its first frame apart is the first step's)."""

    first: int = 1
    every: int = 1
    drop: bool = False
    chunked: bool = False
    tail: bool = False  # (chunked) the first call takes `first` frames, the last the remainder (KVAE's)

    def chunks(self, frames: int) -> list[tuple[int, int]]:
        """Input frame ranges [a, b) of the causal steps for an input of `frames` frames."""
        if not self.every:
            return [(0, frames)]
        if self.chunked and not self.tail:
            n = max(frames // self.every, 1)
            a = frames - self.every * (n - 1)
            return [(0, a)] + [(a + self.every * k, a + self.every * (k + 1)) for k in range(n - 1)]
        out, a = [(0, min(self.first, frames))], self.first
        while a < frames and not (self.drop and a + self.every > frames):
            out.append((a, min(a + self.every, frames)))
            a += self.every
        return out

    def frames(self, chunks: list[tuple[int, int]]) -> dict[str, list[int]]:
        """Frames of every value in every step."""
        out: dict[str, list[int]] = {}
        for k, (a, b) in enumerate(chunks):
            ts = {self.input: b - a}
            for op in self.ops:
                ts[op.dst] = frames_of(op, [ts[s] for s in op.src], k)
            for v, t in ts.items():
                out.setdefault(v, []).append(t)
        return out

    def run_steps(self, x, ctx: StepContext | None = None):
        """Untiled reference: every step on the whole frame, caches over the whole frame."""

        ctx = ctx or StepContext()
        chunks = self.chunks(x.shape[2])
        outs = []
        for k, (a, b) in enumerate(chunks):
            ctx.step, ctx.last = k, k == len(chunks) - 1
            outs.append(self.run(x[:, :, a:b], ctx))
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]

    def call_ops(self, step: int) -> list[tuple[str, str, int]]:
        """What a chunked program computes in its call `step` (0: its first, 1: one after it): (kind,
        description, frames made) of every op making frames there, less those that pass their one input's
        frames on whole (a first call's other frames after it, their concatenation with its empty first
        frame), in order of description. A program traced on its first call runs a later call as that
        call's own trace does where `call_ops(1)` is the latter's `call_ops(0)` (`vae.families` checks)."""
        frames = self.frames([(0, self.first), (self.first, self.first + self.every)])
        out = []
        for op in self.ops:
            made, ins = frames[op.dst][step], [frames[v][step] for v in op.src]
            passes = getattr(op, "label", None) == "frames 1:" and step > 0 or op.kind.value == "cat" and \
                len(ins) > 1 and sorted(ins)[:-1] == [0] * (len(ins) - 1)
            desc = op.describe()
            if step > 0 and desc.startswith("frames 1:, "):  # (merged with what follows: that, after step 0)
                desc = desc[len("frames 1:, "):]
            if made and not passes:
                out.append((op.kind.value, desc, made))
        return sorted(out)
