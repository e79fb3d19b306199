"""VAE classes by name, read without importing diffusers: the image VAEs tile programs reproduce, and the
classes no tile program reproduces, each with the reason.

`vae.families` builds its table from these (a refused class is a `Family(refused=REFUSED[name])`); the
CLI reads them to refuse a model folder from its JSON, before anything loads (`pipelines.folders`). The
3-D VAEs are `video_classes.VIDEO_VAES`.
"""

from __future__ import annotations

# 2-D image VAEs (and Qwen-Image 2.1's image VAE in a video's layout), tested exact against the stock VAE
IMAGE_VAES = ("AutoencoderKL", "AutoencoderTiny", "AutoencoderKLFlux2", "AutoencoderDC", "VQModel",
              "AutoencoderKLKVAE", "AutoencoderKLHunyuanImage", "AsymmetricAutoencoderKL",
              "AutoencoderKLQwenImage21")

AUDIO = ("an audio VAE: its values are waveforms or spectrograms (1-D latents over time), not images or "
         "videos; TiledVAE tiles image and video VAEs only; use the wrapped VAE")

# why no tile program reproduces a class (video: whether it is a 3-D VAE); refused by name
REFUSED_VIDEO: dict[str, str] = {
    "AutoencoderKLMiniMaxH3": (
        "its decoder is a ViT (MiniMaxH3VideoViTDecoder3d: full self-attention over every latent voxel of a "
        "clip, with register tokens), so each output pixel reads the whole clip: no tile program reproduces "
        "it; use the wrapped VAE"),
    "LTX2VideoDiffusionDecoderModel": (
        "it is a diffusion decoder (LTX-2.5: pixels denoised over steps from noise, conditioned on the "
        "latents, by LTX2VideoDiffusionDecodePipeline), not one pass of local operators: no tile program "
        "reproduces it; decode with the wrapped model"),
}
REFUSED_IMAGE: dict[str, str] = {
    **{name: AUDIO for name in (
        "AutoencoderOobleck", "AutoencoderKLLTX2Audio", "AutoencoderKLKVAEAudio",
        "AutoencoderKLMiniMaxH3Audio", "AutoencoderSAME", "Cosmos3AVAEAudioTokenizer", "MMAudioVAE",
        "LongCatAudioDiTVae")},
    "AutoencoderRAE": (
        "its encoder is a pretrained ViT (DINOv2 / SigLIP / MAE) on an image resized to encoder_input_size "
        "and its decoder a ViT with global self-attention over every patch: no tile program reproduces them; "
        "use the wrapped VAE"),
    "ConsistencyDecoderVAE": (
        "its decoder is a diffusion model (a UNet run for num_inference_steps steps from noise), not one "
        "pass of local operators: no tile program reproduces it; decode with the wrapped VAE"),
    "RFD4ProteinaAutoencoder": (
        "a protein autoencoder (per-residue latents <-> atom coordinates): its values are token sequences, "
        "not images or videos"),
}
REFUSED = {**REFUSED_IMAGE, **REFUSED_VIDEO}

# SVD's temporal decoder: a video decode that takes its frames in the batch (decode(z, num_frames)), a 2-D
# encode; the CLI decodes its latents files as videos (`pipelines.video_latents`)
BATCHED_VAES = ("AutoencoderKLTemporalDecoder",)

# tiled exactly from Python (tw.TiledVAE) but not taken by the CLI's decode / encode yet, with what is missing
# (KVAE video, Kandinsky 6 SR and Allegro were taken since with their latents files tested through the CLI,
# tests/test_cli_video_families.py; VidTok, tests/test_cli_vidtok.py); none is left
PYTHON_ONLY: dict[str, str] = {}
