"""Resolution buckets: bucket sets, explicit pad / resize / crop assignment, batching, measured cost.

Importing this package loads numpy-free, torch-free code only; torch, numpy and matplotlib are imported
inside the functions that need them.
"""

from .assign import Assignment, aspect_error
from .batching import Batch, BatchPlan, batch_by_bucket
from .choice import BucketChoice, choose_buckets
from .planner import BucketPlanner, grid_buckets
from .profiler import BucketProfile, BucketTiming, plot_costs, profile_buckets

__all__ = [
    "Assignment",
    "Batch",
    "BatchPlan",
    "BucketChoice",
    "BucketPlanner",
    "BucketProfile",
    "BucketTiming",
    "aspect_error",
    "batch_by_bucket",
    "choose_buckets",
    "grid_buckets",
    "plot_costs",
    "profile_buckets",
]
