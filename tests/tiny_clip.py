"""A tiny real CLIP tokenizer + text encoder (no download), shared by the CLI and single-file tests."""

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
