"""Input files, checked before any work and read without losing data: the mirror of `tilewise.sinks`.

- `check_file(path, what)`: there, a regular file, readable, not empty (BadRequest / BadInputFile).
- `check_image(path)`: its size from the header (nothing decoded).
- `read_image(path)` -> `Picture`: 8- and 16-bit grey / RGB(A) PNG, TIFF and Pillow images at their
  depth, alpha kept apart (see `images`), size checked against memory before decoding.
- `check_latents(path)` / `read_latents(path)`: the `latents` tensor of a .safetensors file, its header,
  shape, dtype (and, read, its values) checked.

One file per job: `files`, `images`, `png16` (16-bit PNGs, which Pillow reads at 8 bits), `latents`.
"""

from .files import check_file
from .images import Picture, check_image, read_image
from .latents import check_latents, read_latents
from .png16 import read_png16

__all__ = ["Picture", "check_file", "check_image", "check_latents", "read_image", "read_latents",
           "read_png16"]
