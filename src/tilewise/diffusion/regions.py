"""Regional prompts: a box or mask with its own conditioning that replaces the prompt where it applies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Region:
    """A region of the image (pixel box `(x0, y0, x1, y1)` or mask) conditioned on its own prompt embeddings.

    `mask` is an (H, W) tensor in [0, 1] at pixel or latent resolution. `weight` sets how overlapping regions
    blend; `feather` (pixels) ramps a box's mask linearly from 0 to 1 inside its edges.
    `pooled_prompt_embeds` (SDXL) replaces the pipeline's pooled text embedding where the region applies.
    """

    box: Sequence[int] | None = None
    mask: torch.Tensor | None = None
    prompt_embeds: torch.Tensor | None = None
    pooled_prompt_embeds: torch.Tensor | None = None
    weight: float = 1.0
    feather: int = 0

    def __post_init__(self) -> None:
        if (self.box is None) == (self.mask is None):
            raise ValueError(f"a Region needs exactly one of box or mask, got box={self.box!r} and "
                             f"mask={'a tensor' if self.mask is not None else None}")
        if self.prompt_embeds is None or self.prompt_embeds.ndim != 3:
            shape = None if self.prompt_embeds is None else tuple(self.prompt_embeds.shape)
            raise ValueError(f"Region.prompt_embeds must be a (batch, tokens, dim) tensor, got shape {shape}")
        if not self.weight > 0:
            raise ValueError(f"Region.weight must be > 0, got {self.weight}")
        if self.feather < 0:
            raise ValueError(f"Region.feather must be >= 0 pixels, got {self.feather}")
        if self.box is not None:
            self.box = tuple(int(v) for v in self.box)
            if len(self.box) != 4 or not (0 <= self.box[0] < self.box[2] and 0 <= self.box[1] < self.box[3]):
                raise ValueError(f"Region.box must be (x0, y0, x1, y1) with 0 <= x0 < x1 and 0 <= y0 < y1, "
                                 f"got {self.box}")

    def latent_mask(self, height: int, width: int, scale: int) -> torch.Tensor:
        """The (height, width) latent mask in [0, 1]: pixel coverage averaged over each scale x scale cell."""
        if self.box is not None:
            return _box_mask(self.box, height, width, scale, self.feather)
        return _resample_mask(self.mask, height, width, scale)


def _axis_profile(a: int, b: int, n_px: int, feather: int) -> torch.Tensor:
    """Pixel profile of [a, b) along one axis with a linear ramp of `feather` pixels inside each edge."""
    p = torch.arange(n_px, dtype=torch.float64) + 0.5
    inside = ((p > a) & (p < b)).double()
    if feather == 0:
        return inside
    ramp = torch.minimum(p - a, b - p) / feather
    return inside * ramp.clamp(0, 1)


def _box_mask(box: tuple[int, ...], height: int, width: int, scale: int, feather: int) -> torch.Tensor:
    x0, y0, x1, y1 = box
    H, W = height * scale, width * scale
    if x1 > W or y1 > H:
        raise ValueError(f"region box {box} (x0, y0, x1, y1) leaves the {W}x{H} (width x height) image; "
                         f"valid boxes lie inside 0 <= x <= {W}, 0 <= y <= {H}")
    py = _axis_profile(y0, y1, H, feather).view(height, scale).mean(1)
    px = _axis_profile(x0, x1, W, feather).view(width, scale).mean(1)
    return torch.outer(py, px).float()


def _resample_mask(mask: torch.Tensor, height: int, width: int, scale: int) -> torch.Tensor:
    m = mask.detach().float().cpu()
    if m.ndim != 2:
        raise ValueError(f"Region.mask must be 2-D (H, W), got shape {tuple(m.shape)}")
    if tuple(m.shape) == (height * scale, width * scale) and scale > 1:
        m = F.avg_pool2d(m[None, None], scale)[0, 0]
    elif tuple(m.shape) != (height, width):
        raise ValueError(f"Region.mask of shape {tuple(m.shape)} fits neither the latent ({height}, {width}) "
                         f"nor the image ({height * scale}, {width * scale})")
    if float(m.min()) < 0 or float(m.max()) > 1:
        raise ValueError(f"Region.mask values must lie in [0, 1], got [{float(m.min())}, {float(m.max())}]")
    return m


def region_weights(regions: Sequence[Region], height: int, width: int, scale: int) -> torch.Tensor:
    """(1 + R, H, W) per-pixel weights of the base prompt and each region; they sum to 1 at every pixel.

    Coverage c = max_r m_r; the base prompt gets 1 - c; region r gets c * w_r m_r / sum_s w_s m_s.
    """
    m = torch.stack([r.latent_mask(height, width, scale) for r in regions])
    w = torch.tensor([float(r.weight) for r in regions]).view(-1, 1, 1) * m
    c = m.amax(0).clamp(0, 1)
    total = w.sum(0)
    share = torch.where(total > 0, w / total.clamp_min(1e-12), torch.zeros_like(w))
    return torch.cat([(1 - c)[None], c[None] * share])
