"""Assemble BENCHMARKS.md from the per-benchmark result files (each holds its own command).

Run from the repository root after re-running a benchmark: `.venv/bin/python benchmarks/collect.py`.
"""
from pathlib import Path

parts = [
    ("Exact and fast tiled VAE (`benchmarks/vae.py`)", "benchmarks/results_vae.md"),
    ("Tiled diffusion (`benchmarks/diffusion.py`)", "benchmarks/results_diffusion.md"),
    ("Resolution buckets (`benchmarks/buckets.py`)", "benchmarks/results_buckets.md"),
    ("Tile-parallel denoising across processes (`benchmarks/distributed.py`)",
     "benchmarks/results_distributed.md"),
    ("Exact tiled VAE across processes (`benchmarks/distributed.py --stage vae`)",
     "benchmarks/results_distributed_vae.md"),
]
head = """# Benchmarks

Latest figures, each with the command that produced it. Every benchmark runs its variants side by side
in one run (each variant in its own process where memory is measured) and reports ratios to the untiled
path and, where it applies, to diffusers' own tiling. Tests check correctness; these check speed and
memory.

Machine for all figures below: the project's shared CI-class machine (2 x86_64 cores, 24 GiB, no GPU),
torch 2.13.0+cpu, measured 2026-11-30 while other jobs ran on the same cores: **read the ratios and the
memory and error columns; absolute seconds are noisy** (each file says by how much). No GPU was lent to
this task, so no CUDA figures exist yet.

Streaming sinks (`tests/test_sinks.py -m slow`, command `OMP_NUM_THREADS=1 .venv/bin/python -m pytest
tests/test_sinks.py -m slow -s`): a 16384x16384 RGB 8-bit image written band by band (16 rows at a time)
in a fresh process: PNG peak RSS 46 MiB (14 MiB above the import baseline), 31 s; tiled BigTIFF 94 MiB
(63 MiB growth), 13 s. Limit asked: 300 MiB.
"""
out = [head]
for title, path in parts:
    text = Path(path).read_text().strip()
    lines = text.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    lines = ["#" + line if line.startswith("#") else line for line in lines]  # nest under our heading
    out.append(f"\n## {title}\n\nSource: `{path}`\n\n" + "\n".join(lines).strip() + "\n")
Path("BENCHMARKS.md").write_text("\n".join(out))
