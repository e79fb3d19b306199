"""tilewise: memory-bounded high-resolution diffusion, exact where exactness is possible.

`import tilewise` stays light: public names are resolved lazily from their layer modules on first use,
so torch and diffusers are imported only by the parts that need them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module (relative to this package) that defines it
_EXPORTS: dict[str, str] = {
    # geometry
    "Tile": "geometry",
    "TileGrid": "geometry",
    # blending
    "weight_window": "blending",
    "Accumulator": "blending",
    # sinks
    "TensorSink": "sinks",
    "MemmapSink": "sinks",
    "PNGSink": "sinks",
    "TIFFSink": "sinks",
    "open_sink": "sinks",
    "open_video_sink": "sinks.video",
    # metrics and test patterns
    "compare": "metrics",
    "seam_score": "metrics",
    "tone_drift": "metrics",
    "psnr": "metrics",
    # memory
    "parse_bytes": "memory",
    "format_bytes": "memory",
    "tensor_bytes": "memory",
    "measure_peak": "memory",
    # locality (analyze: a whole VAE's decode / encode program, else a module's, vae.analysis)
    "analyze": "vae.analysis",
    "probe_receptive_field": "locality",
    "lower": "locality",
    # vae
    "TiledVAE": "vae",
    # diffusion
    "TiledDenoiser": "diffusion",
    "TiledControlNet": "diffusion",
    "Region": "diffusion",
    "upscale": "diffusion",
    # buckets
    "BucketPlanner": "buckets",
    "batch_by_bucket": "buckets",
    "profile_buckets": "buckets",
    "choose_buckets": "buckets",
    # jobs: datasets and batch jobs
    "bucket_dataset": "jobs.bucketing",
    "read_manifest": "jobs.manifest",
    "encode_dataset": "jobs.cache",
    "BucketBatchSampler": "jobs.sampler",
    "ManifestDataset": "jobs.loaders",
    "LatentDataset": "jobs.loaders",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tilewise' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover  (every name of _EXPORTS, from the module it names, for type checkers)
    from .blending import Accumulator, weight_window  # noqa: F401
    from .buckets import BucketPlanner, batch_by_bucket, choose_buckets, profile_buckets  # noqa: F401
    from .diffusion import Region, TiledControlNet, TiledDenoiser, upscale  # noqa: F401
    from .geometry import Tile, TileGrid  # noqa: F401
    from .jobs.bucketing import bucket_dataset  # noqa: F401
    from .jobs.cache import encode_dataset  # noqa: F401
    from .jobs.loaders import LatentDataset, ManifestDataset  # noqa: F401
    from .jobs.manifest import read_manifest  # noqa: F401
    from .jobs.sampler import BucketBatchSampler  # noqa: F401
    from .locality import lower, probe_receptive_field  # noqa: F401
    from .memory import format_bytes, measure_peak, parse_bytes, tensor_bytes  # noqa: F401
    from .metrics import compare, psnr, seam_score, tone_drift  # noqa: F401
    from .sinks import MemmapSink, PNGSink, TensorSink, TIFFSink, open_sink  # noqa: F401
    from .sinks.video import open_video_sink  # noqa: F401
    from .vae import TiledVAE  # noqa: F401
    from .vae.analysis import analyze  # noqa: F401
