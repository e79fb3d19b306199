"""The dataset and batch forms of the commands: `buckets DATASET`, `encode DATASET --buckets`, `generate
--prompts`, `upscale DIR`, each maybe `--ray ADDRESS`. The commands parse and check; these call the
library (`tilewise.jobs`) and report. A batch whose items partly failed ends with `SomeFailed` (exit 6).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import BadRequest, SomeFailed

RayAddress = Annotated[
    str | None,
    typer.Option("--ray", help="run on Ray: 'local' starts a cluster on this machine, 'auto' joins the "
                 "running one, or a cluster address; one pipeline replica per worker (needs tilewise[ray])"),
]
Workers = Annotated[int | None, typer.Option(min=1, help="with --ray: pipeline replicas (default: GPUs, else "
                                             "CPUs)")]


def ray_runner(address: str | None, workers: int | None) -> Any:
    """The RayRunner of --ray (Ray checked now: without it the command says how to install it), or None."""
    if address is None:
        if workers is not None:
            raise BadRequest("--workers applies to --ray only")
        return None
    from ..jobs.ray_runner import RayRunner, _ray

    _ray()
    return RayRunner(address, workers)


def out_folder(out: Path, what: str = "--out") -> None:
    """An output folder: not a file; made if missing (its parent must exist)."""
    if out.exists() and not out.is_dir():
        raise BadRequest(f"{what} {str(out)!r} is a file; give a folder (made if missing)")
    if not out.exists() and not out.parent.is_dir():
        raise BadRequest(f"{what} {str(out)!r}: its folder {str(out.parent)!r} does not exist")


def bucket_dataset(dataset: Path, out: Path | None, area: int, step: int, max_aspect: float, policy: str,
                   plot: Path | None, quiet: bool, no_clobber: bool, latent_factor: int = 8) -> Any:
    """`tilewise buckets DATASET --out MANIFEST`: the manifest and its summary; the BucketResult."""
    from ..jobs import bucket_dataset
    from ..jobs.readers import dataset_kind
    from . import checks

    if out is None:
        raise BadRequest("buckets DATASET needs --out MANIFEST (a .jsonl file)")
    checks.output(out, suffixes=(".jsonl",), no_clobber=no_clobber)
    checks.picture(plot, "--plot", no_clobber)
    dataset_kind(dataset)
    result = bucket_dataset(dataset, out, area=area, step=step, max_aspect=max_aspect, policy=policy,
                            latent_factor=latent_factor, replace=not no_clobber, progress=not quiet)
    typer.echo(result.summary())
    typer.echo(f"wrote {out}")
    return result


def encode_dataset(dataset: Path, manifest: Path, out: Path, shard_size: int, batch_size: int,
                   tile_above: int, tile: int, budget: str | None, model: Path | None, device: str,
                   quiet: bool, ray: str | None, workers: int | None) -> None:
    """`tilewise encode DATASET --buckets MANIFEST --out DIR`: the latent cache, resumable."""
    from ..jobs import EncodeSettings, encode_dataset, read_manifest
    from ..jobs.readers import dataset_kind
    from . import checks

    out_folder(out)
    dataset_kind(dataset)
    checks.budget(budget)
    checks.model_paths(model, None, vae_folder=True)
    image_vae(model)
    read_manifest(manifest)  # a manifest, checked before the model loads
    runner = ray_runner(ray, workers)
    settings = EncodeSettings(batch_size=batch_size, tile_above=tile_above, tile_size=tile,
                              memory_budget=budget)
    vae = None
    if runner is None:
        from ..jobs.cache import _load_vae
        from .options import resolve_device

        vae = _load_vae(None, model, device=resolve_device(device))
    result = encode_dataset(manifest, out, vae=vae, model=model, dataset=dataset, shard_size=shard_size,
                            settings=settings, progress=not quiet, ray=runner, device=device)
    typer.echo(result.summary())


def image_vae(model: Path | None) -> None:
    """The latent cache's --model holds a 2-D image VAE: a video VAE is refused from its JSON, before it
    loads (`jobs.cache` refuses it again on a VAE given in Python)."""
    from ..locality.classes import BATCHED_VAES, IMAGE_VAES
    from ..locality.video_classes import VIDEO_VAES
    from ..pipelines.loading import vae_class

    name = vae_class(model)
    if name in (*VIDEO_VAES, *BATCHED_VAES):
        raise BadRequest(f"encode --buckets writes a latent cache of images with a 2-D image VAE "
                         f"({', '.join(IMAGE_VAES)}), but --model {str(model)!r} holds a {name}, a video "
                         "VAE; encode videos one by one with `tilewise encode VIDEO --model ...`")


def _finish(result: Any, out: Path) -> None:
    """Print the summary, write DIR/failed.jsonl when some failed, and end with SomeFailed then."""
    typer.echo(result.summary())
    if result.failed:
        from ..atomic import write_text

        write_text(out / "failed.jsonl", "".join(json.dumps({"name": k, "error": v}) + "\n"
                                                 for k, v in result.failed.items()))
        n = len(result.done) + len(result.kept) + len(result.failed)
        raise SomeFailed(f"{len(result.failed)} of {n} items failed (listed above and in "
                         f"{out / 'failed.jsonl'}); the others are in {out}; a rerun retries only those")


def run_jobs(kind: str, items: list, out: Path, config: dict[str, Any], quiet: bool, ray: str | None,
             workers: int | None) -> None:
    """A batch job's items in this process (the model loaded once) or on Ray, then the summary."""
    from ..jobs.batch import RunnerFactory, run_batch

    runner = ray_runner(ray, workers)
    out.mkdir(exist_ok=True)
    factory = RunnerFactory(kind, json.dumps(config))
    if runner is not None:
        result = runner.run(factory, items, out)
    else:
        result = run_batch(factory, items, out, progress=not quiet)
    _finish(result, out)


def generate_batch(prompts: Path, out: Path, config: dict[str, Any], quiet: bool, ray: str | None,
                   workers: int | None) -> None:
    """`tilewise generate --prompts FILE --out DIR`: one image per line."""
    from ..jobs.batch import read_prompts

    out_folder(out)
    items = read_prompts(prompts)
    for it in items:
        if it.error:
            typer.echo(f"{it.name}: {it.error} (this line is skipped; the others go on)", err=True)
    run_jobs("generate", items, out, config, quiet, ray, workers)


def upscale_batch(folder: Path, out: Path, config: dict[str, Any], quiet: bool, ray: str | None,
                  workers: int | None) -> None:
    """`tilewise upscale DIR --out DIR`: each image to the same relative path, as PNG."""
    from ..jobs.batch import image_items
    from ..jobs.readers import IMAGE_SUFFIXES

    items = image_items(folder)
    out_folder(out)
    if out.suffix.lower() in IMAGE_SUFFIXES and not out.is_dir():
        raise BadRequest(f"--out {str(out)!r} names an image, but the input {str(folder)!r} is a folder: "
                         "give a folder for the upscaled images")
    if out.resolve() == folder.resolve():
        raise BadRequest(f"--out {str(out)!r} is the input folder; give another folder")
    run_jobs("upscale", items, out, config, quiet, ray, workers)
