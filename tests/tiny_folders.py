"""Tiny transformer pipelines saved as diffusers folders, with real text encoders and tokenizers (offline).

What `tilewise generate --model FOLDER` reads: SD3 with two CLIPTextModelWithProjection encoders and no T5
(the pipeline's own default: zero T5 embeddings), Flux with a CLIPTextModel and a T5EncoderModel, Wan 2.1
(text to video) with a UMT5EncoderModel. The tokenizers are real classes over a letter vocabulary
(`tiny_sd.char_tokenizer`, a T5 Unigram over letters). VAEs of two levels (2 px per latent pixel; Wan's:
its 3-D VAE, 8 px and 4 frames per latent pixel and frame), seeded random weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_sd import char_tokenizer

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _clip_config(dim: int, **extra):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=54, hidden_size=dim, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, max_position_embeddings=77, bos_token_id=52, eos_token_id=53,
                          pad_token_id=53, **extra)


def _vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                         layers_per_block=1, shift_factor=0.06, scaling_factor=1.5)


def sd3_folder(root: Path) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4,
                                        num_layers=1, attention_head_dim=8, num_attention_heads=2,
                                        caption_projection_dim=16, joint_attention_dim=32,
                                        pooled_projection_dim=16, pos_embed_max_size=64)
    (root / "tok").mkdir(parents=True, exist_ok=True)
    tok = char_tokenizer(root / "tok")
    clips = [CLIPTextModelWithProjection(_clip_config(16, projection_dim=8)) for _ in range(2)]
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(),
                                    vae=_vae(), text_encoder=clips[0], tokenizer=tok, text_encoder_2=clips[1],
                                    tokenizer_2=tok, text_encoder_3=None, tokenizer_3=None)
    pipe.save_pretrained(root / "sd3")
    return root / "sd3"


def _t5_vocab():
    return [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)] + [(c, -1.0) for c in LETTERS]


def wan_folder(root: Path) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    from tiny_denoisers import wan_transformer
    from transformers import T5TokenizerFast, UMT5Config, UMT5EncoderModel
    from video_vae_support import wan

    torch.manual_seed(0)
    vocab = _t5_vocab()
    text = UMT5EncoderModel(UMT5Config(vocab_size=len(vocab), d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                       num_heads=2))
    pipe = WanPipeline(tokenizer=T5TokenizerFast(vocab=vocab, extra_ids=0), text_encoder=text,
                       transformer=wan_transformer(), vae=wan(), scheduler=FlowMatchEulerDiscreteScheduler())
    pipe.save_pretrained(root / "wan")
    return root / "wan"


def flux_folder(root: Path) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel, T5TokenizerFast

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, out_channels=16, num_layers=1,
                                         num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                                         joint_attention_dim=16, pooled_projection_dim=16,
                                         axes_dims_rope=(4, 6, 6))
    (root / "tok").mkdir(parents=True, exist_ok=True)
    vocab = _t5_vocab()
    t5 = T5EncoderModel(T5Config(vocab_size=len(vocab), d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                 num_heads=2))
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=_vae(),
                        text_encoder=CLIPTextModel(_clip_config(16)), tokenizer=char_tokenizer(root / "tok"),
                        text_encoder_2=t5, tokenizer_2=T5TokenizerFast(vocab=vocab, extra_ids=0),
                        transformer=transformer)
    pipe.save_pretrained(root / "flux")
    return root / "flux"
