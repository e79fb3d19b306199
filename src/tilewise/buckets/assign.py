"""One request's assignment to a bucket: the transform, its inverse, masks, SDXL micro-conditioning.

Sizes follow the issue: requests and buckets are ``(width, height)``; boxes are ``(y0, y1, x0, x1)``
half-open; SDXL micro-conditioning is ``(h, w)`` / ``(top, left)`` as diffusers expects.

What each policy does (``apply``):

- ``pad``: no resampling; the request is placed at ``pad`` offsets inside a bucket at least as large;
- ``resize`` with ``fit="cover"``: aspect-preserving resize until the image covers the bucket, then a
  crop at ``crop_top_left`` of the *resized* image (the kohya / SDXL training recipe);
- ``resize`` with ``fit="inside"``: aspect-preserving resize until the image fits inside, then pad;
- ``crop``: no resampling; a bucket no larger than the request is cut out at ``crop_top_left``.

``restore`` is the geometric inverse back to exactly the requested size. Content that ``apply`` cut away
cannot come back: those pixels are filled with ``fill`` and flagged by ``cut_mask``.

numpy is imported inside the two mask properties, so that `import tilewise.buckets` (planning and assignment
are pure Python) imports no numpy, PIL or torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..geometry import Box
from . import imageops

Size = tuple[int, int]  # (width, height)


def aspect_error(request: Size, bucket: Size) -> float:
    """Relative aspect mismatch max(a_b/a_r, a_r/a_b) - 1 of a bucket for a request (0 = same aspect)."""
    r = (bucket[0] / bucket[1]) / (request[0] / request[1])
    return max(r, 1.0 / r) - 1.0


def _round(x: float) -> int:
    """Round half up (Python's round() is banker's rounding)."""
    return int(math.floor(x + 0.5))


@dataclass(frozen=True)
class Assignment:
    """What was done to fit a (width, height) request into a bucket, and how to undo it."""

    request: Size
    bucket: Size
    policy: str  # "pad" | "resize" | "crop"
    fit: str | None  # "cover" | "inside" for policy="resize", else None
    resized: Size  # (width, height) after resampling (== request when nothing was resampled)
    crop_top_left: tuple[int, int]  # (top, left) of the kept window in the resized image
    pad: tuple[int, int, int, int]  # (top, bottom, left, right) padding inside the bucket
    latent_factor: int = 8
    resample: str = "bicubic"
    fill: float = 0

    # ---- geometry -------------------------------------------------------------------------------
    @property
    def scale(self) -> tuple[float, float]:
        """Resize factors (s_y, s_x) = resized / requested per axis (1.0 when not resampled)."""
        return self.resized[1] / self.request[1], self.resized[0] / self.request[0]

    @property
    def content_box(self) -> Box:
        """Where the (resized) content sits inside the bucket, (y0, y1, x0, x1)."""
        top, bottom, left, right = self.pad
        return top, self.bucket[1] - bottom, left, self.bucket[0] - right

    @property
    def window(self) -> Box:
        """The part of the request the bucket still shows, in request pixels (y0, y1, x0, x1)."""
        top, left = self.crop_top_left
        y0, y1, x0, x1 = self.content_box
        s_y, s_x = self.scale
        h, w = self.request[1], self.request[0]
        rows = (min(h, max(0, _round(top / s_y))), min(h, max(0, _round((top + y1 - y0) / s_y))))
        cols = (min(w, max(0, _round(left / s_x))), min(w, max(0, _round((left + x1 - x0) / s_x))))
        return rows[0], rows[1], cols[0], cols[1]

    # ---- masks and fractions --------------------------------------------------------------------
    @property
    def pixel_mask(self) -> Any:
        """Bucket-resolution bool array (H, W): True at padded positions."""
        import numpy as np

        m = np.ones((self.bucket[1], self.bucket[0]), dtype=bool)
        y0, y1, x0, x1 = self.content_box
        m[y0:y1, x0:x1] = False
        return m

    @property
    def mask(self) -> Any:
        """Latent-resolution float32 array (H/f, W/f): fraction of each latent cell that is padding."""
        f = self.latent_factor
        m = self.pixel_mask
        return m.reshape(m.shape[0] // f, f, m.shape[1] // f, f).mean(axis=(1, 3), dtype="float32")

    @property
    def cut_mask(self) -> Any:
        """Request-resolution bool array (H, W): True where content was cut away and cannot be restored."""
        import numpy as np

        m = np.ones((self.request[1], self.request[0]), dtype=bool)
        y0, y1, x0, x1 = self.window
        m[y0:y1, x0:x1] = False
        return m

    @property
    def padded_pixels(self) -> int:
        """Number of padded positions in the bucket, in pixels."""
        y0, y1, x0, x1 = self.content_box
        return self.bucket[0] * self.bucket[1] - (y1 - y0) * (x1 - x0)

    @property
    def pad_fraction(self) -> float:
        """Padded positions / bucket positions."""
        return self.padded_pixels / (self.bucket[0] * self.bucket[1])

    @property
    def cut_fraction(self) -> float:
        """Requested pixels cut away / requested pixels."""
        y0, y1, x0, x1 = self.window
        return 1.0 - (y1 - y0) * (x1 - x0) / (self.request[0] * self.request[1])

    @property
    def aspect_error(self) -> float:
        """Relative aspect mismatch between bucket and request (0 = same aspect)."""
        return aspect_error(self.request, self.bucket)

    # ---- conditioning ---------------------------------------------------------------------------
    @property
    def micro_conditioning(self) -> dict[str, tuple[int, int]]:
        """SDXL micro-conditioning from what apply() does: original (h, w), crop (top, left), target."""
        y0, y1, x0, x1 = self.content_box
        return {
            "original_size": (self.request[1], self.request[0]),
            "crops_coords_top_left": tuple(self.crop_top_left),
            "target_size": (y1 - y0, x1 - x0),
        }

    # ---- transforms -----------------------------------------------------------------------------
    def apply(self, image: Any) -> Any:
        """Forward transform: request-sized image -> bucket-sized image (resize, crop, pad as planned)."""
        self._check_size(image, self.request, "apply")
        x = image
        if self.resized != self.request:
            x = imageops.resize(x, (self.resized[1], self.resized[0]), self.resample)
        y0, y1, x0, x1 = self.content_box
        top, left = self.crop_top_left
        x = imageops.crop(x, (top, top + y1 - y0, left, left + x1 - x0))
        if any(self.pad):
            x = imageops.pad(x, self.pad, self.fill)
        return x

    def restore(self, output: Any) -> Any:
        """Inverse transform: bucket-sized output -> exactly the requested size; cut pixels get `fill`."""
        self._check_size(output, self.bucket, "restore")
        x = imageops.crop(output, self.content_box)
        y0, y1, x0, x1 = self.window
        if self.resized != self.request:
            x = imageops.resize(x, (y1 - y0, x1 - x0), self.resample)
        h, w = self.request[1], self.request[0]
        if (y0, y1, x0, x1) != (0, h, 0, w):
            x = imageops.pad(x, (y0, h - y1, x0, w - x1), self.fill)
        return x

    def _check_size(self, image: Any, expected: Size, what: str) -> None:
        """Raise ValueError when an image's size is not the (width, height) the transform expects."""
        h, w = imageops.size(image)
        if (w, h) != tuple(expected):
            raise ValueError(
                f"{what}() expects a {expected[0]}x{expected[1]} (width x height) image, got {w}x{h}"
            )

    # ---- explanation ----------------------------------------------------------------------------
    def explain(self) -> str:
        """A plain-language paragraph: what changed, the conditioning sent, and why it matches."""
        (w, h), (bw, bh) = self.request, self.bucket
        parts = [f"Request {w}x{h} (w x h) goes to bucket {bw}x{bh} by policy '{self.policy}'"]
        parts[0] += f" (fit='{self.fit}')." if self.fit else "."
        parts.append(self._explain_resize())
        parts.append(self._explain_crop())
        parts.append(self._explain_pad())
        mc = self.micro_conditioning
        parts.append(
            f"SDXL micro-conditioning: original_size={mc['original_size']} (the request, h x w), "
            f"crops_coords_top_left={mc['crops_coords_top_left']} (top, left of the kept window in the "
            f"{'resized' if self.resized != self.request else 'original'} image), "
            f"target_size={mc['target_size']} (the content the model renders, h x w); these are the "
            "numbers apply() actually used, so training and generation metadata agree."
        )
        return " ".join(p for p in parts if p)

    def _explain_resize(self) -> str:
        """Sentence about resampling, or none."""
        if self.resized == self.request:
            return "No resampling."
        s_y, s_x = self.scale
        return (
            f"The image is resized by {s_x:.4f} (w) x {s_y:.4f} (h) to {self.resized[0]}x{self.resized[1]}, "
            f"keeping the aspect ratio (aspect error of the bucket {self.aspect_error:.1%})."
        )

    def _explain_crop(self) -> str:
        """Sentence about cropping, or none."""
        rw, rh = self.resized
        y0, y1, x0, x1 = self.content_box
        kept_h, kept_w = y1 - y0, x1 - x0
        if (kept_w, kept_h) == (rw, rh):
            return "Nothing is cropped."
        top, left = self.crop_top_left
        return (
            f"{rh - kept_h} rows ({top} at the top, {rh - kept_h - top} at the bottom) and {rw - kept_w} "
            f"columns ({left} at the left, {rw - kept_w - left} at the right) are cropped away, "
            f"{self.cut_fraction:.1%} of the requested pixels; restore() fills them with {self.fill} and "
            "flags them in cut_mask instead of inventing pixels."
        )

    def _explain_pad(self) -> str:
        """Sentence about padding, or none."""
        if not any(self.pad):
            return "Nothing is padded."
        top, bottom, left, right = self.pad
        f = self.latent_factor
        return (
            f"{self.padded_pixels} padded positions ({self.pad_fraction:.1%} of the bucket): {top} rows at "
            f"the top, {bottom} at the bottom, {left} columns at the left, {right} at the right, filled "
            f"with {self.fill}. `mask` marks them at latent resolution (1/{f}: fraction of each latent cell "
            "that is padding) so a loss or an inpainting-style step can ignore or overwrite them; no "
            "positional coordinates are added. restore() crops the content box back out"
            + (" exactly." if self.resized == self.request else " and resamples it to the request size.")
        )
