"""The embedded model's "text encoder": a whitespace tokenizer over a fixed vocabulary and a learned
lookup embedding (token + position, then LayerNorm), returning (B, max_length, dim) like CLIP's
last hidden state so the UNet's cross-attention sees the same shapes as in Stable Diffusion."""

from __future__ import annotations

import re

import torch
from torch import nn

PAD = "<pad>"


class WordTokenizer:
    """Lower-case whitespace/comma tokenizer over a closed vocabulary; pads to `max_length` with id 0."""

    def __init__(self, vocab: list[str] | tuple[str, ...], max_length: int):
        if not vocab or vocab[0] != PAD:
            raise ValueError(f"vocab must start with {PAD!r}, got {list(vocab)[:3]}")
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.vocab = tuple(vocab)
        self.max_length = max_length
        self.ids = {w: i for i, w in enumerate(self.vocab)}

    def words(self, text: str) -> list[str]:
        """Split a prompt into vocabulary words; raise ValueError on unknown words or too many words."""
        words = [w for w in re.split(r"[\s,]+", text.strip().lower()) if w]
        unknown = [w for w in words if w not in self.ids or w == PAD]
        if unknown:
            raise ValueError(f"unknown word(s) {unknown} in prompt {text!r}; the embedded model knows only: "
                             f"{', '.join(self.vocab[1:])}")
        if len(words) > self.max_length:
            raise ValueError(f"prompt {text!r} has {len(words)} words; the embedded model takes at most "
                             f"{self.max_length}")
        return words

    def __call__(self, text: str | list[str]) -> torch.Tensor:
        """Token ids, shape (B, max_length), int64."""
        texts = [text] if isinstance(text, str) else list(text)
        rows = []
        for t in texts:
            ids = [self.ids[w] for w in self.words(t)]
            rows.append(ids + [0] * (self.max_length - len(ids)))
        return torch.tensor(rows, dtype=torch.long)


class WordEncoder(nn.Module):
    """Learned lookup text encoder: LayerNorm(token_embedding[ids] + position_embedding)."""

    def __init__(self, vocab_size: int, max_length: int, dim: int):
        super().__init__()
        self.config = {"vocab_size": vocab_size, "max_length": max_length, "dim": dim}
        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.position_embedding = nn.Embedding(max_length, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, L <= max_length) -> embeddings (B, L, dim)."""
        if ids.ndim != 2 or ids.shape[1] > self.config["max_length"]:
            n = self.config["max_length"]
            raise ValueError(f"ids must have shape (B, L<={n}), got {tuple(ids.shape)}")
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.norm(self.token_embedding(ids) + self.position_embedding(pos)[None])
