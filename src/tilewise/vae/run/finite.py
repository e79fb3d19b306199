"""NaN / inf checks of a tiled run: one host synchronisation per segment, the producer named."""

from __future__ import annotations

import torch


class NonFiniteError(FloatingPointError):
    """A NaN or inf appeared in a stage's output (`producer`: the op that made it; `dtype`: its dtype)."""

    def __init__(self, producer: str, dtype):
        why = ("in float16 this is the known SD-VAE overflow: run the VAE in float32 (vae.to(torch.float32)) "
               "or use an fp16-fixed VAE" if str(dtype) == "torch.float16" else
               "not an fp16 overflow: check the input and the VAE's weights for NaN or inf values")
        super().__init__(f"NaN or inf in the output of {producer!r} (dtype {dtype}); {why}")
        self.producer, self.dtype = producer, dtype


class FiniteChecks:
    """NaN / inf checks of one segment's stored values with one host synchronisation per segment.

    Each stored core adds one reduction kept on the device (a float64 sum: finite values cannot overflow
    it); values whose GroupNorm statistics are merged add those instead (a NaN or inf makes them
    non-finite), which costs no pass over the values. `finish` reads them back together and raises
    NonFiniteError naming the first producer whose values were not finite."""

    def __init__(self, enabled: bool = True):
        self.enabled, self.sums, self.names = enabled, [], []

    def add(self, producer: str, *values, dtype=None) -> None:
        """Check values made by `producer` (of `dtype`, when they are its statistics) at `finish`."""
        if self.enabled:
            for t in values:
                self.sums.append(t.sum(dtype=torch.float64))
                self.names.append((producer, dtype or t.dtype))

    def now(self, producer: str, value) -> None:
        """Check at once (a value about to leave for a sink)."""
        if self.enabled and not all_finite(value):
            raise NonFiniteError(producer, value.dtype)

    def finish(self) -> None:
        if not self.sums:
            return
        sums, names = self.sums, self.names
        self.sums, self.names = [], []
        if bool(torch.stack(sums).sum().isfinite()):
            return
        producer, dtype = next(n for n, t in zip(names, sums, strict=True) if not bool(t.isfinite()))
        raise NonFiniteError(producer, dtype)


def check_output(y, program):
    """y, after checking it has no NaN or inf (the untiled path's one check, raised as NonFiniteError)."""
    FiniteChecks().now(f"{program.name} (untiled)", y)
    return y


def all_finite(c) -> bool:
    """True when c has no NaN or inf: a finite sum proves it (one vectorised pass), else check each value."""
    s = c.sum(dtype=torch.float32) if c.dtype in (torch.float16, torch.bfloat16) else c.sum()
    return bool(s.isfinite()) or bool(c.isfinite().all())
