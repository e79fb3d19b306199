"""Training data for the embedded default models: images that ship inside the scikit-image wheel.

Every image is split into a training part and a held-out strip (its right-most HOLDOUT_FRACTION of
columns); no training crop ever touches the strip, and the model card's reconstruction figures are
measured on fixed crops taken from it.
"""

from __future__ import annotations

import numpy as np
import torch

HOLDOUT_FRACTION = 0.2

# skimage.data loader -> the vocabulary words that name it (the first one is the class name).
# Every loader here reads a file bundled in the wheel (no pooch download).
IMAGES: dict[str, tuple[str, ...]] = {
    "astronaut": ("astronaut",),
    "coffee": ("coffee",),
    "chelsea": ("cat", "chelsea"),
    "grass": ("grass",),
    "gravel": ("gravel",),
    "brick": ("brick",),
    "rocket": ("rocket",),
    "hubble_deep_field": ("galaxy",),
    "immunohistochemistry": ("cells",),
    "moon": ("moon",),
}

# prompt templates seen in training; "{w}" is a class word
TEMPLATES = ("{w}", "a {w}", "a photo of {w}", "{w} texture")


def load_images() -> dict[str, np.ndarray]:
    """Load every training image as float32 RGB in [-1, 1], shape (H, W, 3)."""
    import skimage.data

    out = {}
    for name in IMAGES:
        im = np.asarray(getattr(skimage.data, name)())
        if im.ndim == 2:
            im = np.repeat(im[..., None], 3, axis=2)
        out[name] = im[..., :3].astype(np.float32) / 127.5 - 1.0
    return out


def split(im: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split an image into (training part, held-out right strip) by columns."""
    cut = int(round(im.shape[1] * (1 - HOLDOUT_FRACTION)))
    return im[:, :cut], im[:, cut:]


def random_crop(im: np.ndarray, rng: np.random.Generator, out: int = 64, lo: int = 64, hi: int = 128):
    """A random square crop of side in [lo, hi] resized to `out`, flipped horizontally half the time."""
    h, w = im.shape[:2]
    s = int(rng.integers(lo, min(hi, h, w) + 1))
    y, x = int(rng.integers(0, h - s + 1)), int(rng.integers(0, w - s + 1))
    t = torch.from_numpy(np.ascontiguousarray(im[y:y + s, x:x + s])).permute(2, 0, 1)[None]
    if s != out:
        t = torch.nn.functional.interpolate(t, size=(out, out), mode="bilinear", antialias=True,
                                            align_corners=False)
    if rng.random() < 0.5:
        t = t.flip(-1)
    return t[0]


def heldout_crops(images: dict[str, np.ndarray], size: int = 64, per_image: int = 4) -> torch.Tensor:
    """Fixed, evenly spaced crops of the held-out strips: (N, 3, size, size) in [-1, 1]."""
    crops = []
    for im in images.values():
        strip = split(im)[1]
        h, w = strip.shape[:2]
        for y in np.linspace(0, h - size, per_image).astype(int):
            x = (w - size) // 2
            crop = np.ascontiguousarray(strip[y:y + size, x:x + size])
            crops.append(torch.from_numpy(crop).permute(2, 0, 1))
    return torch.stack(crops)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of images in [-1, 1] (peak-to-peak 2), over the whole batch."""
    mse = ((a.clamp(-1, 1) - b.clamp(-1, 1)) ** 2).mean().item()
    return float(10 * np.log10(4.0 / mse))
