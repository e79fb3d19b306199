"""The parts of a tiny SD-1.x pipeline (no download): a real CLIP tokenizer and text encoder, and the
UNet / VAE configurations, shared by the CLI and single-file tests."""

import json


def char_tokenizer(folder):
    """A real CLIPTokenizer over a character vocabulary (no download): enough for prompts of letters."""
    from transformers import CLIPTokenizer

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {c: i for i, c in enumerate(letters)}
    vocab.update({c + "</w>": len(letters) + i for i, c in enumerate(letters)})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=77)


def text_encoder(dim: int):
    """A 2-layer CLIPTextModel of width `dim` over that vocabulary (54 tokens), random weights."""
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(
        CLIPTextConfig(vocab_size=54, hidden_size=dim, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=77, bos_token_id=52, eos_token_id=53,
                       pad_token_id=53))


def unet_config(dim: int) -> dict:
    """UNet2DConditionModel keyword arguments: two levels (32, 64), cross-attention width `dim`."""
    return dict(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=dim,
        norm_num_groups=32,
    )


def vae_config() -> dict:
    """AutoencoderKL keyword arguments: four levels (8, 8, 16, 16), 4 latent channels."""
    return dict(
        block_out_channels=(8, 8, 16, 16),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
    )
