"""diffusers -> original LDM (CompVis) state-dict keys for the SD-1.x structure: the layout of an
original single-file checkpoint ("model.diffusion_model.*", "first_stage_model.*",
"cond_stage_model.transformer.*"), written from the LDM module layout, general in blocks and layers.

LDM UNet layout (openaimodel.py): input_blocks[0] = conv_in; then per down block b and layer j,
input_blocks[1 + b(L+1) + j] = [ResBlock, SpatialTransformer?], and input_blocks[(b+1)(L+1)] =
[Downsample(op)] after every block but the last; middle_block = [ResBlock, SpatialTransformer, ResBlock];
output_blocks[b(L+1) + j] = [ResBlock, SpatialTransformer?, Upsample(conv)?] with L+1 layers per up block.
LDM VAE layout (model.py): encoder.down[i].block[j] / .downsample, mid.block_1 / attn_1 / block_2,
decoder.up[k] numbered from the lowest resolution's opposite end (diffusers up_blocks[i] = up[n-1-i]);
its mid attention uses 1x1 convolutions for q, k, v, proj_out.
"""

from __future__ import annotations

import re

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_PREFIX = "cond_stage_model.transformer."

# ResBlock parameter names: diffusers ResnetBlock2D -> LDM ResBlock (Sequential indices)
UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
UNET_TOP = {
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
VAE_TOP = {"conv_in": "conv_in", "conv_out": "conv_out", "conv_norm_out": "norm_out"}
VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _split(key: str, names: dict[str, str]) -> str | None:
    """Rename the leading module path of `key` by the longest matching entry of `names`."""
    for old in sorted(names, key=len, reverse=True):
        if key.startswith(old + "."):
            return names[old] + key[len(old) :]
    return None


def _unet_key(key: str, layers: int, up_attention: set[int]) -> str:
    """One diffusers UNet2DConditionModel key -> its LDM UNetModel key."""
    top = _split(key, UNET_TOP)
    if top is not None:
        return top
    per = layers + 1
    m = re.fullmatch(
        r"(down|up)_blocks\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)", key
    )
    if m:
        side, b, kind, j, rest = m.group(1), int(m.group(2)), m.group(3), int(m.group(4)), m.group(5)
        if kind == "resnets":
            rest = _split(rest, UNET_RESNET) or rest
        if side == "down":
            if kind == "downsamplers":
                return f"input_blocks.{(b + 1) * per}.0.op.{rest.removeprefix('conv.')}"
            return f"input_blocks.{1 + b * per + j}.{0 if kind == 'resnets' else 1}.{rest}"
        if kind == "upsamplers":
            slot = 2 if b in up_attention else 1
            return f"output_blocks.{b * per + layers}.{slot}.{rest}"
        return f"output_blocks.{b * per + j}.{0 if kind == 'resnets' else 1}.{rest}"
    m = re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)", key)
    if m:
        kind, j, rest = m.group(1), int(m.group(2)), m.group(3)
        if kind == "resnets":
            return f"middle_block.{2 * j}.{_split(rest, UNET_RESNET) or rest}"
        return f"middle_block.1.{rest}"
    raise ValueError(
        f"UNet key {key!r} has no SD-1.x LDM counterpart (class and addition embeddings are not)"
    )


def unet_to_ldm(state: dict, layers_per_block: int) -> dict:
    """diffusers UNet2DConditionModel state dict -> LDM keys under 'model.diffusion_model.'."""
    if not isinstance(layers_per_block, int):
        raise ValueError(f"layers_per_block must be one int for the SD-1.x layout, got {layers_per_block!r}")
    up_attention = {int(k.split(".")[1]) for k in state if re.match(r"up_blocks\.\d+\.attentions\.", k)}
    return {UNET_PREFIX + _unet_key(k, layers_per_block, up_attention): v for k, v in state.items()}


def _vae_key(key: str, n_up: int) -> str:
    """One diffusers AutoencoderKL key -> its LDM AutoencoderKL key."""
    if key.split(".")[0] in ("quant_conv", "post_quant_conv"):
        return key
    half, _, key = key.partition(".")
    top = _split(key, VAE_TOP)
    if top is not None:
        return f"{half}.{top}"
    m = re.fullmatch(r"(down|up)_blocks\.(\d+)\.(resnets|downsamplers|upsamplers)\.(\d+)\.(.+)", key)
    if m:
        side, i, kind, j, rest = m.group(1), int(m.group(2)), m.group(3), m.group(4), m.group(5)
        level = i if side == "down" else n_up - 1 - i
        if kind == "resnets":
            rest = rest.replace("conv_shortcut.", "nin_shortcut.")
            return f"{half}.{side}.{level}.block.{j}.{rest}"
        return f"{half}.{side}.{level}.{'downsample' if side == 'down' else 'upsample'}.{rest}"
    m = re.fullmatch(r"mid_block\.resnets\.(\d+)\.(.+)", key)
    if m:
        rest = m.group(2).replace("conv_shortcut.", "nin_shortcut.")
        return f"{half}.mid.block_{int(m.group(1)) + 1}.{rest}"
    m = re.fullmatch(r"mid_block\.attentions\.0\.(.+)", key)
    if m:
        return f"{half}.mid.attn_1.{_split(m.group(1), VAE_ATTENTION)}"
    raise ValueError(f"VAE key {half}.{key!r} has no LDM counterpart")


def vae_to_ldm(state: dict, n_up_blocks: int) -> dict:
    """diffusers AutoencoderKL state dict -> LDM keys under 'first_stage_model.'; attention as 1x1 convs."""
    out = {}
    for k, v in state.items():
        new = _vae_key(k, n_up_blocks)
        if ".mid.attn_1." in new and new.endswith(".weight") and v.ndim == 2:
            v = v[:, :, None, None]  # Linear (C, C) -> Conv2d 1x1 (C, C, 1, 1)
        out[VAE_PREFIX + new] = v
    return out


def clip_to_ldm(state: dict) -> dict:
    """transformers CLIPTextModel state dict -> 'cond_stage_model.transformer.text_model.*' (SD-1.x)."""
    # transformers >= 5.6 flattened CLIPTextModel ('embeddings.*'); LDM files keep 'text_model.embeddings.*'
    return {
        CLIP_PREFIX + ("" if k.startswith("text_model.") else "text_model.") + k: v for k, v in state.items()
    }


def pipeline_to_ldm(pipe) -> dict:
    """A StableDiffusionPipeline's unet, vae and text encoder as one original-format state dict."""
    ldm = unet_to_ldm(pipe.unet.state_dict(), pipe.unet.config.layers_per_block)
    ldm.update(vae_to_ldm(pipe.vae.state_dict(), len(pipe.vae.config.up_block_types)))
    ldm.update(clip_to_ldm(pipe.text_encoder.state_dict()))
    return {k: v.detach().contiguous().clone() for k, v in ldm.items()}
