"""The 3-D VAE classes tilewise tiles, by name, read without importing diffusers (the CLI reads them before
any model loads; `vae.families` holds how each is tiled)."""

from __future__ import annotations

VIDEO_VAES = ("AutoencoderKLWan", "AutoencoderKLQwenImage", "AutoencoderKLLTXVideo", "AutoencoderKLLTX2Video",
              "AutoencoderKLHunyuanImageRefiner", "AutoencoderKLHunyuanVideo", "AutoencoderKLMochi",
              "AutoencoderKLCosmos", "AutoencoderKLHunyuanVideo15", "AutoencoderKLMagvit",
              "AutoencoderKLCogVideoX", "AutoencoderKLKVAEVideo", "Kandinsky6SRVAE",
              "AutoencoderKLAllegro", "AutoencoderVidTok")


def is_video_vae(vae) -> bool:
    """Whether `vae` is a 3-D VAE tilewise tiles (`VIDEO_VAES`: Wan, Qwen-Image, LTX-Video, LTX-2, the
    HunyuanImage refiner, HunyuanVideo 1.0 / 1.5, Mochi, Cosmos, Magvit, CogVideoX, KVAE video,
    Kandinsky 6 SR, Allegro, VidTok)."""
    return type(vae).__name__ in VIDEO_VAES
