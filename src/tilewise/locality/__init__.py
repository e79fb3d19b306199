"""locality: lower a module into a tile program, analyse halos and sync points, probe empirically."""

from .analysis import ProbeResult, Report, analyze, probe_receptive_field
from .lowering import LoweringError, chain, lower, lower_conv
from .ops import Add, AttentionCore, Conv, GroupNorm, Op, Pointwise, Resample, RunContext
from .program import Program

__all__ = ["Add", "AttentionCore", "Conv", "GroupNorm", "LoweringError", "Op", "Pointwise", "Program",
           "ProbeResult", "Report", "Resample", "RunContext", "analyze", "chain", "lower", "lower_conv",
           "probe_receptive_field"]
