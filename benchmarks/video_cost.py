"""One denoising step of Wan-2.1-14B- and HunyuanVideo-1.5-shaped transformers, untiled vs tiled, counted.

Counted on the meta device (no weights, no memory), with the real depths and widths of the two models'
diffusers configs, at 480p, 720p and 1080p with 81 frames (21 latent frames), one video, no CFG batch:

- FLOPs: `torch.utils.flop_counter.FlopCounterMode` over one transformer call; on meta, scaled-dot-product
  attention runs its math path, so the attention term is the `aten.bmm` count (QK^T and AV).
- peak activation bytes: the largest sum of live tensors the call creates (outputs of every non-aliasing
  op, freed when the last reference goes; weights and inputs not counted), in bf16, with attention
  counted as a fused kernel holds it (its output, not the N x N scores: a `TorchFunctionMode` answers
  `scaled_dot_product_attention` with its output's shape, as flash attention allocates it).
- HunyuanVideo 1.5's forward branches on its inputs' values (`torch.all(image_embeds == 0)`, masked
  reordering of the text tokens), which the meta device has not: its call is counted from the rotary
  table, the patch embedding, the 54 blocks over 1000 + 256 + 729 text and image-embedding tokens and the
  output projection, as its forward runs them (the text refiner's few hundred tokens are left out).
- tiled = the plan's tile count (`TiledDenoiser.count`) x one tile's call for FLOPs; for the peak, one
  tile's call (tiles run one after another) plus the fused prediction's float32 value and weight buffers.
  Tiles span every latent frame (no frame windows); spatial tiles of the 480p latent's size.

    .venv/bin/python benchmarks/video_cost.py --out benchmarks/results_video_cost.md
"""

from __future__ import annotations

import argparse
import weakref

import torch
from diffusers import HunyuanVideo15Transformer3DModel, WanTransformer3DModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from tilewise.diffusion import TiledDenoiser

# transformer/config.json of Wan-AI/Wan2.1-T2V-14B-Diffusers and hunyuanvideo-community/HunyuanVideo-1.5
WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
               out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
               cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
HUNYUAN_15 = dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128,
                  num_layers=54, num_refiner_layers=2, patch_size=1, patch_size_t=1, text_embed_dim=3584,
                  text_embed_2_dim=1472, image_embed_dim=1152, rope_axes_dim=(16, 56, 56), task_type="t2v")
SIZES = {"480p": (480, 832), "720p": (720, 1280), "1080p": (1080, 1920)}
VAE = {"wan": 8, "hunyuan-video-1.5": 16}  # pixels per latent pixel (Wan 2.1 VAE; HunyuanVideo 1.5's 16x VAE)
FRAMES = 81  # 21 latent frames (4x temporal)
OVERLAP = {"wan": 16, "hunyuan-video-1.5": 8}  # latent pixels


def build(family: str):
    with torch.device("meta"):
        if family == "wan":
            return WanTransformer3DModel(**WAN_14B).to(torch.bfloat16).eval()
        return HunyuanVideo15Transformer3DModel(**HUNYUAN_15).to(torch.bfloat16).eval()


def inputs(family: str, model, t: int, h: int, w: int) -> dict:
    """One step's call as the family's pipeline makes it (batch 1, bf16, meta)."""
    cfg, bf = model.config, dict(device="meta", dtype=torch.bfloat16)
    if family == "wan":
        return dict(hidden_states=torch.empty(1, cfg.in_channels, t, h, w, **bf),
                    timestep=torch.empty(1, device="meta"),
                    encoder_hidden_states=torch.empty(1, 512, cfg.text_dim, **bf), return_dict=False)
    ones = dict(device="meta", dtype=torch.long)
    return dict(hidden_states=torch.empty(1, cfg.in_channels, t, h, w, **bf),
                timestep=torch.empty(1, device="meta"),
                encoder_hidden_states=torch.empty(1, 1000, cfg.text_embed_dim, **bf),
                encoder_attention_mask=torch.ones(1, 1000, **ones),
                encoder_hidden_states_2=torch.empty(1, 256, cfg.text_embed_2_dim, **bf),
                encoder_attention_mask_2=torch.ones(1, 256, **ones),
                image_embeds=torch.empty(1, 729, cfg.image_embed_dim, **bf), return_dict=False)


def hunyuan15_call(model, x, n_text: int = 1000 + 256 + 729):
    """HunyuanVideo 1.5's step on meta: rotary table, patch embedding, blocks, output projection."""
    rotary = model.rope(x)
    temb = model.time_embed(torch.empty(1, device="meta", dtype=x.dtype))
    h = model.x_embedder(x)
    enc = torch.empty(1, n_text, h.shape[-1], device="meta", dtype=h.dtype)
    mask = torch.ones(1, n_text, device="meta", dtype=torch.bool)
    for block in model.transformer_blocks:
        h, enc = block(h, enc, temb, mask, rotary)
    return model.proj_out(model.norm_out(h, temb))


def step(family: str, model, kw: dict):
    """One denoising step's transformer call."""
    if family == "wan":
        return lambda: model(**kw)
    return lambda: hunyuan15_call(model, kw["hidden_states"])


def flops(fn) -> tuple[int, int]:
    """(all FLOPs, attention bmm FLOPs) of one call."""
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        fn()
    counts = counter.get_flop_counts().get("Global", {})
    return int(sum(counts.values())), int(sum(v for k, v in counts.items() if "bmm" in str(k)))


class FusedAttention(TorchFunctionMode):
    """scaled_dot_product_attention answered with its output's shape, as a fused kernel allocates it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            kw = dict(zip(("query", "key", "value"), args)) | (kwargs or {})
            q, v = kw["query"], kw["value"]
            return q.new_empty((*q.shape[:-1], v.shape[-1]))
        return func(*args, **(kwargs or {}))


class LiveBytes(TorchDispatchMode):
    """The peak of live bytes the call creates: every non-aliasing op's outputs, until they are freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliasing = any(r.alias_info is not None for r in func._schema.returns)
        if not aliasing:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    n = t.numel() * t.element_size()
                    self.live += n
                    weakref.finalize(t, self._free, n)
        self.peak = max(self.peak, self.live)
        return out


def peak_bytes(fn) -> int:
    mode = LiveBytes()
    with torch.no_grad(), FusedAttention(), mode:
        fn()
    return mode.peak


def row(family: str, size: str) -> dict:
    model = build(family)
    px_h, px_w = SIZES[size]
    f = VAE[family]
    T, H, W = (FRAMES - 1) // 4 + 1, px_h // f, px_w // f
    th, tw = SIZES["480p"][0] // f, SIZES["480p"][1] // f
    den = TiledDenoiser(model, tile_size=(th, tw), overlap=OVERLAP[family], method="mixture")
    n = den.count(H, W, frames=T)
    th, tw = min(th, H), min(tw, W)
    call, tile = inputs(family, model, T, H, W), inputs(family, model, T, th, tw)
    total, attn = flops(step(family, model, call))
    t_total, t_attn = flops(step(family, model, tile))
    acc = 2 * 4 * model.config.out_channels * T * H * W if n > 1 else 0  # fused value + weight, float32
    return dict(family=family, size=size, latent=(T, H, W),
                tokens=T * H * W // 4 if family == "wan" else T * H * W, tiles=n, untiled=total,
                tiled=n * t_total, untiled_attn=attn, tiled_attn=n * t_attn,
                untiled_peak=peak_bytes(step(family, model, call)),
                tiled_peak=peak_bytes(step(family, model, tile)) + acc)


def gib(b: int) -> str:
    return f"{b / 2**30:.1f}"


def markdown(rows: list[dict]) -> str:
    out = ["| family | size | latent (T, H, W) | image tokens | tiles | untiled FLOPs | tiled FLOPs | "
           "tiled / untiled | untiled attention | tiled attention | untiled peak GiB | tiled peak GiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['family']} | {r['size']} | {r['latent']} | {r['tokens']} | {r['tiles']} | "
                   f"{r['untiled']:.3g} | {r['tiled']:.3g} | {r['tiled'] / r['untiled']:.3f} | "
                   f"{r['untiled_attn']:.3g} | {r['tiled_attn']:.3g} | {gib(r['untiled_peak'])} | "
                   f"{gib(r['tiled_peak'])} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="markdown file for the table (default: print)")
    parser.add_argument("--sizes", default="480p,720p,1080p")
    parser.add_argument("--families", default="wan,hunyuan-video-1.5")
    args = parser.parse_args()
    rows = [row(fam, size) for fam in args.families.split(",") for size in args.sizes.split(",")]
    text = markdown(rows)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
