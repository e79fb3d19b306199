#!/usr/bin/env bash
# One command, one GPU, under 8 minutes: untiled vs diffusers' tiling vs tilewise exact and fast decode at
# 1024 / 2048 / 4096 px in float16, time ratios from one run, torch.cuda.max_memory_allocated beside the
# plan's estimate. Each size's rows are appended to benchmarks/results_gpu.md as they are measured; sizes
# not started within 400 s are skipped and said so, and the whole run is stopped at 470 s.
#   benchmarks/gpu.sh                      # PYTHON=.venv/bin/python by default when it exists
#   benchmarks/gpu.sh --budget 4GiB        # extra options go to benchmarks/gpu.py (the last one wins)
# The CPU dry run of the same code at a tiny size is tests/test_gpu_benchmark.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu.sh: no CUDA device here')"
exec timeout 470 "$PY" benchmarks/gpu.py --device cuda --deadline 400 --out benchmarks/results_gpu.md "$@"
