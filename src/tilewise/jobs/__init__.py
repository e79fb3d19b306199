"""Datasets and batch jobs: bucket a dataset, cache its latents, feed a training loop, run batch jobs.

One file per job: `readers` (folders, Hugging Face datasets saved to disk, webdataset shards),
`manifest` (the bucket manifest, JSON lines: `read_manifest`), `bucketing` (`bucket_dataset`), `cache`
(the latent cache: `encode_dataset`), `sampler` (`BucketBatchSampler`), `loaders` (`ManifestDataset`,
`LatentDataset`), `batch` (generate / upscale over many items with one model load), `ray_runner` (the
same jobs on a Ray cluster: the optional `tilewise[ray]` extra), `devices` (where a runner puts its model).

Names resolve lazily (as `tilewise`'s do): the sampler and the loaders import torch, the readers and the
manifest do not.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "open_dataset": "readers", "ImageDataset": "readers",
    "Manifest": "manifest", "ManifestRow": "manifest", "read_manifest": "manifest",
    "bucket_dataset": "bucketing", "BucketResult": "bucketing",
    "encode_dataset": "cache", "EncodeSettings": "cache", "CacheResult": "cache",
    "BucketBatchSampler": "sampler",
    "ManifestDataset": "loaders", "LatentDataset": "loaders",
    "BatchResult": "batch", "generate_batch": "batch", "upscale_batch": "batch", "read_prompts": "batch",
    "RayRunner": "ray_runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tilewise.jobs' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
