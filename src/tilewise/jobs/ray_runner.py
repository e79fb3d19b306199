"""The batch jobs on a Ray cluster (Ray Data): one pipeline replica per worker, outputs as one process makes.

Each item (a prompt line, an input image, a cache shard) is one row of a Ray Data dataset, mapped by a
task that makes the item's output file exactly as `jobs.batch.run_item` does in one process (same code,
same seeds, so the same bytes). A worker process builds its runner (loads the model) on its first task
and keeps it for the next ones (`_RUNNERS`): one replica per worker, each task `num_cpus` CPUs (and
`gpus_per_worker` GPUs where there are GPUs), at most `workers` at once.

When a worker dies mid-job (killed, out of memory in the OS, its machine gone), Ray runs its task again
(`max_retries`): outputs are written under a temporary name and renamed when complete, and a task skips
an item whose output is there, so nothing is lost and nothing is written twice. Ray is the optional
`tilewise[ray]` extra; it is imported only here, and without it the commands say how to install it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import BadRequest
from .batch import BatchItem, BatchResult, RunnerFactory, collect, run_item

logger = logging.getLogger(__name__)

_RUNNERS: dict[Any, Any] = {}  # in each worker process: factory -> its runner (the model, loaded once)


def _ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401  (Ray Data: `ray[data]`)
    except ImportError:
        raise BadRequest("--ray needs Ray Data, which is not installed: pip install 'tilewise[ray]' "
                         "(or pip install 'ray[data]')") from None
    return ray


def _apply(row: dict[str, Any], factory: Any, out_dir: str) -> dict[str, Any]:
    """One item in a Ray task: the worker's runner (built on its first task), then `run_item`."""
    runner = _RUNNERS.get(factory)
    if runner is None:
        runner = _RUNNERS[factory] = factory()
    item = BatchItem(row["name"], json.loads(row["spec"]), row["error"] or None)
    r = run_item(runner, item, out_dir)
    return {"name": r["name"], "status": r["status"], "error": r["error"] or "", "pid": os.getpid()}


class RayRunner:
    """Where and how wide the jobs run: `address` 'local' (start Ray on this machine), 'auto' (join the
    running cluster) or a cluster address; `workers` pipeline replicas (default: the cluster's GPUs, else
    its CPUs / num_cpus); `max_retries` reruns of a task whose worker died; `wrap` (optional) takes each
    job's RunnerFactory and returns the picklable factory the workers call instead (instrumentation:
    timing, fault injection in tests)."""

    def __init__(self, address: str = "local", workers: int | None = None, *, num_cpus: float = 1,
                 gpus_per_worker: float | None = None, max_retries: int = 3, local_cpus: int | None = None,
                 wrap: Any = None):
        if not isinstance(address, str) or not address:
            raise BadRequest(f"--ray must be 'local', 'auto' or a cluster address, got {address!r}")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise BadRequest(f"workers must be a positive integer, got {workers!r}")
        self.address, self.workers, self.num_cpus = address, workers, num_cpus
        self.gpus_per_worker, self.max_retries, self.local_cpus = gpus_per_worker, max_retries, local_cpus
        self.wrap = wrap

    def start(self) -> Any:
        """Ray, connected (an already initialised Ray is used as it is)."""
        ray = _ray()
        if ray.is_initialized():
            return ray
        # workers import tilewise from where this process does (a source checkout, an editable install)
        here = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
        env = {"env_vars": {"PYTHONPATH": path}}
        if self.address == "local":
            ray.init(num_cpus=self.local_cpus, runtime_env=env, include_dashboard=False,
                     logging_level=logging.WARNING)
        else:
            ray.init(address=self.address, runtime_env=env, logging_level=logging.WARNING)
        return ray

    def _width(self, ray: Any) -> tuple[int, float]:
        """(replicas, GPUs each): a GPU each where the cluster has GPUs."""
        res = ray.cluster_resources()
        gpus = int(res.get("GPU", 0))
        per = self.gpus_per_worker if self.gpus_per_worker is not None else (1.0 if gpus else 0.0)
        n = self.workers or (gpus if gpus else max(1, int(res.get("CPU", 1) // self.num_cpus)))
        return n, per

    def run(self, factory: RunnerFactory, items: Sequence[BatchItem],
            out_dir: str | os.PathLike) -> BatchResult:
        """Every item as a Ray task (one row per block), outputs under out_dir; the rows collected."""
        ray = self.start()
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        kept = [it for it in items if (Path(out_dir) / it.name).exists()]
        todo = [it for it in items if not (Path(out_dir) / it.name).exists()]
        rows = [{"name": it.name, "status": "kept", "error": ""} for it in kept]
        if todo:
            n, gpus = self._width(ray)
            logger.info("ray: %d items on %d workers (%g GPU each), %d kept", len(todo), n, gpus, len(kept))
            ds = ray.data.from_items([{"name": it.name, "spec": json.dumps(it.spec), "error": it.error or ""}
                                      for it in todo], override_num_blocks=len(todo))
            factory = factory if self.wrap is None else self.wrap(factory)
            ds = ds.map(_apply, fn_kwargs={"factory": factory, "out_dir": os.fspath(out_dir)},
                        compute=ray.data.TaskPoolStrategy(size=n), num_cpus=self.num_cpus,
                        num_gpus=gpus or None, max_retries=self.max_retries)
            rows += [{k: r[k] for k in ("name", "status", "error")} for r in ds.take_all()]
        return collect(rows, time.perf_counter() - t0)

    def encode_shards(self, config: dict[str, Any], todo: Sequence[Any], out_dir: str | os.PathLike) -> None:
        """The latent cache's pending shards, one task each (`cache.ShardRunner` in every worker)."""
        items = [BatchItem(s.name, {"bucket": list(s.bucket), "indices": list(s.indices)}) for s in todo]
        result = self.run(RunnerFactory("encode", json.dumps(config)), items, out_dir)
        if result.failed:
            raise RuntimeError(f"cache shards failed on Ray: {result.failed}")
