#!/usr/bin/env bash
# Regenerates the README pictures from the commands they illustrate (embedded model, CPU).
# Usage: bash docs/pictures.sh   (after the quick start's install; takes ~10 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
T=${TILEWISE:-.venv/bin/tilewise}
PY=${PYTHON:-.venv/bin/python}
out=docs/img
work=$(mktemp -d)
mkdir -p "$out"

"$T" generate --prompt grass --width 2048 --height 512 --region "0,0,1024,512:brick" \
  --region "1024,0,2048,512:gravel" --out "$work/wide.png" --report "$work/run" --quiet
"$PY" - "$work" "$out" <<'PY'
import sys
from PIL import Image
work, out = sys.argv[1:]
with Image.open(f"{work}/wide.png") as im:
    im.convert("RGB").resize((1024, 256), Image.LANCZOS).save(f"{out}/generate.jpg", quality=88)
    im.convert("RGB").crop((896, 128, 1152, 256)).save(f"{work}/crop.png")
PY
"$T" upscale "$work/crop.png" --scale 2 --strength 0.3 --prompt gravel --out "$work/up.png" --quiet
"$PY" - "$work" "$out" <<'PY'
import sys
from PIL import Image
work, out = sys.argv[1:]
with Image.open(f"{work}/crop.png") as a, Image.open(f"{work}/up.png") as b:
    pair = Image.new("RGB", (1024, 256), "white")
    pair.paste(a.resize((512, 256), Image.LANCZOS), (0, 0))  # the input, enlarged for viewing
    pair.paste(b.convert("RGB"), (512, 0))                    # tilewise upscale x2
    pair.save(f"{out}/upscale.jpg", quality=90)
PY
"$T" plan --width 2048 --height 512 --tile 16 --image "$out/plan.png" --over "$work/wide.png" >/dev/null
"$T" plan --width 1024 --height 768 --tile 16 --ranks 3 --image "$out/plan_ranks.png" >/dev/null
"$T" compare --size 64x48 --tile 16 --mode fast --heatmap "$out/compare_fast.png" --quiet
"$T" buckets --request 800x1200 --request 1200x800 --request 2048x512 --request 512x512 \
  --k 4 --repeats 2 --plot "$out/buckets_cost.png" >/dev/null
# the report page as a browser shows it (Debian chromium, headless)
if command -v chromium >/dev/null; then
  chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$work/chrome" --window-size=1200,1400 \
    --screenshot="$out/report.png" "file://$(realpath "$work/run/report.html")" 2>/dev/null
fi
echo "pictures in $out"
