"""The Z-Image adapter: diffusers' ZImageTransformer2DModel (ZImagePipeline and its Img2Img).

Z-Image takes lists: `x` one (C, 1, H, W) latent per sample, `cap_feats` one (L_i, D) caption per sample,
and returns a list of predictions. It patchifies 2x2 itself and numbers the image tokens (axis 0: after
the caption; rows and columns from 0) inside its forward; the rotary table is built per sample, so
tiles at different places can share a call. A tile called as it is gets rows and columns from 0
(`positions="tile"`). The public forward takes no positions and the rotary embedder is not a module,
so with `positions="global"` a forward pre-hook on each block that sees the image tokens (the noise
refiner and the main layers; PyTorch's public hook API, `forward` left alone) puts, during one tile call
only, each tile's true rows and columns into the row/column part of the image tokens' rotary table
(axis 0, the caption offset, stays as the model computed it). It relies on those blocks taking the
table as their third argument, image tokens first (diffusers 0.42); the positions test checks it.

ZImagePipeline batches classifier-free guidance as [conditional, unconditional] rows, where the fusion
core's regions read [unconditional, conditional]: a call whose two halves have the same latent has its
halves (latent, conditioning, timestep) swapped on the way in and back on the way out, so that each row's
prediction, and its gradient, is that of its own latent and conditioning.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.utils.rnn import pad_sequence

from .base import Call
from .transformer import TransformerAdapter, hooked


def global_hw_freqs(model, boxes, rows: int, p: int):
    """(tiles x rows, tokens, row/col columns): the rotary table part of each tile's true rows and columns."""
    parts = []
    for y0, y1, x0, x1 in boxes:
        r, c = torch.meshgrid(torch.arange(y0 // p, y1 // p), torch.arange(x0 // p, x1 // p), indexing="ij")
        ids = torch.stack([torch.zeros_like(r), r, c], -1).reshape(-1, 3)
        parts.append(model.rope_embedder(ids.to(model.device))[:, model.config.axes_dims[0] // 2 :])
    return torch.stack(parts).repeat_interleave(rows, dim=0)


def swap_halves(v):
    """[first half, second half] -> [second half, first half] along the batch (tensors with >= 2 rows)."""
    if not isinstance(v, torch.Tensor) or v.ndim == 0 or v.shape[0] % 2:
        return v
    return torch.cat([v[v.shape[0] // 2 :], v[: v.shape[0] // 2]])


class ZImageAdapter(TransformerAdapter):
    """Z-Image: list inputs as one grid, per-row captions (padded, with lengths), per-sample positions."""

    family = "z-image"
    classes = ("ZImageTransformer2DModel",)
    sample_arg, timestep_arg, prompt_arg = "x", "t", "cap_feats"
    rows_args = ("cap_feats", "cap_lens")
    refused = {"controlnet_block_samples": "(Z-Image ControlNet residuals) are spatial and are not tiled "
                                           "yet; run the ControlNet pipeline untiled",
               **dict.fromkeys(("siglip_feats", "image_noise_mask"),
                               "(Z-Image omni image conditioning) is not tiled yet; run the pipeline "
                               "untiled")}

    def parse(self, model, args: tuple, kwargs: dict) -> Call:
        call = super().parse(model, args, kwargs)
        if "cap_feats" not in call.cond:
            raise TypeError(f"TiledDenoiser.forward() for {type(model).__name__} needs cap_feats")
        caps = call.cond["cap_feats"]  # a list of (L_i, D): as a padded tensor, its rows split per tile
        call.cond["cap_feats"] = pad_sequence(list(caps), batch_first=True)
        call.cond["cap_lens"] = torch.tensor([len(c) for c in caps])
        B = call.sample.shape[0]
        if B % 2 == 0 and torch.equal(call.sample[: B // 2], call.sample[B // 2 :]):  # CFG: [cond, uncond]
            # the latent too: its halves are equal in value, not in what gradients reach (row i's input)
            call.sample = swap_halves(call.sample)
            call.cond = {k: swap_halves(v) for k, v in call.cond.items()}
            call.timestep = swap_halves(call.timestep)
            call.layout = "swapped"
        return call

    def to_grid(self, model, given: dict):
        name, x = type(model).__name__, given[self.sample_arg]
        if not isinstance(x, (list, tuple)) or not x or isinstance(x[0], (list, tuple)):
            raise NotImplementedError(f"{name}: x must be a list of (C, 1, H, W) latents; Z-Image omni mode "
                                      "(lists of condition images) is not tiled yet: run the pipeline "
                                      "untiled")
        p, f = given.get("patch_size", 2), given.get("f_patch_size", 1)
        if p != self.align(model) or f != 1 or any(xi.shape != x[0].shape or xi.shape[1] != 1 for xi in x):
            raise ValueError(f"{name}: TiledDenoiser tiles same-size (C, 1, H, W) latents with patch_size 2 "
                             f"and f_patch_size 1; got {[tuple(xi.shape) for xi in x]}, patch {p}, "
                             f"f_patch {f}")
        return torch.stack(list(x)).squeeze(2), None

    def apply_region(self, cond: dict, region, n: int) -> None:
        super().apply_region(cond, region, n)
        cond["cap_lens"] = torch.full((n,), cond["cap_feats"].shape[1], dtype=torch.long)

    def _predict(self, model, call: Call, x, t, cond: dict, boxes, rows: int):
        caps = [c[:n] for c, n in zip(cond["cap_feats"], cond["cap_lens"].tolist(), strict=True)]
        with self._positions(model, call, boxes, rows):
            out = model(list(x.unsqueeze(2).unbind(0)), t, caps, **self.shared_kwargs(call),
                        return_dict=False)
        return torch.stack(list(out[0])).squeeze(2)

    def _positions(self, model, call: Call, boxes, rows: int):
        """positions='global': pre-hooks giving the image tokens the rows and columns they have untiled."""
        H, W = call.sample.shape[-2:]
        if self.positions == "tile" or all(b == (0, H, 0, W) for b in boxes):
            return contextlib.nullcontext()  # tokens of a tile at (0, 0) are numbered as untiled
        hw = global_hw_freqs(model, boxes, rows, self.align(model))
        n_img, d0 = hw.shape[1], model.config.axes_dims[0] // 2

        def hook(module, args):
            if len(args) < 3:
                raise RuntimeError(f"positions='global': {type(module).__name__} was called without its "
                                   "rotary table as third argument (diffusers changed?); use "
                                   "positions='tile'")
            freqs = args[2].clone()
            freqs[:, :n_img, d0:] = hw.to(freqs.device)
            return (*args[:2], freqs, *args[3:])

        stack = contextlib.ExitStack()
        for block in (*model.noise_refiner, *model.layers):
            stack.enter_context(hooked(block, hook, pre=True))
        return stack

    def output(self, call: Call, fused):
        fused = swap_halves(fused) if call.layout == "swapped" else fused
        return self.wrap(call, list(fused.unsqueeze(2).unbind(0)))
