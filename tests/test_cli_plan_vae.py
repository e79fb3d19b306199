"""`tilewise plan --model FOLDER` of a VAE folder: a video VAE's plan of `--frames` frames (decode: latent
frames; encode: video frames) as TiledVAE.plan gives it, an image VAE folder's as before; --frames with an
image VAE and --ranks with a video VAE refused naming the value, before anything is planned."""

import faults_support
import pytest

torch = pytest.importorskip("torch")

from typer.testing import CliRunner  # noqa: E402
from video_vae_support import video_vae  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.cli import app  # noqa: E402
from tilewise.errors import BadRequest  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from vae_support import kl_vae

    root = tmp_path_factory.mktemp("plan")
    video_vae("wan2.1").save_pretrained(root / "wan")
    kl_vae("sd").save_pretrained(root / "sd")
    return root


def _plan(*args) -> str:
    result = CliRunner().invoke(app, ["plan", *map(str, args)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("kind,shape", [("decode", (1, 4, 3, 8, 12)), ("encode", (1, 3, 9, 64, 96))])
def test_a_video_vae_folder_plans_its_frames(folders, kind, shape):
    out = _plan("--model", folders / "wan", "--kind", kind, "--width", 96, "--height", 64, "--frames",
                shape[2], "--tile", 4, "--device", "cpu")
    want = tw.TiledVAE(video_vae("wan2.1"), tile_size=4, device_kind="cpu").plan(shape, kind=kind)
    assert str(want) in out and want.grid == (2, 3)


def test_an_image_vae_folder_plans_as_a_pipeline_s_vae(folders):
    from vae_support import kl_vae

    out = _plan("--model", folders / "sd", "--width", 128, "--height", 96, "--tile", 4, "--device", "cpu")
    want = tw.TiledVAE(kl_vae("sd"), tile_size=4, device_kind="cpu").plan((1, 4, 12, 16))
    assert str(want) in out


def test_frames_of_an_image_vae_and_ranks_of_a_video_vae_are_refused(folders, capsys):
    for args, words in ((["--model", folders / "sd", "--frames", 3], ["--frames 3", "image VAE"]),
                        (["--model", folders / "wan", "--ranks", 2], ["--ranks 2", "--nproc 2"])):
        code, errors, err = faults_support.run(["plan", "--width", "64", "--height", "64", *map(str, args)],
                                               capsys)
        assert code == BadRequest.exit_code and len(errors) == 1, err
        assert all(w in errors[0] for w in words), errors[0]
