"""Video VAE families as table entries (`tilewise.vae.families`): the ones traced from what they compute
decode and encode exactly (`test_vae_video.py`, `test_video_groupnorm.py`, `test_video_mochi.py`,
`test_svd_vae.py`, `test_cosmos_vae.py`, `test_hunyuan15_vae.py`, `test_magvit_vae.py`); the others are
refused when the TiledVAE is built, by name, with the call and module path that cannot be tiled and why,
or by their table entry's reason (audio VAEs, ViT decoders, layers not traced yet): never accepted
and failing later."""

import pytest

torch = pytest.importorskip("torch")

from video_vae_support import refused_family  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality import LoweringError  # noqa: E402

REFUSED = {
    "cogvideox-odd-calls": r"TiledVAE cannot tile AutoencoderKLCogVideoX \(decode of a first call of 3 "
                           r"frames\): the program traced on its first call of 3 frames computes, in the "
                           r"calls of 3 frames after it, other ops or frames than their own trace does",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_video_families_that_cannot_be_tiled_exactly_are_refused_at_construction(name):
    with pytest.raises(LoweringError, match=REFUSED[name]):
        tw.TiledVAE(refused_family(name), progress=False)


# classes refused by name from the families' table (the reason is theirs, not a failed trace): built with
# their default configs on the meta device (nothing is computed; the refusal comes before any lowering)
BY_NAME = {
    "AutoencoderOobleck": "an audio VAE", "AutoencoderKLLTX2Audio": "an audio VAE",
    "AutoencoderKLKVAEAudio": "an audio VAE", "AutoencoderKLMiniMaxH3Audio": "an audio VAE",
    "AutoencoderSAME": "an audio VAE", "Cosmos3AVAEAudioTokenizer": "an audio VAE",
    "MMAudioVAE": "an audio VAE", "LongCatAudioDiTVae": "an audio VAE",
    "AutoencoderKLMiniMaxH3": "its decoder is a ViT",
    "AutoencoderRAE": "its encoder is a pretrained ViT",
    "LTX2VideoDiffusionDecoderModel": "it is a diffusion decoder",
}


@pytest.mark.parametrize("cls", sorted(BY_NAME))
def test_families_refused_by_name_are_refused_at_construction_with_the_reason(cls):
    import diffusers

    try:
        with torch.device("meta"):
            vae = getattr(diffusers, cls)()
    except RuntimeError:  # (MMAudioVAE builds CPU tables in __init__; the refusal is by class, so a stand-in)
        vae = type(cls, (torch.nn.Module,), {})()
    with pytest.raises(LoweringError, match=f"TiledVAE cannot tile {cls}: {BY_NAME[cls]}"):
        tw.TiledVAE(vae, progress=False)


def test_a_protein_autoencoder_is_refused_by_name():
    # (RFD4ProteinaAutoencoder is built only from its residue tables; a module of its class name stands in)
    vae = type("RFD4ProteinaAutoencoder", (torch.nn.Module,), {})()
    with pytest.raises(LoweringError, match="cannot tile RFD4ProteinaAutoencoder: a protein autoencoder"):
        tw.TiledVAE(vae, progress=False)
