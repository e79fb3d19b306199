"""Image datasets: a folder (recursive), a Hugging Face `datasets` dataset saved to disk, webdataset shards.

Each reader lists its items by a stable key, in a fixed order, and gives two things per item: its size
read from the header (`size`: nothing decoded) and its pixels (`pixels`: (H, W, 3) uint8 or uint16, as
`tilewise.sources.read_image` reads them). An item that cannot be read raises `BadInputFile` naming the
key and the reason; the callers list it and go on.

- folder: every file with an image suffix under it, keys are paths relative to it (POSIX, sorted);
- webdataset: a .tar shard or a folder of them, read with the stdlib `tarfile`; an item is a member with
  an image suffix, keyed "SHARD.tar/MEMBER";
- Hugging Face: a folder `datasets.Dataset.save_to_disk` wrote (`dataset_info.json`, `state.json`), its
  first `Image` column read undecoded (the stored bytes, or the path they came from), keyed by row index.
  `datasets` is imported only here (the `tilewise[datasets]` extra).
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import BadInputFile, BadRequest
from ..sources import check_image, read_image

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif")
KINDS = ("folder", "webdataset", "datasets")


class ImageDataset:
    """The common face of the readers: `kind`, `root`, `keys()`, `size(key)`, `pixels(key)`."""

    kind = "folder"

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def keys(self) -> list[str]:
        raise NotImplementedError

    def size(self, key: str) -> tuple[int, int]:
        """(width, height) from the item's header; BadInputFile when it cannot be read."""
        raise NotImplementedError

    def pixels(self, key: str) -> Any:
        """(H, W, 3) uint8 / uint16 samples of the item; BadInputFile when it cannot be decoded."""
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.keys())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r}, {len(self)} items)"


class FolderDataset(ImageDataset):
    """Every image file under a folder, recursively (by suffix); keys are relative POSIX paths, sorted."""

    kind = "folder"

    def __init__(self, root: str | os.PathLike):
        super().__init__(root)
        self._keys = sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*")
                            if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".")
                            and p.is_file())

    def keys(self) -> list[str]:
        return self._keys

    def size(self, key: str) -> tuple[int, int]:
        return check_image(self.root / key, what=f"image {key!r}")

    def pixels(self, key: str) -> Any:
        return read_image(self.root / key, what=f"image {key!r}").pixels


class TarDataset(ImageDataset):
    """Webdataset shards (one .tar, or every .tar in a folder, sorted): members with an image suffix."""

    kind = "webdataset"

    def __init__(self, root: str | os.PathLike):
        super().__init__(root)
        shards = [self.root] if self.root.is_file() else sorted(self.root.glob("*.tar"))
        self._members: dict[str, tuple[Path, tarfile.TarInfo]] = {}
        for shard in shards:
            try:
                with tarfile.open(shard) as tar:
                    for m in tar.getmembers():
                        if m.isfile() and Path(m.name).suffix.lower() in IMAGE_SUFFIXES:
                            self._members[f"{shard.name}/{m.name}"] = (shard, m)
            except (tarfile.TarError, OSError) as e:
                raise BadInputFile(f"webdataset shard {str(shard)!r} cannot be read: {e}") from e

    def keys(self) -> list[str]:
        return list(self._members)

    def _bytes(self, key: str) -> bytes:
        shard, member = self._members[key]
        with tarfile.open(shard) as tar:
            f = tar.extractfile(member)
            return f.read() if f is not None else b""

    def size(self, key: str) -> tuple[int, int]:
        return header_size(self._bytes(key), key)

    def pixels(self, key: str) -> Any:
        return decode_bytes(self._bytes(key), key)


class HFDataset(ImageDataset):
    """A Hugging Face dataset saved with `save_to_disk`: its first Image column, undecoded, by row index."""

    kind = "datasets"

    def __init__(self, root: str | os.PathLike, column: str | None = None):
        super().__init__(root)
        try:
            import datasets  # (lazy: the optional `tilewise[datasets]` extra)
        except ImportError:
            raise BadRequest(f"{str(root)!r} is a Hugging Face dataset; reading it needs the datasets "
                             "package: pip install 'tilewise[datasets]'") from None
        ds = datasets.load_from_disk(str(root))
        if isinstance(ds, datasets.DatasetDict):
            raise BadRequest(f"{str(root)!r} holds splits {list(ds)}; give the folder of one split")
        images = [n for n, f in ds.features.items() if isinstance(f, datasets.Image)]
        if column is None and not images:
            raise BadRequest(f"dataset {str(root)!r} has no Image column (columns: {list(ds.features)})")
        self.column = column or images[0]
        self._ds = ds.cast_column(self.column, datasets.Image(decode=False))
        self._keys = [f"{i:08d}" for i in range(len(ds))]

    def keys(self) -> list[str]:
        return self._keys

    def _bytes(self, key: str) -> bytes:
        value = self._ds[int(key)][self.column]
        if value is None:
            raise BadInputFile(f"item {key!r}: its {self.column!r} is empty")
        if value.get("bytes"):
            return value["bytes"]
        try:
            return Path(value["path"]).read_bytes()
        except (OSError, TypeError) as e:
            raise BadInputFile(f"item {key!r}: its image file {value.get('path')!r} cannot be read: "
                               f"{e}") from e

    def size(self, key: str) -> tuple[int, int]:
        return header_size(self._bytes(key), key)

    def pixels(self, key: str) -> Any:
        return decode_bytes(self._bytes(key), key)


def header_size(data: bytes, key: str) -> tuple[int, int]:
    """(width, height) of encoded image bytes from their header (Pillow opens lazily: nothing decoded)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise BadInputFile(f"image {key!r} is empty (0 bytes)")
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.size
    except UnidentifiedImageError as e:
        raise BadInputFile(f"image {key!r} is not an image file tilewise can read") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise BadInputFile(f"image {key!r} is truncated or corrupt: {e}") from e


def decode_bytes(data: bytes, key: str) -> Any:
    """(H, W, 3) samples of encoded image bytes, read as `read_image` reads a file (through a temporary)."""
    import tempfile

    suffix = Path(key).suffix or ".img"
    with tempfile.NamedTemporaryFile(suffix=suffix) as f:
        f.write(data)
        f.flush()
        return read_image(f.name, what=f"image {key!r}").pixels


def dataset_kind(path: str | os.PathLike) -> str:
    """Which reader a DATASET path needs: 'datasets' (save_to_disk), 'webdataset' (.tar shards), 'folder'."""
    p = Path(path)
    if not p.exists():
        raise BadRequest(f"dataset {os.fspath(path)!r} does not exist")
    if p.is_file():
        if p.suffix == ".tar":
            return "webdataset"
        raise BadRequest(f"dataset {os.fspath(path)!r} is a file: give a folder of images, a folder "
                         "save_to_disk wrote, or webdataset .tar shards")
    if (p / "dataset_info.json").is_file() and (p / "state.json").is_file():
        return "datasets"
    if any(p.glob("*.tar")) and not any(q.suffix.lower() in IMAGE_SUFFIXES for q in p.iterdir()):
        return "webdataset"
    return "folder"


def open_dataset(path: str | os.PathLike, kind: str | None = None) -> ImageDataset:
    """The reader for a DATASET path (`kind` one of KINDS, or None: `dataset_kind` decides)."""
    kind = kind or dataset_kind(path)
    readers = {"folder": FolderDataset, "webdataset": TarDataset, "datasets": HFDataset}
    if kind not in readers:
        raise BadRequest(f"dataset kind must be one of {KINDS}, got {kind!r}")
    return readers[kind](path)


def iter_sizes(dataset: ImageDataset) -> Iterator[tuple[str, tuple[int, int] | None, str | None]]:
    """(key, (width, height), None) for each readable item, (key, None, reason) for each that is not."""
    for key in dataset.keys():
        try:
            yield key, dataset.size(key), None
        except BadInputFile as e:
            yield key, None, str(e)
