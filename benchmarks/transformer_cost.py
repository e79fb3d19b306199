"""One denoising step of SD3- and Flux-shaped transformers, untiled vs tiled: FLOPs counted, time measured.

FLOPs: `torch.utils.flop_counter.FlopCounterMode` over one transformer call on the meta device (no
weights, no memory) with the real depths and widths of SD3-medium and Flux.1-dev from their diffusers
configs, at 1024 to 8192 px. On meta, scaled-dot-product attention runs its math path, so the attention
term is exactly the `aten.bmm` count (QK^T and AV: 4 N^2 d per layer) and the rest (`addmm`,
`convolution`) is the per-token term. Tiled = the plan's tile count (`TiledDenoiser.count`) x one tile's
call: every tile is one size and one call's FLOPs do not depend on where the tile is (global positions
cost elementwise ops only). `--check` verifies that identity on a small model with real tensors: the
FLOPs of a whole TiledDenoiser call equal count x one tile's call, exactly.
SD3's position table (pos_embed_max_size 192 patches = 3072 px) is enlarged in the meta configs so
the untiled call exists at 4096-8192 px; that changes no FLOP. Text tokens: SD3 77 + 256, Flux 512.
One image, no CFG batch (SD3's CFG doubles untiled and tiled alike).

Time: the same two families at small widths (2-3 layers, width 64) on this CPU, untiled vs tiled.
The figures go into a markdown table and a report run directory whose costs.json (attention FLOPs vs
tokens) `tilewise report` plots beside the y = a*x^2 cost instrument, with its caveat.

    .venv/bin/python benchmarks/transformer_cost.py --out benchmarks/results_transformer_cost.md \
        --report-dir benchmarks/results_transformer_cost --png benchmarks/results_transformer_cost.png
    .venv/bin/python benchmarks/transformer_cost.py --sizes 1024,2048 --time-sizes 512 --no-report
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from diffusers import FluxPipeline, FluxTransformer2DModel, SD3Transformer2DModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tilewise.diffusion import TiledDenoiser

# transformer/config.json of stabilityai/stable-diffusion-3-medium-diffusers and black-forest-labs/FLUX.1-dev
SD3_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                  attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                  caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=192)
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                guidance_embeds=True, axes_dims_rope=(16, 56, 56))
SD3_SMALL = dict(SD3_MEDIUM, num_layers=2, attention_head_dim=32, num_attention_heads=2,
                 joint_attention_dim=64, caption_projection_dim=64, pooled_projection_dim=32)
FLUX_SMALL = dict(FLUX_DEV, num_layers=1, num_single_layers=2, attention_head_dim=32, num_attention_heads=2,
                  joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=(8, 12, 12))
TEXT = {"sd3": 77 + 256, "flux": 512}
VAE_SCALE = 8  # pixels per latent pixel (SD3 and Flux VAEs)


def build(family: str, config: dict, px: int, device: str):
    """The family's transformer; SD3's position table grown to cover px (FLOPs unchanged)."""
    if family == "sd3":
        table = max(config["pos_embed_max_size"], px // VAE_SCALE // config["patch_size"])
        with torch.device(device):
            return SD3Transformer2DModel(**dict(config, pos_embed_max_size=table)).eval()
    with torch.device(device):
        return FluxTransformer2DModel(**config).eval()


def inputs(family: str, model, px: int, device: str) -> dict:
    """One step's call at px x px as the family's pipeline makes it (batch 1)."""
    cfg, lat, n_txt = model.config, px // VAE_SCALE, TEXT[family]
    with torch.device(device):
        t = torch.ones(1)
        text = torch.randn(1, n_txt, cfg.joint_attention_dim)
        pooled = torch.randn(1, cfg.pooled_projection_dim)
        if family == "sd3":
            return dict(hidden_states=torch.randn(1, cfg.in_channels, lat, lat), timestep=t * 500,
                        encoder_hidden_states=text, pooled_projections=pooled, return_dict=False)
        ids = FluxPipeline._prepare_latent_image_ids(1, lat // 2, lat // 2, device, torch.float32)
        return dict(hidden_states=torch.randn(1, (lat // 2) ** 2, cfg.in_channels), timestep=t * 0.5,
                    guidance=t * 3.5, encoder_hidden_states=text, pooled_projections=pooled, img_ids=ids,
                    txt_ids=torch.zeros(n_txt, 3), return_dict=False)


def flops(fn) -> tuple[int, int]:
    """(total, attention) FLOPs of fn(); attention = the bmm of SDPA's math path (forced off meta too)."""
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        fn()
    counts = counter.get_flop_counts().get("Global", {})
    return int(sum(counts.values())), int(sum(v for k, v in counts.items() if "bmm" in str(k)))


def tiled_plan(px: int, tile_px: int, overlap_px: int, model) -> TiledDenoiser:
    return TiledDenoiser(model, tile_size=min(tile_px, px) // VAE_SCALE, overlap=overlap_px // VAE_SCALE,
                         method="mixture")


def count_row(family: str, config: dict, px: int, tile_px: int, overlap_px: int) -> dict:
    """FLOPs of one step at px: untiled, and tiles x one tile's call (meta device)."""
    model = build(family, config, px, "meta")
    den = tiled_plan(px, tile_px, overlap_px, model)
    lat = px // VAE_SCALE
    n = den.count(lat, lat)
    total, attn = flops(lambda: model(**inputs(family, model, px, "meta")))
    t_total, t_attn = flops(lambda: model(**inputs(family, model, min(tile_px, px), "meta")))
    return dict(family=family, px=px, tokens=(lat // 2) ** 2, tiles=n, untiled=total, untiled_attn=attn,
                tiled=n * t_total, tiled_attn=n * t_attn)


def check_identity(family: str, config: dict, px: int, tile_px: int, overlap_px: int) -> tuple[int, int, int]:
    """(FLOPs of a real TiledDenoiser call, tiles, FLOPs of one tile's call) on a small model, CPU tensors."""
    torch.manual_seed(0)
    model = build(family, config, px, "cpu")
    den = tiled_plan(px, tile_px, overlap_px, model)
    whole, _ = flops(lambda: den(**inputs(family, model, px, "cpu")))
    one, _ = flops(lambda: model(**inputs(family, model, tile_px, "cpu")))
    lat = px // VAE_SCALE
    return whole, den.count(lat, lat), one


def seconds(fn, repeats: int) -> float:
    with torch.no_grad():
        fn()  # warm-up
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def time_row(family: str, config: dict, px: int, tile_px: int, overlap_px: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = build(family, config, px, "cpu")
    kw = inputs(family, model, px, "cpu")
    den = tiled_plan(px, tile_px, overlap_px, model)
    batched = TiledDenoiser(model, tile_size=den.tile_size, overlap=den.overlap, method="mixture",
                            batch_size=4)
    lat = px // VAE_SCALE
    return dict(family=family, px=px, tokens=(lat // 2) ** 2, tiles=den.count(lat, lat),
                untiled_s=seconds(lambda: model(**kw), repeats), tiled_s=seconds(lambda: den(**kw), repeats),
                tiled_b4_s=seconds(lambda: batched(**kw), repeats))


def fmt(v: float) -> str:
    return f"{v:.3g}"


def markdown(rows: list[dict], times: list[dict], checks: list[str], args) -> str:
    tile, ov = args.tile, args.overlap
    out = [f"One denoising step (batch 1), tiles of {tile} px with {ov} px overlap (mixture), "
           f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores, "
           f"{args.threads} thread(s)",
           "", "FLOPs (counted on the meta device, real SD3-medium / Flux.1-dev depths and widths):", "",
           "| family | px | image tokens | tiles | untiled FLOPs | tiled FLOPs | tiled / untiled | "
           "untiled attention | tiled attention | attention tiled / untiled | attention share untiled |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['family']} | {r['px']} | {r['tokens']} | {r['tiles']} | {fmt(r['untiled'])} | "
                   f"{fmt(r['tiled'])} | {r['tiled'] / r['untiled']:.3f} | {fmt(r['untiled_attn'])} | "
                   f"{fmt(r['tiled_attn'])} | {r['tiled_attn'] / r['untiled_attn']:.3f} | "
                   f"{r['untiled_attn'] / r['untiled']:.2f} |")
    out += ["", "Growth from one size to the next (x2 side = x4 tokens): attention FLOPs ratio, untiled / "
            "tiled:", ""]
    for fam in dict.fromkeys(r["family"] for r in rows):
        rs = [r for r in rows if r["family"] == fam]
        steps = [f"{a['px']}->{b['px']}: x{b['untiled_attn'] / a['untiled_attn']:.2f} / "
                 f"x{b['tiled_attn'] / a['tiled_attn']:.2f}" for a, b in zip(rs, rs[1:], strict=False)]
        out.append(f"- {fam}: " + ", ".join(steps))
    if checks:
        out += ["", "Identity check (small model, real CPU tensors, SDPA math path): FLOPs of one whole "
                "TiledDenoiser call vs tiles x one tile's call:", ""] + [f"- {c}" for c in checks]
    if times:
        out += ["", f"Time on small widths (SD3: 2 layers, Flux: 1 + 2 layers, width 64), median of "
                f"{args.repeats}, seconds per step:", "",
                "| family | px | image tokens | tiles | untiled s | tiled s (batch 1) | tiled s (batch 4) | "
                "tiled / untiled (batch 1) |", "|---|---|---|---|---|---|---|---|"]
        for r in times:
            out.append(f"| {r['family']} | {r['px']} | {r['tokens']} | {r['tiles']} | {r['untiled_s']:.3f} | "
                       f"{r['tiled_s']:.3f} | {r['tiled_b4_s']:.3f} | {r['tiled_s'] / r['untiled_s']:.2f} |")
    out += ["", "command: `" + " ".join(["python", *sys.argv]) + "`", ""]
    return "\n".join(out)


def write_report(rows: list[dict], run_dir: Path, args) -> Path:
    from tilewise.report import build_report

    run_dir.mkdir(parents=True, exist_ok=True)
    points = []
    for r in rows:
        for kind in ("untiled", "tiled"):
            points.append(dict(label=f"{r['family']} {kind} attention", tokens=r["tokens"],
                               flops=r[f"{kind}_attn"], total_flops=r[kind], px=r["px"], tiles=r["tiles"]))
    (run_dir / "costs.json").write_text(json.dumps({"points": points}, indent=1))
    (run_dir / "run.json").write_text(json.dumps(dict(
        what="one denoising step's attention FLOPs (counted, torch.utils.flop_counter, meta device), "
             "SD3-medium- and Flux.1-dev-shaped transformers, untiled vs tiled",
        tile_px=args.tile, overlap_px=args.overlap, command=" ".join(["python", *sys.argv])), indent=1))
    return build_report(run_dir)


def plot(rows: list[dict], path: Path) -> None:
    """Log-log PNG: attention FLOPs vs image tokens, untiled and tiled, with x and x^2 references."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=110)
    for fam, color in (("sd3", "#1f77b4"), ("flux", "#d62728")):
        rs = [r for r in rows if r["family"] == fam]
        x = [r["tokens"] for r in rs]
        for kind, style in (("untiled", "-o"), ("tiled", "--s")):
            ax.plot(x, [r[f"{kind}_attn"] for r in rs], style, color=color, label=f"{fam} {kind}")
    x0, y0 = rows[0]["tokens"], min(r["untiled_attn"] for r in rows)
    xs = sorted({r["tokens"] for r in rows})
    ax.plot(xs, [y0 * (x / x0) ** 2 for x in xs], ":", color="gray", label="∝ tokens² (reference)")
    ax.plot(xs, [y0 * x / x0 for x in xs], "-.", color="gray", label="∝ tokens (reference)")
    ax.set(xscale="log", yscale="log", xlabel="image tokens per step", ylabel="attention FLOPs per step",
           title="one denoising step: attention FLOPs (counted)")
    ax.legend(fontsize=7)
    fig.savefig(path, bbox_inches="tight")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1024,2048,4096,8192", help="image sides in px for the FLOP counts")
    ap.add_argument("--time-sizes", default="512,1024,2048",
                    help="image sides in px for the timings ('' for none)")
    ap.add_argument("--tile", type=int, default=1024, help="tile side in px (FLOP counts)")
    ap.add_argument("--overlap", type=int, default=256, help="tile overlap in px (FLOP counts)")
    ap.add_argument("--time-tile", type=int, default=512, help="tile side in px (timings)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="markdown file for the tables")
    ap.add_argument("--report-dir", default="benchmarks/results_transformer_cost")
    ap.add_argument("--no-report", action="store_true")
    ap.add_argument("--png", type=Path, default=None, help="write the attention-FLOPs plot here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    families = {"sd3": (SD3_MEDIUM, SD3_SMALL), "flux": (FLUX_DEV, FLUX_SMALL)}
    rows = [count_row(f, big, px, args.tile, args.overlap) for f, (big, _) in families.items()
            for px in map(int, args.sizes.split(","))]
    checks = []
    for f, (_, small) in families.items():
        whole, n, one = check_identity(f, small, 1024, 512, 128)
        checks.append(f"{f}: 1024 px, 512 px tiles, 128 px overlap: {whole} FLOPs = {n} x {one}: "
                      f"{'equal' if whole == n * one else 'DIFFERENT'}")
    times = [time_row(f, small, px, args.time_tile, args.time_tile // 4, args.repeats)
             for f, (_, small) in families.items()
             for px in map(int, filter(None, args.time_sizes.split(",")))]
    text = markdown(rows, times, checks, args)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.png:
        plot(rows, args.png)
    if not args.no_report:
        print("report:", write_report(rows, Path(args.report_dir), args))


if __name__ == "__main__":
    main()
