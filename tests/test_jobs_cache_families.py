"""The latent cache with the 2-D image VAE families beyond AutoencoderKL (issue #28): a tiny seeded DC-AE,
VQModel, Flux.2 and Qwen-Image 2.1 VAE folder through `encode_dataset` equals the stock encode of each
bucket's transformed images, in the layout the family's stock pipeline hands its denoiser (float32, max
abs <= 1e-4), the tiled encode past `tile_above` included; the manifest's latent factor checked against
the family's (Flux.2: twice its VAE's, its latents' 2x2 patches); a video VAE refused by name."""

import pytest

torch = pytest.importorskip("torch")

from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline  # noqa: E402
from jobs_support import make_images, write_folder  # noqa: E402
from vae_support import family_vae  # noqa: E402
from video_vae_support import qwen21, wan  # noqa: E402

from tilewise.cli import main  # noqa: E402
from tilewise.errors import BadRequest  # noqa: E402
from tilewise.jobs import EncodeSettings, LatentDataset, bucket_dataset, encode_dataset  # noqa: E402
from tilewise.jobs.cache import ShardRunner, to_tensor  # noqa: E402
from tilewise.jobs.readers import open_dataset  # noqa: E402

TOL = 1e-4
AREA, STEP = 32 * 32, 16
# buckets of more than 900 px (the 32x32 one) go through the exact tiled VAE, the others untiled
SETTINGS = EncodeSettings(batch_size=3, tile_above=900, tile_size=8)
FACTORS = {"dc": 2, "vq": 2, "flux2": 4, "qwen21": 4}  # latents-file pixels per image pixel


def _vae(name: str):
    """The family's tiny VAE with non-trivial latent normalisation (a scaling factor, Flux.2's batch-norm
    running statistics, Qwen-Image 2.1's mean and std as built)."""
    vae = qwen21() if name == "qwen21" else family_vae(name)
    if name == "flux2":
        g = torch.Generator().manual_seed(3)
        vae.bn.running_mean.copy_(torch.randn(vae.bn.running_mean.shape, generator=g))
        vae.bn.running_var.copy_(torch.rand(vae.bn.running_var.shape, generator=g) + 0.5)
    elif name in ("dc", "vq"):
        vae.register_to_config(scaling_factor=0.75)
    return vae


def _stock(name: str, vae, x):
    """The oracle: the untiled stock encode of a bucket's images, as the family's pipeline normalises it."""
    with torch.no_grad():
        if name == "qwen21":  # QwenImage21Pipeline._encode_vae_image: RGBA (opaque), (N, C, 1, h, w)
            x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1).unsqueeze(2)
            mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
            std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
            return (vae.encode(x).latent_dist.mode() - mean) / std
        if name == "flux2":  # Flux2Pipeline._encode_vae_image
            mean = vae.bn.running_mean.view(1, -1, 1, 1)
            std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
            return (Flux2Pipeline._patchify_latents(vae.encode(x).latent_dist.mode()) - mean) / std
        out = vae.encode(x)  # SanaPipeline's DC-AE `latent`, LDM's VQModel `latents`, scaled
        return (out.latent if name == "dc" else out.latents) * vae.config.scaling_factor


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("photos"), make_images(5, seed=9, low=20, high=56),
                        corrupt=False)


def _manifest(root, factor: int, tmp_path):
    out = tmp_path / f"manifest{factor}.jsonl"
    bucket_dataset(root, out, area=AREA, step=STEP, latent_factor=factor, progress=False)
    return out


@pytest.mark.parametrize("name", sorted(FACTORS))
def test_a_family_folder_through_the_cache_equals_its_stock_encode(photos, tmp_path, name):
    vae = _vae(name)
    vae.save_pretrained(tmp_path / "vae")
    manifest = _manifest(photos, FACTORS[name], tmp_path)
    result = encode_dataset(manifest, tmp_path / "cache", model=tmp_path / "vae", shard_size=2,
                            settings=SETTINGS, progress=False)
    ds, data = LatentDataset(tmp_path / "cache"), open_dataset(photos)
    assert result.rows == len(ds) == 5 and not result.failed
    by_bucket: dict = {}
    for i, row in enumerate(ds.manifest.rows):
        by_bucket.setdefault(row.bucket, []).append(i)
    worst = 0.0
    for (w, h), idx in by_bucket.items():
        x = torch.stack([to_tensor(ds.manifest.rows[i].transform(data.pixels(ds.manifest.rows[i].key)))
                         for i in idx])
        for i, z in zip(idx, _stock(name, vae, x)):
            item = ds[i]
            f = FACTORS[name]
            assert item["latents"].shape == z.shape and z.shape[-2:] == (h // f, w // f)
            assert item["mask"].shape == z.shape[-2:]
            worst = max(worst, float((item["latents"] - z).abs().max()))
    print(f"{name}: max abs error {worst:.2e} over {len(ds)} latents, {len(by_bucket)} buckets")
    assert worst <= TOL, worst
    tiled = [b for b in by_bucket if b[0] * b[1] > SETTINGS.tile_above]
    assert tiled and len(tiled) < len(by_bucket)  # both paths were taken


def _cli(*args) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    assert exit_info.value.code == 0


def test_the_cli_buckets_at_the_vaes_factor_and_encodes_a_vq_folder_into_the_cache(photos, tmp_path):
    vae = _vae("vq")
    vae.save_pretrained(tmp_path / "vq")
    manifest = tmp_path / "manifest.jsonl"
    _cli("buckets", photos, "--out", manifest, "--area", AREA, "--step", STEP, "--latent-factor", 2,
         "--quiet")
    _cli("encode", photos, "--buckets", manifest, "--out", tmp_path / "cache", "--model", tmp_path / "vq",
         "--tile-above", 900, "--tile", 8, "--quiet")
    ds, data = LatentDataset(tmp_path / "cache"), open_dataset(photos)
    row = ds.manifest.rows[0]
    want = _stock("vq", vae, to_tensor(row.transform(data.pixels(row.key)))[None])[0]
    assert float((ds[0]["latents"] - want).abs().max()) <= TOL


def test_a_manifest_of_another_latent_factor_is_refused_naming_the_familys(photos, tmp_path):
    manifest = _manifest(photos, 2, tmp_path)  # (Flux.2's VAE downsamples by 2 here, its latents by 4)
    why = r"latent_factor=2 but the AutoencoderKLFlux2's latents are 1/4 of the image \(its VAE's factor " \
          r"times its latents' 2x2 patches\)"
    with pytest.raises(BadRequest, match=why):
        encode_dataset(manifest, tmp_path / "cache", vae=_vae("flux2"), settings=SETTINGS, progress=False)
    _vae("flux2").save_pretrained(tmp_path / "flux2")
    with pytest.raises(BadRequest, match=why):  # a Ray worker's runner checks it too
        ShardRunner.from_config({"manifest": str(manifest), "dataset": str(photos),
                                 "model": str(tmp_path / "flux2"), "device": "cpu"})


def test_a_video_vae_is_refused_by_name(photos, tmp_path, capsys):
    manifest = _manifest(photos, 8, tmp_path)
    with pytest.raises(BadRequest, match=r"the VAE is a AutoencoderKLWan, a video VAE"):
        encode_dataset(manifest, tmp_path / "cache", vae=wan(), settings=SETTINGS, progress=False)
    wan().save_pretrained(tmp_path / "wan")
    with pytest.raises(SystemExit) as exit_info:  # the CLI refuses it from its JSON, before it loads
        main(["encode", str(photos), "--buckets", str(manifest), "--out", str(tmp_path / "c2"), "--model",
              str(tmp_path / "wan")])
    err = capsys.readouterr().err
    assert exit_info.value.code == BadRequest.exit_code
    assert "holds a AutoencoderKLWan, a video VAE" in err and "tilewise encode VIDEO" in err
    assert not (tmp_path / "c2").exists() or not any((tmp_path / "c2").iterdir())
