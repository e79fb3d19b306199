"""The synthetic dataset of the jobs tests: scikit-image's photos cut and resized to mixed sizes and aspect
ratios, saved as PNG and JPEG in nested folders, with a few corrupt files among them."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")
# files that cannot be bucketed (header unreadable), with what is wrong with them
CORRUPT = {"bad/noise.png": "random bytes", "bad/empty.jpg": "0 bytes",
           "bad/cut.png": "cut inside its header"}
# a file whose header reads but whose pixels do not: bucketed, then listed as failed by the cache
TRUNCATED = "bad/truncated_body.png"


def photos() -> list[np.ndarray]:
    import skimage.data

    return [getattr(skimage.data, name)() for name in PHOTOS]


def sizes(n: int, seed: int = 0, low: int = 24, high: int = 120) -> list[tuple[int, int]]:
    """n (width, height) pairs of mixed sizes and aspect ratios (1:3 to 3:1)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        aspect = float(np.exp(rng.uniform(np.log(1 / 3), np.log(3))))
        side = float(rng.uniform(low, high))
        out.append((max(8, round(side * aspect ** 0.5)), max(8, round(side / aspect ** 0.5))))
    return out


def cut(photo: np.ndarray, size: tuple[int, int], rng) -> np.ndarray:
    """A random window of the photo with the aspect of `size`, resized to it."""
    w, h = size
    H, W = photo.shape[:2]
    scale = min(W / w, H / h) * rng.uniform(0.4, 1.0)
    cw, ch = max(1, int(w * scale)), max(1, int(h * scale))
    y, x = int(rng.integers(0, H - ch + 1)), int(rng.integers(0, W - cw + 1))
    return np.asarray(Image.fromarray(photo[y:y + ch, x:x + cw]).resize((w, h), Image.BICUBIC))


def make_images(n: int, seed: int = 0, **kw) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    pics = photos()
    return [cut(pics[i % len(pics)], s, rng) for i, s in enumerate(sizes(n, seed, **kw))]


def write_folder(root: Path, images: list[np.ndarray], corrupt: bool = True) -> Path:
    """Images as root/dK/NNNN.png (every fourth a JPEG), plus the corrupt files."""
    root.mkdir(parents=True, exist_ok=True)
    for i, a in enumerate(images):
        folder = root / f"d{i % 3}"
        folder.mkdir(exist_ok=True)
        if i % 4 == 3:
            Image.fromarray(a).save(folder / f"{i:04d}.jpg", quality=95)
        else:
            Image.fromarray(a).save(folder / f"{i:04d}.png")
        (folder / f"{i:04d}.txt").write_text("a caption, not an image")
    if corrupt:
        write_corrupt(root, images[0])
    return root


def png_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def write_corrupt(root: Path, a: np.ndarray) -> None:
    (root / "bad").mkdir(exist_ok=True)
    (root / "bad/noise.png").write_bytes(np.random.default_rng(0).integers(0, 256, 500, np.uint8).tobytes())
    (root / "bad/empty.jpg").write_bytes(b"")
    data = png_bytes(a)
    (root / "bad/cut.png").write_bytes(data[:20])
    (root / TRUNCATED).write_bytes(data[: len(data) // 3])


# ---- a worker killed mid-job ---------------------------------------------------------------------------
from dataclasses import dataclass  # noqa: E402

from tilewise.jobs.batch import RunnerFactory  # noqa: E402


@dataclass(frozen=True)
class CrashOnce(RunnerFactory):
    """A runner factory whose runner kills its own worker process (os._exit) the first time it reaches
    `victim`, before writing anything: `marker` records that it did, so the retried task goes through."""

    marker: str = ""
    victim: str = ""

    def __call__(self):
        import os

        inner = super().__call__()

        def run(item, target):
            if item.name == self.victim and not os.path.exists(self.marker):
                with open(self.marker, "w") as f:
                    f.write(str(os.getpid()))
                os._exit(1)
            inner(item, target)

        return run
