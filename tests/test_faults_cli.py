"""Catalogue of bad requests and bad input files on the command line (issue 20), run in process.

Every case asserts the exit code of its kind (tilewise.errors), that stderr is one `error:` line naming
the user's own value, that no traceback is printed, and that nothing is left in the working folder (no
output, no temporary) and the input files are untouched. Cases that need a model use the embedded one.
"""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from tilewise.cli import main

BAD_REQUEST, BAD_INPUT, WONT_FIT, MODEL = 2, 3, 4, 5


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Bad (and a few good) input files, made once; the cases refer to them as {D}/name."""
    d = tmp_path_factory.mktemp("inputs")
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    save_file({"latents": z}, str(d / "z.safetensors"))
    raw = (d / "z.safetensors").read_bytes()
    (d / "trunc.safetensors").write_bytes(raw[:-64])
    (d / "junk.safetensors").write_bytes(b"not a safetensors file at all" * 4)
    (d / "empty.safetensors").write_bytes(b"")
    save_file({"other": z}, str(d / "other.safetensors"))
    zn = z.clone()
    zn[0, 2, 3, 4] = float("nan")
    save_file({"latents": zn}, str(d / "nan.safetensors"))
    save_file({"latents": z.to(torch.int32)}, str(d / "int.safetensors"))
    save_file({"latents": torch.randn(2, 4, 8, 8)}, str(d / "batch2.safetensors"))
    save_file({"latents": torch.randn(1, 3, 8, 8)}, str(d / "c3.safetensors"))
    (d / "afolder").mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(d / "img.png")
    png = (d / "img.png").read_bytes()
    (d / "trunc.png").write_bytes(png[: len(png) // 2])
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(d / "img.jpg")
    jpg = (d / "img.jpg").read_bytes()
    (d / "trunc.jpg").write_bytes(jpg[: len(jpg) // 2])
    (d / "notimg.png").write_text("hello, not a picture\n")
    Image.fromarray(rng.integers(0, 256, (44, 60, 3), dtype=np.uint8)).save(d / "odd.png")
    import tifffile

    tifffile.imwrite(d / "float.tif", rng.random((64, 64, 3), dtype=np.float32))
    (d / "badindex").mkdir()
    (d / "badindex" / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline",')
    (d / "noindex").mkdir()
    (d / "noclass").mkdir()
    unet = ["diffusers", "UNet2DConditionModel"]
    (d / "noclass" / "model_index.json").write_text(json.dumps({"unet": unet}))
    (d / "incomplete").mkdir()
    (d / "incomplete" / "model_index.json").write_text(json.dumps(
        {"_class_name": "StableDiffusionPipeline", "unet": unet}))
    (d / "weights.bin").write_bytes(b"\0" * 16)
    (d / "ckpt.safetensors").write_bytes(raw)
    zi = z.clone()
    zi[0, 1, 0, 0] = float("inf")
    save_file({"latents": zi}, str(d / "inf.safetensors"))
    save_file({"latents": torch.randn(1, 4, 2, 8, 8)}, str(d / "video.safetensors"))
    (d / "empty.png").write_bytes(b"")
    tifffile.imwrite(d / "int32.tif", rng.integers(0, 9, (64, 64, 3), dtype=np.int32))
    Image.fromarray(rng.integers(0, 256, (64, 64, 4), dtype=np.uint8)).save(d / "rgba.png")
    return d


def _listing(folder):
    return sorted((p.relative_to(folder).as_posix(), p.stat().st_size if p.is_file() else -1)
                  for p in folder.rglob("*"))


GEN = ["generate", "--prompt", "grass"]
# (argv with {D} for the inputs folder, exit code, texts the one error line must contain)
CASES = {
    # bad requests: option values, combinations, outputs
    "width-zero": (GEN + ["--width", "0", "--out", "o.png"], BAD_REQUEST, ["--width", "'0'"]),
    "width-not-multiple": (GEN + ["--width", "100", "--height", "64", "--out", "o.png"], BAD_REQUEST,
                           ["100", "multiples of 8"]),
    "region-malformed": (GEN + ["--region", "1,2,3:oops", "--out", "o.png"], BAD_REQUEST, ["1,2,3:oops"]),
    "region-outside": (GEN + ["--width", "64", "--height", "64", "--region", "0,0,4096,64:brick", "--out",
                              "o.png"], BAD_REQUEST, ["(0, 0, 4096, 64)", "64x64"]),
    "steps-zero": (GEN + ["--steps", "0", "--out", "o.png"], BAD_REQUEST, ["--steps", "'0'"]),
    "method-unknown": (GEN + ["--method", "bogus", "--out", "o.png"], BAD_REQUEST, ["--method", "bogus"]),
    "dtype-unknown": (GEN + ["--dtype", "float8", "--out", "o.png"], BAD_REQUEST, ["float8"]),
    "device-unknown": (GEN + ["--out", "o.png", "--device", "bogus"], BAD_REQUEST, ["--device", "'bogus'"]),
    "device-absent": (["decode", "{D}/z.safetensors", "--out", "o.png", "--device", "cuda:7"], BAD_REQUEST,
                      ["--device", "'cuda:7'"]),
    "unknown-option": (GEN + ["--bogus", "--out", "o.png"], BAD_REQUEST, ["--bogus"]),
    "missing-prompt": (["generate", "--out", "o.png"], BAD_REQUEST, ["--prompt"]),
    "out-suffix-jpg": (GEN + ["--out", "o.jpg"], BAD_REQUEST, ["o.jpg", ".png"]),
    "out-no-suffix": (GEN + ["--out", "picture"], BAD_REQUEST, ["picture", "no suffix"]),
    "out-folder-missing": (GEN + ["--out", "nodir/o.png"], BAD_REQUEST, ["nodir/o.png", "does not exist"]),
    "out-is-folder": (GEN + ["--out", "dir.png"], BAD_REQUEST, ["dir.png", "is a folder"]),
    "out-parent-is-file": (GEN + ["--out", "file.txt/o.png"], BAD_REQUEST, ["file.txt", "not a folder"]),
    "out-no-clobber": (GEN + ["--out", "exists.png", "--no-clobber"], BAD_REQUEST,
                       ["exists.png", "--no-clobber"]),
    "report-is-file": (GEN + ["--out", "o.png", "--report", "file.txt"], BAD_REQUEST, ["file.txt", "folder"]),
    "model-missing": (GEN + ["--out", "o.png", "--model", "/no/such/model"], BAD_REQUEST,
                      ["/no/such/model", "does not exist"]),
    "config-without-model": (GEN + ["--out", "o.png", "--config", "{D}/noindex"], BAD_REQUEST,
                             ["--config", "noindex"]),
    "model-wrong-suffix": (GEN + ["--out", "o.png", "--model", "{D}/weights.bin"], BAD_REQUEST,
                           ["weights.bin", ".safetensors"]),
    "checkpoint-without-config": (GEN + ["--out", "o.png", "--model", "{D}/ckpt.safetensors"], BAD_REQUEST,
                                  ["ckpt.safetensors", "--config"]),
    "decode-latents-missing": (["decode", "missing.safetensors", "--out", "o.png"], BAD_REQUEST,
                               ["missing.safetensors", "does not exist"]),
    "decode-bits-32-png": (["decode", "{D}/z.safetensors", "--out", "o.png", "--bits", "32"], BAD_REQUEST,
                           ["--bits 32", "o.png", "8 or 16"]),
    "decode-out-webp": (["decode", "{D}/z.safetensors", "--out", "o.webp"], BAD_REQUEST, ["o.webp"]),
    "decode-budget-unparsable": (["decode", "{D}/z.safetensors", "--out", "o.png", "--budget", "lots"],
                                 BAD_REQUEST, ["'lots'", "GiB"]),
    "encode-out-png": (["encode", "{D}/img.png", "--out", "lat.png"], BAD_REQUEST,
                       ["lat.png", ".safetensors"]),
    "encode-image-missing": (["encode", "missing.png", "--out", "lat.safetensors"], BAD_REQUEST,
                             ["missing.png", "does not exist"]),
    "upscale-no-step": (["upscale", "{D}/img.png", "--out", "up.png", "--steps", "2", "--strength", "0.3"],
                        BAD_REQUEST, ["strength 0.3", "at least 4 steps"]),
    "upscale-scale-zero": (["upscale", "{D}/img.png", "--out", "up.png", "--scale", "0"], BAD_REQUEST,
                           ["--scale", "'0'"]),
    "plan-image-jpg": (["plan", "--image", "grid.jpg"], BAD_REQUEST, ["grid.jpg", ".png"]),
    "plan-kind-unknown": (["plan", "--kind", "bogus"], BAD_REQUEST, ["--kind", "bogus"]),
    "plan-width-not-multiple": (["plan", "--width", "100"], BAD_REQUEST, ["100", "multiples of 8"]),
    "compare-size-zero": (["compare", "--size", "0x4"], BAD_REQUEST, ["--size", "0x4"]),
    "compare-size-garbled": (["compare", "--size", "abc"], BAD_REQUEST, ["--size", "abc"]),
    "compare-pattern-unknown": (["compare", "--pattern", "bogus"], BAD_REQUEST, ["--pattern", "bogus"]),
    "compare-heatmap-svg": (["compare", "--heatmap", "h.svg"], BAD_REQUEST, ["h.svg", ".png"]),
    "buckets-request-zero": (["buckets", "--request", "0x600", "--no-profile"], BAD_REQUEST,
                             ["--request", "0x600"]),
    "buckets-plot-jpg": (["buckets", "--plot", "p.jpg", "--no-profile"], BAD_REQUEST, ["p.jpg"]),
    "region-inverted": (GEN + ["--width", "64", "--height", "64", "--region", "40,0,8,64:brick", "--out",
                               "o.png"], BAD_REQUEST, ["(40, 0, 8, 64)", "inverted", "x0 < x1"]),
    "region-empty-x": (GEN + ["--width", "64", "--height", "64", "--region", "8,0,8,64:brick", "--out",
                              "o.png"], BAD_REQUEST, ["(8, 0, 8, 64)", "empty", "x0 < x1"]),
    "region-empty-y": (GEN + ["--width", "64", "--height", "64", "--region", "0,16,64,16:brick", "--out",
                              "o.png"], BAD_REQUEST, ["empty", "y0 < y1"]),
    "region-negative": (GEN + ["--width", "64", "--height", "64", "--region", "-8,0,32,32:brick", "--out",
                               "o.png"], BAD_REQUEST, ["(-8, 0, 32, 32)", "outside", "0 <= x0"]),
    "region-below": (GEN + ["--width", "64", "--height", "64", "--region", "0,0,64,72:brick", "--out",
                            "o.png"], BAD_REQUEST, ["outside the 64x64 image", "y1 <= 64"]),
    "region-no-prompt": (GEN + ["--region", "0,0,8,8:", "--out", "o.png"], BAD_REQUEST, ["0,0,8,8:"]),
    "steps-over": (GEN + ["--steps", "1001", "--out", "o.png"], BAD_REQUEST, ["--steps", "1000"]),
    "tile-zero": (GEN + ["--tile", "0", "--out", "o.png"], BAD_REQUEST, ["--tile", "'0'"]),
    "overlap-negative": (GEN + ["--overlap", "-1", "--out", "o.png"], BAD_REQUEST, ["--overlap", "'-1'"]),
    "guidance-negative": (GEN + ["--guidance", "-1", "--out", "o.png"], BAD_REQUEST, ["--guidance"]),
    "seed-negative": (GEN + ["--seed", "-3", "--out", "o.png"], BAD_REQUEST, ["--seed", "'-3'"]),
    "batch-size-zero": (GEN + ["--batch-size", "0", "--out", "o.png"], BAD_REQUEST, ["--batch-size"]),
    "vae-tile-zero": (GEN + ["--vae-tile", "0", "--out", "o.png"], BAD_REQUEST, ["--vae-tile"]),
    "height-not-multiple": (GEN + ["--width", "64", "--height", "60", "--out", "o.png"], BAD_REQUEST,
                            ["60", "multiples of 8"]),
    "scheduler-unknown": (GEN + ["--scheduler", "bogus", "--out", "o.png"], BAD_REQUEST, ["--scheduler"]),
    "generate-out-pattern": (GEN + ["--out", "g{:03d}.png"], BAD_REQUEST, ["g{:03d}.png", "frame pattern"]),
    "generate-no-clobber-64": (GEN + ["--out", "exists.png", "--no-clobber", "--width", "64", "--height",
                                     "64"], BAD_REQUEST, ["exists.png", "--no-clobber"]),
    "generate-nproc-over": (GEN + ["--out", "o.png", "--nproc", "4096"], BAD_REQUEST,
                            ["--nproc 4096", "use --nproc 1.."]),
    "generate-nproc-zero": (GEN + ["--out", "o.png", "--nproc", "0"], BAD_REQUEST, ["--nproc", "'0'"]),
    "report-parent-is-file": (GEN + ["--out", "o.png", "--report", "file.txt/run"], BAD_REQUEST,
                              ["file.txt", "not a folder"]),
    "config-is-file": (GEN + ["--out", "o.png", "--model", "{D}/ckpt.safetensors", "--config",
                              "{D}/weights.bin"], BAD_REQUEST, ["--config", "weights.bin", "is a file"]),
    "config-beside-folder": (GEN + ["--out", "o.png", "--model", "{D}/incomplete", "--config",
                                    "{D}/incomplete"], BAD_REQUEST, ["--config", "single-file --model only"]),
    "decode-pattern-2d": (["decode", "{D}/z.safetensors", "--out", "f{:04d}.png"], BAD_REQUEST,
                          ["f{:04d}.png", "frame pattern", "one file"]),
    "decode-budget-unit": (["decode", "{D}/z.safetensors", "--out", "o.png", "--budget", "2XB"], BAD_REQUEST,
                           ["--budget '2XB'"]),
    "decode-budget-negative": (["decode", "{D}/z.safetensors", "--out", "o.png", "--budget", "-1GiB"],
                               BAD_REQUEST, ["--budget '-1GiB'"]),
    "decode-bits-7": (["decode", "{D}/z.safetensors", "--out", "o.tif", "--bits", "7"], BAD_REQUEST,
                      ["--bits 7", "o.tif"]),
    "decode-no-clobber": (["decode", "{D}/z.safetensors", "--out", "exists.png", "--no-clobber"], BAD_REQUEST,
                          ["exists.png", "--no-clobber"]),
    "decode-out-is-folder": (["decode", "{D}/z.safetensors", "--out", "dir.png"], BAD_REQUEST,
                             ["dir.png", "is a folder"]),
    "decode-out-folder-missing": (["decode", "{D}/z.safetensors", "--out", "nodir/o.npy"], BAD_REQUEST,
                                  ["nodir/o.npy", "does not exist"]),
    "decode-tile-zero": (["decode", "{D}/z.safetensors", "--out", "o.png", "--tile", "0"], BAD_REQUEST,
                         ["--tile"]),
    "decode-staging-unknown": (["decode", "{D}/z.safetensors", "--out", "o.png", "--staging", "ram"],
                               BAD_REQUEST, ["--staging", "ram"]),
    "decode-mode-unknown": (["decode", "{D}/z.safetensors", "--out", "o.png", "--mode", "approx"],
                            BAD_REQUEST, ["--mode", "approx"]),
    "decode-nproc-over": (["decode", "{D}/z.safetensors", "--out", "o.png", "--nproc", "4096"], BAD_REQUEST,
                          ["--nproc 4096"]),
    "decode-report-is-file": (["decode", "{D}/z.safetensors", "--out", "o.png", "--report", "file.txt"],
                              BAD_REQUEST, ["file.txt", "folder"]),
    "decode-device-unknown": (["decode", "{D}/z.safetensors", "--out", "o.png", "--device", "tpu"],
                              BAD_REQUEST, ["--device", "'tpu'"]),
    "encode-out-pattern": (["encode", "{D}/img.png", "--out", "z{:02d}.safetensors"], BAD_REQUEST,
                           ["z{:02d}.safetensors", "frame pattern"]),
    "encode-no-clobber": (["encode", "{D}/img.png", "--out", "exists.safetensors", "--no-clobber"],
                          BAD_REQUEST, ["exists.safetensors", "--no-clobber"]),
    "encode-budget-unparsable": (["encode", "{D}/img.png", "--out", "z.safetensors", "--budget", "much"],
                                 BAD_REQUEST, ["--budget 'much'"]),
    "encode-nproc-over": (["encode", "{D}/img.png", "--out", "z.safetensors", "--nproc", "4096"],
                          BAD_REQUEST, ["--nproc 4096"]),
    "encode-out-folder-missing": (["encode", "{D}/img.png", "--out", "nodir/z.safetensors"], BAD_REQUEST,
                                  ["nodir/z.safetensors", "does not exist"]),
    "upscale-steps-over": (["upscale", "{D}/img.png", "--out", "up.png", "--steps", "2000"], BAD_REQUEST,
                           ["--steps", "1000"]),
    "upscale-inversion-billion": (["upscale", "{D}/img.png", "--out", "up.png", "--inversion-steps",
                                   "1000000000"], BAD_REQUEST, ["--inversion-steps", "1000"]),
    "upscale-inversion-negative": (["upscale", "{D}/img.png", "--out", "up.png", "--inversion-steps", "-1"],
                                   BAD_REQUEST, ["--inversion-steps"]),
    "upscale-strength-over": (["upscale", "{D}/img.png", "--out", "up.png", "--strength", "1.5"],
                              BAD_REQUEST, ["--strength"]),
    "upscale-out-pattern": (["upscale", "{D}/img.png", "--out", "u{:02d}.png"], BAD_REQUEST,
                            ["frame pattern"]),
    "upscale-no-clobber": (["upscale", "{D}/img.png", "--out", "exists.png", "--no-clobber"], BAD_REQUEST,
                           ["exists.png", "--no-clobber"]),
    "upscale-nproc-over": (["upscale", "{D}/img.png", "--out", "up.png", "--nproc", "4096"], BAD_REQUEST,
                           ["--nproc 4096"]),
    "upscale-image-missing": (["upscale", "missing.png", "--out", "up.png"], BAD_REQUEST,
                              ["missing.png", "does not exist"]),
    "upscale-controlnet-missing": (["upscale", "{D}/img.png", "--out", "up.png", "--controlnet", "/no/cn"],
                                   BAD_REQUEST, ["--controlnet '/no/cn' does not exist"]),
    "upscale-controlnet-file": (["upscale", "{D}/img.png", "--out", "up.png", "--controlnet",
                                 "{D}/weights.bin"], BAD_REQUEST, ["--controlnet", "is a file"]),
    "plan-ranks-over": (["plan", "--width", "64", "--height", "64", "--ranks", "3"], BAD_REQUEST,
                        ["--ranks 3", "1 tile row", "--ranks 1..1"]),
    "plan-ranks-zero": (["plan", "--ranks", "0"], BAD_REQUEST, ["--ranks", "'0'"]),
    "plan-image-no-clobber": (["plan", "--width", "64", "--height", "64", "--image", "exists.png",
                               "--no-clobber"], BAD_REQUEST, ["exists.png", "--no-clobber"]),
    "plan-budget-unparsable": (["plan", "--budget", "lots"], BAD_REQUEST, ["'lots'"]),
    "plan-dtype-unknown": (["plan", "--dtype", "int8"], BAD_REQUEST, ["int8"]),
    "compare-heatmap-no-clobber": (["compare", "--heatmap", "exists.png", "--no-clobber"], BAD_REQUEST,
                                   ["exists.png", "--no-clobber"]),
    "compare-heatmap-pattern": (["compare", "--heatmap", "h{:02d}.png"], BAD_REQUEST, ["frame pattern"]),
    "analyze-size-small": (["analyze", "--size", "4"], BAD_REQUEST, ["--size", "'4'"]),
    "buckets-request-garbled": (["buckets", "--request", "axb", "--no-profile"], BAD_REQUEST,
                                ["--request", "axb"]),
    # bad input files
    "latents-inf": (["decode", "{D}/inf.safetensors", "--out", "o.png"], BAD_INPUT,
                    ["inf.safetensors", "1 inf", "(0, 1, 0, 0)"]),
    "latents-video-for-2d": (["decode", "{D}/video.safetensors", "--out", "o.png"], BAD_INPUT,
                             ["video.safetensors", "[1, 4, 2, 8, 8]"]),
    "image-empty": (["encode", "{D}/empty.png", "--out", "lat.safetensors"], BAD_INPUT,
                    ["empty.png", "empty"]),
    "image-int32-tiff": (["encode", "{D}/int32.tif", "--out", "lat.safetensors"], BAD_INPUT,
                         ["int32.tif", "int32"]),
    "upscale-truncated-png": (["upscale", "{D}/trunc.png", "--out", "up.png"], BAD_INPUT,
                              ["trunc.png", "truncated"]),
    "upscale-truncated-jpg": (["upscale", "{D}/trunc.jpg", "--out", "up.png"], BAD_INPUT,
                              ["trunc.jpg", "truncated"]),
    "upscale-float-tiff": (["upscale", "{D}/float.tif", "--out", "up.png"], BAD_INPUT,
                           ["float.tif", "float32"]),
    "upscale-folder": (["upscale", "{D}/afolder", "--out", "up.png"], BAD_INPUT, ["afolder", "folder"]),
    "upscale-empty": (["upscale", "{D}/empty.png", "--out", "up.png"], BAD_INPUT, ["empty.png", "empty"]),
    "plan-over-truncated": (["plan", "--over", "{D}/trunc.png", "--image", "g.png"], BAD_INPUT,
                            ["trunc.png"]),
    # won't fit, before the model loads
    "analyze-size-huge": (["analyze", "--size", "100000"], WONT_FIT, ["--size 100000", "800000x800000",
                                                                     "TiB"]),
    "compare-size-huge": (["compare", "--size", "100000x100000"], WONT_FIT, ["--size 100000x100000", "TiB"]),
    # bad input files
    "latents-junk": (["decode", "{D}/junk.safetensors", "--out", "o.png"], BAD_INPUT,
                     ["junk.safetensors", "safetensors"]),
    "latents-truncated": (["decode", "{D}/trunc.safetensors", "--out", "o.png"], BAD_INPUT,
                          ["trunc.safetensors", "truncated"]),
    "latents-empty-file": (["decode", "{D}/empty.safetensors", "--out", "o.png"], BAD_INPUT,
                           ["empty.safetensors", "empty"]),
    "latents-folder": (["decode", "{D}/afolder", "--out", "o.png"], BAD_INPUT, ["afolder", "is a folder"]),
    "latents-no-key": (["decode", "{D}/other.safetensors", "--out", "o.png"], BAD_INPUT,
                       ["other.safetensors", "'latents'", "'other'"]),
    "latents-nan": (["decode", "{D}/nan.safetensors", "--out", "o.png"], BAD_INPUT,
                    ["nan.safetensors", "1 NaN", "(0, 2, 3, 4)"]),
    "latents-int": (["decode", "{D}/int.safetensors", "--out", "o.png"], BAD_INPUT,
                    ["int.safetensors", "I32"]),
    "latents-batch-2": (["decode", "{D}/batch2.safetensors", "--out", "o.png"], BAD_INPUT,
                        ["batch2.safetensors", "[2, 4, 8, 8]"]),
    "latents-3-channels": (["decode", "{D}/c3.safetensors", "--out", "o.png"], BAD_INPUT,
                           ["c3.safetensors", "3 channels", "4-channel"]),
    "image-not-an-image": (["encode", "{D}/notimg.png", "--out", "lat.safetensors"], BAD_INPUT,
                           ["notimg.png"]),
    "image-truncated-png": (["encode", "{D}/trunc.png", "--out", "lat.safetensors"], BAD_INPUT,
                            ["trunc.png", "truncated"]),
    "image-truncated-jpg": (["encode", "{D}/trunc.jpg", "--out", "lat.safetensors"], BAD_INPUT,
                            ["trunc.jpg", "truncated"]),
    "image-float-tiff": (["encode", "{D}/float.tif", "--out", "lat.safetensors"], BAD_INPUT,
                         ["float.tif", "float32"]),
    "image-odd-size": (["encode", "{D}/odd.png", "--out", "lat.safetensors"], BAD_INPUT,
                       ["odd.png", "60x44", "multiples of 8"]),
    "image-folder": (["encode", "{D}/afolder", "--out", "lat.safetensors"], BAD_INPUT, ["afolder", "folder"]),
    "upscale-not-an-image": (["upscale", "{D}/notimg.png", "--out", "up.png"], BAD_INPUT, ["notimg.png"]),
    "plan-over-not-an-image": (["plan", "--over", "{D}/notimg.png", "--image", "g.png"], BAD_INPUT,
                               ["notimg.png"]),
    # won't fit
    "generate-10e7": (GEN + ["--width", "10000000", "--height", "10000000", "--out", "o.png"], WONT_FIT,
                      ["10000000x10000000", "TiB", "would fit"]),
    "plan-8e6": (["plan", "--width", "8000000", "--height", "8000000"], WONT_FIT,
                 ["8000000x8000000", "tiles"]),
    "upscale-scale-1e5": (["upscale", "{D}/img.png", "--out", "up.png", "--scale", "100000"], WONT_FIT,
                          ["100000", "scale of about"]),
    # model problems
    "model-index-malformed": (GEN + ["--out", "o.png", "--model", "{D}/badindex"], MODEL,
                              ["model_index.json", "not valid JSON"]),
    "model-index-missing": (GEN + ["--out", "o.png", "--model", "{D}/noindex"], MODEL,
                            ["noindex", "model_index.json"]),
    "model-index-no-class": (GEN + ["--out", "o.png", "--model", "{D}/noclass"], MODEL, ["_class_name"]),
    "model-incomplete": (GEN + ["--out", "o.png", "--model", "{D}/incomplete"], MODEL,
                         ["component 'unet'", "incomplete/unet' is missing"]),
    "config-no-index": (GEN + ["--out", "o.png", "--model", "{D}/ckpt.safetensors", "--config",
                               "{D}/noindex"],
                        MODEL, ["noindex", "model_index.json"]),
}


@pytest.fixture(autouse=True)
def _quiet_diffusers():
    """diffusers binds its log handler to the stderr of the test that first imported it (closed by now,
    so its warnings print a 'Logging error' traceback): its warnings are not what these tests check."""
    from diffusers.utils import logging as dlog

    level = dlog.get_verbosity()
    dlog.set_verbosity_error()
    yield
    dlog.set_verbosity(level)


def _prepare(cwd):
    (cwd / "dir.png").mkdir()
    (cwd / "file.txt").write_text("a file\n")
    (cwd / "exists.png").write_bytes(b"the user's old picture")
    (cwd / "exists.safetensors").write_bytes(b"the user's old latents")


@pytest.mark.parametrize("name", sorted(CASES))
def test_cli_fault(name, inputs, tmp_path, monkeypatch, capsys):
    argv, code, needles = CASES[name]
    argv = [a.replace("{D}", str(inputs)) for a in argv]
    monkeypatch.chdir(tmp_path)
    _prepare(tmp_path)
    before, inputs_before = _listing(tmp_path), _listing(inputs)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == code, err
    assert len(errors) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    assert _listing(tmp_path) == before, "an output or temporary file was left behind"
    assert (tmp_path / "exists.png").read_bytes() == b"the user's old picture"
    assert (tmp_path / "exists.safetensors").read_bytes() == b"the user's old latents"
    assert _listing(inputs) == inputs_before


def test_existing_output_is_noted_and_replaced_only_when_complete(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "o.png").write_bytes(b"old")
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--width", "64", "--height", "64", "--tile", "4", "--image", "o.png"])
    assert exit_info.value.code == 0
    assert "exists; it is replaced once the new file is complete" in capsys.readouterr().err
    assert (tmp_path / "o.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.png"]


def test_encode_reads_16_bit_grey_at_its_depth(tmp_path, monkeypatch, capsys):
    """The issue's 16-bit grey PNG was clipped to near white by convert('RGB'); now its levels are kept."""
    from safetensors.torch import load_file

    from tilewise.pipelines import load_pipeline

    monkeypatch.chdir(tmp_path)
    grey = (np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16)  # 0 .. 65520
    Image.fromarray(grey).save(tmp_path / "g16.png")
    with pytest.raises(SystemExit) as exit_info:
        main(["encode", "g16.png", "--out", "z.safetensors", "--tile", "4", "--quiet"])
    assert exit_info.value.code == 0, capsys.readouterr().err
    vae = load_pipeline(None).pipe.vae
    x = torch.from_numpy(grey.astype(np.float32) / 32767.5 - 1)[None, None].expand(1, 3, 64, 64)
    with torch.no_grad():
        ref = vae.encode(x).latent_dist.mean * vae.config.scaling_factor
    got = load_file(str(tmp_path / "z.safetensors"))["latents"]
    assert (got - ref).abs().max().item() <= 1e-4



def test_upscale_of_a_16_bit_image_writes_16_bits(tmp_path, monkeypatch, capsys):
    from tilewise.sources import read_image

    monkeypatch.chdir(tmp_path)
    rgb = np.random.default_rng(3).integers(0, 65536, (32, 32, 3)).astype(np.uint16)
    import tilewise as tw

    with tw.PNGSink(tmp_path / "in.png", 32, 32, 3, "uint16") as s:
        s.write(0, 0, rgb)
    with pytest.raises(SystemExit) as exit_info:
        main(["upscale", "in.png", "--out", "up.png", "--scale", "1.5", "--steps", "4", "--tile", "4",
              "--overlap", "2", "--vae-tile", "4", "--quiet"])
    err = capsys.readouterr()
    assert exit_info.value.code == 0, err.err
    pic = read_image(tmp_path / "up.png")
    assert (pic.width, pic.height, pic.bits) == (48, 48, 16) and "16-bit" in err.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.png", "up.png"]
