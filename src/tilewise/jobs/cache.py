"""The latent cache: a bucket manifest's images encoded once, in safetensors shards grouped by bucket.

Layout of DIR: `WxH/NNNNN.safetensors` per shard (one bucket's rows, `shard_size` at most, in manifest
order), each holding `latents` (N, C, H/f, W/f) float32 in the layout of the VAE family's latents files,
as its pipeline hands them to its denoiser (`pipelines.image_latents`: (raw - shift) * scaling_factor for
AutoencoderKL, Tiny, DC-AE, VQModel, KVAE, HunyuanImage, AsymmetricKL; Flux.2's patchified 2x2 and
batch-norm normalised, f twice the VAE's; Qwen-Image 2.1's (N, C, 1, H/f, W/f)), and `masks` (N, H/f,
W/f) (padding fraction per latent cell); its metadata names the keys, each latent's sha256, the items
that could not be decoded and how the latents are normalised. Video VAEs are refused.
`DIR/manifest.jsonl` is the bucket manifest with each row's shard, offset and sha256 added, written when
the run ends.

Why safetensors rather than webdataset tars: the trainers that cache latents keep them as safetensors or
torch tensor files, read by index, not as a stream; safetensors maps the file (a row is read without the
rest, in any order a sampler asks), holds no pickle, and is read by torch, numpy and JAX without
tilewise. A shard per bucket keeps a batch's rows together, and few files instead of one per image.

Resumable: the shard plan is a function of the manifest and `shard_size`, each shard is written under a
temporary name and renamed when complete (`tilewise.atomic`), and a rerun keeps every shard whose file
is there and names the planned keys; a crash or Ctrl-C loses at most the shards being written, and no row
is written twice. Within a memory budget every bucket is encoded by the exact TiledVAE planned within
it; without one, images whose bucket is larger than `tile_above` pixels are encoded by the exact tiled
VAE (`TiledVAE`, equal to the untiled encode), the others by the VAE itself, a batch of the bucket at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import atomic_path
from ..errors import BadInputFile, BadRequest
from .manifest import Manifest, ManifestRow, manifest_lines, read_manifest
from .readers import ImageDataset, open_dataset

logger = logging.getLogger(__name__)

CACHE_MANIFEST = "manifest.jsonl"


@dataclass(frozen=True)
class ShardSpec:
    """One planned shard: its file name under DIR, its bucket and the manifest rows (indices) it holds."""

    name: str
    bucket: tuple[int, int]
    indices: tuple[int, ...]


def plan_shards(manifest: Manifest, shard_size: int) -> list[ShardSpec]:
    """Each bucket's rows in manifest order, cut into shards of `shard_size`; named WxH/NNNNN.safetensors."""
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise BadRequest(f"shard_size must be a positive integer, got {shard_size!r}")
    out = []
    for (w, h), idx in sorted(manifest.buckets().items()):
        for k in range(0, len(idx), shard_size):
            out.append(ShardSpec(f"{w}x{h}/{k // shard_size:05d}.safetensors", (w, h),
                                 tuple(idx[k:k + shard_size])))
    return out


@dataclass(frozen=True)
class EncodeSettings:
    """How the cache encodes: images per VAE call, the tiled VAE's threshold (bucket pixels; with a
    memory_budget every bucket goes through the tiled VAE, planned within it) and tile."""

    batch_size: int = 8
    tile_above: int = 512 * 512
    tile_size: int = 32
    memory_budget: str | None = None


class LatentEncoder:
    """A 2-D image VAE that encodes (N, 3, H, W) images in [-1, 1] to latents in its family's layout, as
    its pipeline hands them to its denoiser (`pipelines.image_latents`: the raw latent of the VAE's output,
    the posterior's mean, DC-AE's `latent`, VQModel's and AutoencoderTiny's `latents`, scaled; Flux.2's
    patchified and batch-norm normalised; Qwen-Image 2.1's (N, C, 1, h, w) normalised by mean and std).
    A video VAE is refused: its latents are a video's, not one image's."""

    def __init__(self, vae: Any, settings: EncodeSettings = EncodeSettings()):
        from ..pipelines.image_latents import FRAMED, file_channels, file_metadata, patch

        _check_image_vae(vae)
        self.vae, self.settings = vae, settings
        self._tiled = None
        # latents-file pixels per image pixel: the tile program's encode factor (the trace's, for every
        # family) times Flux.2's 2x2 patches; the manifest's latent factor must be this one
        self.vae_factor = self._tiled_vae().factor("encode")
        self.factor = self.vae_factor * patch(vae)
        self.channels = file_channels(vae)
        self.frame = (1,) if type(vae).__name__ in FRAMED else ()  # Qwen-Image 2.1: (N, C, 1, h, w)
        self.metadata = file_metadata(vae)  # how the shards' latents are normalised

    def tiled(self, pixels: int) -> bool:
        """Whether a bucket of this many pixels goes through the tiled VAE: every bucket within a
        memory_budget (the TiledVAE plans each within it: the plain encode where one tile covers the
        image, tiles where the image is larger than the budget allows), else those past tile_above."""
        return self.settings.memory_budget is not None or pixels > self.settings.tile_above

    def encode(self, x: Any) -> Any:
        """A batch's latents in the family's layout (float32, CPU); the exact tiled encode when the bucket
        is past `tile_above` (or within a memory budget)."""
        import torch

        from ..pipelines.image_latents import as_input, encoded, to_file

        if int(self.vae.config.in_channels) == 4:  # an RGBA VAE (Qwen-Image 2.1): opaque alpha
            x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        with torch.no_grad():
            vae = self._tiled_vae() if self.tiled(x.shape[-1] * x.shape[-2]) else self.vae
            raw = encoded(vae.encode(as_input(self.vae, x).to(self.vae.device, self.vae.dtype)))
        return to_file(self.vae, raw)[0]

    def _tiled_vae(self):
        from ..vae import TiledVAE

        if self._tiled is None:
            s = self.settings
            self._tiled = TiledVAE(self.vae, tile_size=s.tile_size, memory_budget=s.memory_budget,
                                   progress=False)
        return self._tiled


def _check_image_vae(vae: Any) -> None:
    """The latent cache holds image latents: a video VAE (3-D, or SVD's temporal decoder) is refused by
    name; the families the tile programs refuse are refused by TiledVAE, with the reason."""
    from ..locality.classes import BATCHED_VAES, IMAGE_VAES
    from ..locality.video_classes import is_video_vae

    name = type(vae).__name__
    if is_video_vae(vae) or name in BATCHED_VAES:
        raise BadRequest(f"the latent cache encodes images with a 2-D image VAE ({', '.join(IMAGE_VAES)}), "
                         f"but the VAE is a {name}, a video VAE: its latents are a video's (B, C, T, h, w); "
                         "encode videos one by one with `tilewise encode VIDEO --model ...`")


def to_tensor(pixels: Any) -> Any:
    """(H, W, 3) uint8 / uint16 samples -> (3, H, W) float32 in [-1, 1]."""
    import numpy as np
    import torch

    top = 65535.0 if pixels.dtype == np.uint16 else 255.0
    return torch.from_numpy(pixels.astype(np.float32) / (top / 2) - 1.0).permute(2, 0, 1).contiguous()


def sha256(t: Any) -> str:
    """The sha256 of a tensor's float32 bytes (C order): what the cache manifest and the dataset check."""
    return hashlib.sha256(t.float().contiguous().numpy().tobytes()).hexdigest()


def encode_shard(data: ImageDataset, rows: list[ManifestRow], spec: ShardSpec, encoder: LatentEncoder,
                 out_dir: str | os.PathLike) -> dict[str, Any]:
    """Decode, transform and encode one shard's rows and write its file; returns its record."""
    import torch

    images, keys, masks, failed = [], [], [], {}
    for i in spec.indices:
        r = rows[i]
        try:
            images.append(to_tensor(r.transform(data.pixels(r.key))))
        except BadInputFile as e:
            logger.warning("cache: skipped %s: %s", r.key, e)
            failed[r.key] = str(e)
            continue
        keys.append(r.key)
        masks.append(torch.from_numpy(r.assignment.mask))
    bs = encoder.settings.batch_size
    latents = [encoder.encode(torch.stack(images[k:k + bs])) for k in range(0, len(images), bs)]
    z = torch.cat(latents) if latents else torch.zeros(0, encoder.channels or 4, *encoder.frame,
                                                       spec.bucket[1] // encoder.factor,
                                                       spec.bucket[0] // encoder.factor)
    m = torch.stack(masks) if masks else torch.zeros(0, *z.shape[-2:])
    record = {"name": spec.name, "keys": keys, "sha256": [sha256(t) for t in z], "failed": failed}
    _save(Path(out_dir) / spec.name, z, m, record, encoder)
    return record


def _save(path: Path, z: Any, m: Any, record: dict[str, Any], encoder: LatentEncoder) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"keys": json.dumps(record["keys"]), "sha256": json.dumps(record["sha256"]),
            "failed": json.dumps(record["failed"]), **encoder.metadata}
    with atomic_path(path) as tmp:
        save_file({"latents": z, "masks": m.float().contiguous()}, tmp, metadata=meta)


def read_shard_record(path: str | os.PathLike) -> dict[str, Any] | None:
    """The record of a written shard from its metadata, or None when it is not a complete shard."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        return {"name": None, "keys": json.loads(meta["keys"]), "sha256": json.loads(meta["sha256"]),
                "failed": json.loads(meta["failed"])}
    except (OSError, SafetensorError, KeyError, json.JSONDecodeError):
        return None


def _planned(record: dict[str, Any] | None, spec: ShardSpec, rows: list[ManifestRow]) -> bool:
    """Whether a written shard holds exactly the planned rows (each written or listed as failed)."""
    if record is None:
        return False
    keys = set(record["keys"]) | set(record["failed"])
    return keys == {rows[i].key for i in spec.indices} and len(record["keys"]) == len(record["sha256"])


@dataclass
class CacheResult:
    """A cache run: shards written now and kept from before, rows cached, items that failed, seconds."""

    out_dir: str
    written: int
    kept: int
    rows: int
    failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> str:
        lines = [f"{self.rows} latents in {self.written + self.kept} shards ({self.written} written, "
                 f"{self.kept} kept from a previous run) in {self.out_dir}, {len(self.failed)} failed, "
                 f"{self.seconds:.1f}s"]
        lines += [f"  failed {k}: {v}" for k, v in self.failed.items()]
        return "\n".join(lines)


def pending_shards(manifest: Manifest, out_dir: str | os.PathLike, shard_size: int) -> tuple[list, list]:
    """(shards still to write, shards complete from before); stale temporaries of a killed run removed."""
    root = Path(out_dir)
    for tmp in root.glob("*/.*.part"):  # (ours: atomic_path's temporaries; a killed run leaves them)
        tmp.unlink()
    todo, done = [], []
    for spec in plan_shards(manifest, shard_size):
        path = root / spec.name
        ok = path.is_file() and _planned(read_shard_record(path), spec, manifest.rows)
        (done if ok else todo).append(spec)
    return todo, done


def encode_dataset(
    manifest: str | os.PathLike | Manifest,
    out_dir: str | os.PathLike,
    *,
    vae: Any = None,
    model: str | os.PathLike | None = None,
    dataset: str | os.PathLike | ImageDataset | None = None,
    shard_size: int = 64,
    settings: EncodeSettings = EncodeSettings(),
    progress: bool = True,
    ray: Any = None,
    device: str = "auto",
) -> CacheResult:
    """Encode a bucket manifest's images into the latent cache `out_dir` (see the module docstring).

    `vae`: a 2-D image VAE (`locality.classes.IMAGE_VAES`), or `model` (a --model path; default: the
    embedded VAE); `dataset`: the
    images (default: the manifest's own). `ray` (a `jobs.ray_runner.RayRunner`) writes the pending shards
    on a Ray cluster instead, each worker loading `model` once (then `manifest` and `dataset` must be
    paths the workers can read; `device` 'auto' is each worker's GPU where it has one). A rerun continues
    where a killed one stopped."""
    m = manifest if isinstance(manifest, Manifest) else read_manifest(manifest)
    data = dataset if isinstance(dataset, ImageDataset) else open_dataset(
        dataset or m.header["dataset"], None if dataset else m.header["kind"])
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    todo, done = pending_shards(m, out_dir, shard_size)
    logger.info("cache %s: %d shards to write, %d kept", out_dir, len(todo), len(done))
    if ray is not None and todo:
        if isinstance(manifest, Manifest) or vae is not None:
            raise BadRequest("on Ray the workers load the manifest and the model themselves: give the "
                             "manifest as a path and the VAE as model= (a path, or None: the embedded one)")
        config = {"manifest": os.fspath(manifest), "dataset": os.fspath(data.root), "kind": data.kind,
                  "model": None if model is None else os.fspath(model), "device": device,
                  "settings": asdict(settings)}
        ray.encode_shards(config, todo, out_dir)
    elif todo:
        encoder = LatentEncoder(_load_vae(vae, model), settings)
        _check_factor(m, encoder)
        _write_shards(data, m, todo, encoder, out_dir, progress)
    rows, failed = write_cache_manifest(m, out_dir, shard_size)
    return CacheResult(os.fspath(out_dir), len(todo), len(done), rows, failed, time.perf_counter() - t0)


def _write_shards(data: ImageDataset, m: Manifest, todo: list[ShardSpec], encoder: LatentEncoder,
                  out_dir: str | os.PathLike, progress: bool) -> None:
    """The pending shards in this process, a progress bar over their images."""
    from tqdm.auto import tqdm

    with tqdm(total=sum(len(s.indices) for s in todo), desc="encode", unit="image",
              disable=not progress) as bar:
        for spec in todo:
            encode_shard(data, m.rows, spec, encoder, out_dir)
            bar.update(len(spec.indices))


def _load_vae(vae: Any, model: str | os.PathLike | None, config: Any = None, device: str = "cpu") -> Any:
    """The VAE given, or --model's, or the embedded one (on `device`)."""
    if vae is not None:
        return vae
    if model is None:
        from ..models import load_default_vae

        return load_default_vae().to(device)
    from ..pipelines import load_vae

    return load_vae(model, config=config, device=device)


class ShardRunner:
    """What a process (a Ray worker) holds to write shards: the VAE (loaded once), manifest, images."""

    def __init__(self, encoder: LatentEncoder, manifest: Manifest, data: ImageDataset):
        self.encoder, self.manifest, self.data = encoder, manifest, data

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ShardRunner:
        from .devices import worker_device

        vae = _load_vae(None, config.get("model"), config.get("config"), worker_device(config.get("device")))
        m = read_manifest(config["manifest"])
        data = open_dataset(config["dataset"], config.get("kind"))
        encoder = LatentEncoder(vae, EncodeSettings(**config.get("settings", {})))
        _check_factor(m, encoder)  # (each worker: the driver loads no VAE on Ray)
        return cls(encoder, m, data)

    def __call__(self, item: Any, target: str) -> None:
        spec = ShardSpec(item.name, tuple(item.spec["bucket"]), tuple(item.spec["indices"]))
        encode_shard(self.data, self.manifest.rows, spec, self.encoder, Path(target).parents[1])


def _check_factor(m: Manifest, encoder: LatentEncoder) -> None:
    """The manifest's latent factor must be the VAE's latents' (masks and latents line up; Flux.2's
    latents are its 2x2 patches: twice its VAE's factor)."""
    f, factor = m.header["planner"]["latent_factor"], encoder.factor
    if f != factor:
        how = " (its VAE's factor times its latents' 2x2 patches)" if factor != encoder.vae_factor else ""
        name = type(encoder.vae).__name__
        raise BadRequest(f"the manifest's buckets are for latent_factor={f} but the {name}'s latents are "
                         f"1/{factor} of the image{how}; bucket the dataset again with that factor")


def write_cache_manifest(m: Manifest, out_dir: str | os.PathLike, shard_size: int) -> tuple[int, dict]:
    """DIR/manifest.jsonl from the shards' own records: each row with its shard, offset and sha256."""
    by_key = {r.key: r for r in m.rows}
    rows, failed = [], {}
    for spec in plan_shards(m, shard_size):
        record = read_shard_record(Path(out_dir) / spec.name)
        if record is None:
            raise BadInputFile(f"cache shard {spec.name!r} in {os.fspath(out_dir)!r} is missing or damaged")
        failed.update(record["failed"])
        for k, (key, digest) in enumerate(zip(record["keys"], record["sha256"])):
            r = by_key[key]
            extra = {"shard": spec.name, "offset": k, "sha256": digest}
            rows.append(ManifestRow(len(rows), r.key, r.width, r.height, r.scaled, r.assignment,
                                    r.explanation, extra))
    head = {**m.header, "cache": {"shard_size": shard_size, "source_rows": len(m.rows)}}
    skipped = list(m.skipped) + sorted(failed.items())
    with atomic_path(Path(out_dir) / CACHE_MANIFEST) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for line in manifest_lines(head, rows, skipped):
            f.write(line + "\n")
    return len(rows), failed
