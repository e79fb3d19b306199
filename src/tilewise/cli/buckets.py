"""The `buckets` command: bucket set, assignments with explanations, measured profile and choice.

Imports of torch and the library layers are inside the functions: they keep `tilewise --help` fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..atomic import write_text
from ..errors import BadRequest
from . import checks
from .options import NoClobber, Policy, Quiet, Report, parse_size
from .report import finish_report, run_folder


def buckets(
    dataset: Annotated[
        Path | None,
        typer.Argument(help="a folder of images (recursive), a Hugging Face dataset saved with save_to_disk, "
                       "or webdataset .tar shards; with --out MANIFEST"),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="with DATASET: the manifest to write (.jsonl)")] = None,
    request: Annotated[list[str] | None, typer.Option(help="requested WxH; repeatable")] = None,
    area: Annotated[int, typer.Option(min=64, help="pixel budget of a bucket")] = 256 * 256,
    step: Annotated[int, typer.Option(min=8, help="bucket sides are multiples of this")] = 32,
    max_aspect: Annotated[float, typer.Option(min=1.0)] = 4.0,
    policy: Annotated[Policy, typer.Option()] = Policy.pad,
    latent_factor: Annotated[
        int, typer.Option(min=1, help="with DATASET: image pixels per latent pixel of the VAE the cache will "
                          "encode with (8: SD, Flux; 32: DC-AE f32; 16: Flux.2, its 2x2 patches); the masks "
                          "are at it, and `encode --buckets` checks it against the VAE's")
    ] = 8,
    k: Annotated[int, typer.Option(min=1, help="buckets to choose by measured cost")] = 4,
    profile: Annotated[bool, typer.Option(help="time the embedded UNet at each bucket")] = True,
    repeats: Annotated[int, typer.Option(min=1)] = 3,
    plot: Annotated[Path | None, typer.Option(help="cost vs tokens plot PNG")] = None,
    report: Report = None,
    quiet: Quiet = False,
    no_clobber: NoClobber = False,
) -> None:
    """Bucket set, assignments with explanations, measured profile, chosen buckets and the cost plot; or a
    whole dataset's manifest (one row per image: bucket, what the policy did, SDXL conditioning, why).

    Example: tilewise buckets --request 800x1200 --request 2048x512 --policy pad --k 3 --plot cost.png

    Example: tilewise buckets photos/ --out manifest.jsonl --area 1048576 --step 64 --plot cost.png
    """
    if dataset is not None:
        if request:
            raise BadRequest("give DATASET or --request sizes, not both")
        if step % latent_factor:
            raise BadRequest(f"--step {step} must be a multiple of --latent-factor {latent_factor} (bucket "
                             "sides are whole latent pixels)")
        return _dataset(dataset, out, area, step, max_aspect, policy.value, plot, repeats, quiet, no_clobber,
                        latent_factor)
    if out is not None:
        raise BadRequest("--out applies to buckets DATASET (the manifest); without DATASET, use --report")
    if latent_factor != 8:
        raise BadRequest("--latent-factor applies to buckets DATASET (the manifest's masks)")

    _requests(request, area, step, max_aspect, policy.value, k, profile, repeats, plot, report, no_clobber)


def _requests(request: list[str] | None, area: int, step: int, max_aspect: float, policy: str, k: int,
              profile: bool, repeats: int, plot: Path | None, report: Path | None, no_clobber: bool) -> None:
    """`buckets --request WxH ...`: the bucket set, each request's assignment, then (with --profile) the
    embedded UNet timed at each bucket, the k buckets chosen by that cost, the plot and the report."""
    from ..buckets import BucketPlanner, choose_buckets

    defaults = ["800x1200", "1200x800", "2048x512", "512x512"]
    requests = [parse_size(r, "--request") for r in (request or defaults)]
    checks.picture(plot, "--plot", no_clobber)
    checks.report_folder(report)
    planner = BucketPlanner(area=area, step=step, max_aspect=max_aspect)
    typer.echo(
        f"{len(planner.buckets)} buckets under {area} px (step {step}): "
        + ", ".join(f"{w}x{h}" for w, h in planner.buckets[:12])
        + (" ..." if len(planner.buckets) > 12 else "")
    )
    scaled = _assign(planner, requests, area, step, policy)
    if not profile:
        return
    candidates = sorted(set(planner.buckets))
    prof = _profile_embedded_unet(candidates, repeats)
    typer.echo(prof.table())
    choice = choose_buckets(scaled, prof, min(k, len(candidates)), policy=policy)
    typer.echo(choice.table())
    run_dir = run_folder(report, {"command": "buckets", "requests": request, "area": area, "k": k})
    for q in [p for p in (plot, run_dir / "costs.png" if run_dir else None) if p is not None]:
        prof.plot(str(q))
        typer.echo(f"wrote {q}")
    if run_dir is not None:
        costs = [{"tokens": t.tokens, "seconds": t.median} for t in prof.timings]
        write_text(run_dir / "costs.json", json.dumps(costs, indent=2))
    finish_report(run_dir)


def _dataset(dataset: Path, out: Path | None, area: int, step: int, max_aspect: float, policy: str,
             plot: Path | None, repeats: int, quiet: bool, no_clobber: bool, latent_factor: int = 8) -> None:
    """`buckets DATASET --out MANIFEST`: the manifest (`cli.batch`), then the cost plot of the buckets the
    dataset uses."""
    from .batch import bucket_dataset

    result = bucket_dataset(dataset, out, area, step, max_aspect, policy, plot, quiet, no_clobber,
                            latent_factor)
    if plot is not None and result.manifest.rows:
        prof = _profile_embedded_unet(sorted({r.bucket for r in result.manifest.rows}), repeats)
        typer.echo(prof.table())
        prof.plot(str(plot))
        typer.echo(f"wrote {plot}")


def _assign(planner, requests: list[tuple[int, int]], area: int, step: int,
            policy: str) -> list[tuple[int, int]]:
    """Each request scaled down to the bucket area (sides multiples of `step`), assigned to a bucket with
    the explanation printed; the scaled sizes."""
    scaled = []
    for w, h in requests:
        s = min(1.0, (area / (w * h)) ** 0.5)
        sw, sh = max(step, int(w * s / step) * step), max(step, int(h * s / step) * step)
        scaled.append((sw, sh))
        a = planner.assign(sw, sh, policy=policy)
        typer.echo(f"- {w}x{h} (as {sw}x{sh}) -> bucket {a.bucket[0]}x{a.bucket[1]}: {a.explain()}")
    return scaled


def _profile_embedded_unet(candidates: list[tuple[int, int]], repeats: int):
    """One guided call of the embedded UNet timed at each candidate bucket (the measured cost profile)."""
    import torch

    from ..buckets import profile_buckets
    from ..pipelines import load_pipeline

    loaded = load_pipeline(None)
    unet = loaded.pipe.unet
    emb = loaded.encode("", "")["prompt_embeds"]

    def step_fn(x):
        return unet(x, 500, encoder_hidden_states=emb.expand(len(x), -1, -1)).sample

    return profile_buckets(step_fn, candidates, guidance=5.0, repeats=repeats, dtype=torch.float32)
