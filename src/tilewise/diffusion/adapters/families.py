"""The declared transformer families: one `Spec` per family (see `adapters.grid`), read top to bottom.

Each entry says what a tile needs of its model, taken from the model's forward and its pipelines' calls in
diffusers 0.42: the sample's layout and patch, the inputs on the latent's grid (cropped per tile), the
per-token inputs (taken at the tile's tokens) and the submodule that computes positions from the
latent's shape (hooked per tile for `positions="global"`: `adapters.positions`).
"""

from __future__ import annotations

import torch

from .joint import Joint
from .positions import MethodSource, ModuleSource, take_tokens
from .spec import Spec, Stream

ROPE = (ModuleSource("rope"),)  # a rotary table computed from the latent's shape by `model.rope`
CONTROL = "(ControlNet residuals of this family) are not tiled yet; run its ControlNet pipeline untiled"


def _wan_patch(c):
    return tuple(c.patch_size)


def _square(c):
    p = c.patch_size
    return (p, p) if isinstance(p, int) else tuple(p)


def _lumina2(full, local, idx):
    """Lumina 2's `rope_embedder` output for a tile: its own patch tokens and caption table; the untiled
    image table at the tile's tokens, and the joint table (caption, then image, per row) rebuilt from them."""
    img = full[2].index_select(1, idx.to(full[2].device))
    joint = local[3].clone()
    for i, n_cap in enumerate(local[4]):
        joint[i, n_cap : n_cap + len(idx)] = img[i]
    return local[0], local[1], img, joint, local[4], local[5]


def _vace_references(c, inputs):
    """WanVACEPipeline's reference images: latent frames before the video's, their control inputs beyond
    the latent's channels (reactive latents, mask) exactly zero, which no encoded video frame is."""
    control = (inputs or {}).get("control_hidden_states")
    if control is None:
        return None
    rest = control[:, c.in_channels :].flatten(3).abs().amax(dim=(0, 1, 3))  # per latent frame
    n = int((rest == 0).long().cumprod(0).sum())
    if n:
        return (f"has {n} reference frame(s) first in the latent (control_hidden_states: reactive latents "
                "and mask zero, reference_images=), which every frame window would need; a window without "
                "them loses them")
    return None


def _token_replace(c, inputs):
    if getattr(c, "image_condition_type", None) == "token_replace":
        return ("(image_condition_type='token_replace', HunyuanVideo I2V) modulates the first latent frame's "
                "tokens as the image's; every frame window would take its own first frame for it")
    return None


def _ltx2_coords(model, given):
    """LTX-2's video_coords for the whole latent, as its forward makes them when the call passes none."""
    sizes = [given.get(k) for k in ("num_frames", "height", "width")]
    x = given.get("hidden_states")
    if given.get("video_coords") is not None or x is None or any(not isinstance(s, int) for s in sizes):
        return {}
    return {"video_coords": model.rope.prepare_video_coords(x.shape[0], *sizes, x.device,
                                                            fps=given.get("fps", 24.0))}


def _per_token(v, idx, n):
    """A value per video token along axis 1 (per-token sigma) at the tile's tokens; a per-row one whole."""
    if isinstance(v, torch.Tensor) and v.ndim >= 2 and v.shape[1] == n:
        return v.index_select(1, idx.to(v.device))
    return v


def _allegro_rope(v, idx, n):
    """Allegro's image_rotary_emb, ((t, h, w) frequency tables, (t, h, w) indices per token, (1, N)): the
    tables whole, the indices at the tile's tokens."""
    freqs, grids = v
    return freqs, tuple(take_tokens(g, idx, 1, n, "image_rotary_emb") for g in grids)


def _animate_reference(c, inputs):
    return ("takes the reference image as its first latent frame (and the pose video one frame behind the "
            "latent's); every frame window would need it")


ADDITIVE = (ModuleSource("pos_embed", kind="additive"),)  # a patch embedding that adds a position table


SPECS: tuple[Spec, ...] = (
    # Wan 2.1 / 2.2 (T2V, I2V: condition channels in the sample, image embeddings per row; TI2V: one
    # timestep per token), SkyReels-V2, ChronoEdit: (B, C, T, H, W), 3-D rotary table from `rope`
    Spec("wan", ("WanTransformer3DModel", "SkyReelsV2Transformer3DModel", "ChronoEditTransformer3DModel"),
         _wan_patch, tokens={"timestep": 1}, batched_tokens=("timestep",), sources=ROPE),
    # Wan VACE: the control video's latents (and masks) on the latent's grid
    Spec("wan-vace", ("WanVACETransformer3DModel",), _wan_patch, spatial=("control_hidden_states",),
         sources=ROPE, refuse_frames=_vace_references),
    # Wan 2.2 Animate: the reference image's latent frame first (T + 1 frames), the pose video's latents
    # (T frames, on the latent's grid) cropped per tile, the face video (pixels, motion-encoded) per row
    Spec("wan-animate", ("WanAnimateTransformer3DModel",), _wan_patch, spatial=("pose_hidden_states",),
         sources=ROPE, refuse_frames=_animate_reference),
    # HunyuanVideo (1.0) and 1.5, Sana-Video: (B, C, T, H, W), a 3-D rotary table from `rope`
    Spec("hunyuan-video", ("HunyuanVideoTransformer3DModel", "HunyuanVideo15Transformer3DModel"),
         lambda c: (c.patch_size_t, c.patch_size, c.patch_size), sources=ROPE, refuse_frames=_token_replace),
    Spec("sana-video", ("SanaVideoTransformer3DModel",), _wan_patch, sources=ROPE),
    # Mochi: a rotary table `rope(pos_frequencies, frames, rows, columns)`, centred and scaled by the size
    # Cosmos (1.0, Predict 2 / 2.5): the conditioning frames' mask on the latent's grid, the padding mask at
    # pixel size, one timestep per latent frame; rotary table and learned position embedding by shape
    Spec("cosmos", ("CosmosTransformer3DModel",), _wan_patch, spatial=("condition_mask", "padding_mask"),
         frames={"timestep": 2},
         sources=(ModuleSource("rope"), ModuleSource("learnable_pos_embed", optional=True)),
         refused={"block_controlnet_hidden_states": CONTROL}, one_call_per_tile=True),
    # EasyAnimate: a rotary table from `rope_embedding`; inpaint and control latents on the latent's grid
    Spec("easyanimate", ("EasyAnimateTransformer3DModel",), lambda c: (1, *_square(c)),
         spatial=("inpaint_latents", "control_latents"), sources=(ModuleSource("rope_embedding"),)),
    # CogVideoX 1.0 / 1.5 (their I2V: the image latents are channels of the sample) and ConsisID (an
    # identity-preserving CogVideoX): (B, T, C, H, W); the pipeline's rotary table (`image_rotary_emb`, 5B
    # and 1.5) or the patch embedding's sinusoidal one (2B), added to the text-then-image tokens
    Spec("cogvideox", ("CogVideoXTransformer3DModel", "ConsisIDTransformer3DModel"),
         lambda c: (getattr(c, "patch_size_t", None) or 1, *_square(c)),
         layout="btchw", tokens={"image_rotary_emb": 0},
         sources=(ModuleSource("patch_embed", kind="additive", arg="image_embeds", others="before"),),
         refuse_config=lambda c: "its learned position embedding exists for one size only "
                                 "(use_learned_positional_embeddings: CogVideoX-5b-I2V); no tile has that "
                                 "size" if c.use_learned_positional_embeddings else None),
    # Allegro: the pipeline's rotary positions, per-axis tables indexed by (t, h, w) per token
    Spec("allegro", ("AllegroTransformer3DModel",), lambda c: (c.patch_size_t, c.patch_size, c.patch_size),
         tokens={"image_rotary_emb": _allegro_rope}),
    # LTX-Video: the packed tokens with their grid sizes; the rotary table from those sizes (or the tile's
    # rows of `video_coords`, when the pipeline passes them); per-token timesteps (image / condition frames)
    Spec("ltx-video", ("LTXVideoTransformer3DModel",), lambda c: (c.patch_size_t, c.patch_size, c.patch_size),
         layout="tokens", sizes=("num_frames", "height", "width"), tokens={"video_coords": 2, "timestep": 1},
         batched_tokens=("video_coords", "timestep"),
         sources=(ModuleSource("rope", sizes=("num_frames", "height", "width"), unless="video_coords"),)),
    # LTX-2: LTX-Video's packed video tokens and video_coords rows (made for the whole latent by its rope
    # when the call passes none), per-token timesteps and sigma (I2V); the audio latent, prompt and coords
    # per row for every tile, its prediction the tiles' mean (`audio=`; `Stream`)
    Spec("ltx2", ("LTX2VideoTransformer3DModel",), lambda c: (c.patch_size_t, c.patch_size, c.patch_size),
         layout="tokens", sizes=("num_frames", "height", "width"),
         tokens={"video_coords": 2, "timestep": 1, "sigma": _per_token, "video_keyframes_mask": 1},
         batched_tokens=("video_coords", "timestep", "sigma", "video_keyframes_mask"), fill=_ltx2_coords,
         stream=Stream(1, "audio_sample", exact_when="isolate_modalities"),
         refused={"video_self_attention_mask": "(IC-LoRA: a mask over every pair of video tokens) is not "
                                               "tiled yet; run the IC-LoRA pipeline untiled"}),
    # Kandinsky 5 (video and image) and 6: channels-last (B, T, H, W, C); positions the pipeline passes
    # per axis (`visual_rope_pos`, Kandinsky 6: made for the whole latent when not passed)
    Spec("kandinsky5", ("Kandinsky5Transformer3DModel",), _wan_patch, layout="bthwc",
         axis_positions="visual_rope_pos",
         refused={"sparse_params": "(NABLA sparse attention) builds its mask for the whole latent's grid; "
                                   "use attention_type='regular' or run the pipeline untiled"}),
    Spec("kandinsky6", ("Kandinsky6Transformer3DModel",), _wan_patch, layout="bthwc",
         axis_positions="visual_rope_pos", frames={"visual_token_type_ids": 1},
         refused={"audio_hidden_states": "(the audio stream attends every video token) is not tiled; "
                                         "sample without audio (sample_audio=False) or run untiled"}),
    # images: PixArt-alpha / Sigma, DiT, AuraFlow, Sana: a patch embedding
    # adding a sinusoidal (interpolated to the size), cropped or learned table
    Spec("pixart", ("PixArtTransformer2DModel", "DiTTransformer2DModel"), _square, layout="bchw",
         sources=ADDITIVE),
    Spec("auraflow", ("AuraFlowTransformer2DModel",), _square, layout="bchw", sources=ADDITIVE),
    Spec("sana", ("SanaTransformer2DModel",), _square, layout="bchw",
         sources=(ModuleSource("patch_embed", kind="additive"),),
         refused={"controlnet_block_samples": CONTROL}),
    # CogView3-Plus: text then image tokens from one patch embedding, a sinusoidal table on the image's
    Spec("cogview3plus", ("CogView3PlusTransformer2DModel",), _square, layout="bchw",
         sources=(ModuleSource("patch_embed", kind="additive", others="before"),)),
    # CogView4, HunyuanImage 2.1: a rotary table from `rope` (CogView4 scales it to the image's size)
    Spec("cogview4", ("CogView4Transformer2DModel",), _square, layout="bchw", tokens={"image_rotary_emb": 0},
         sources=ROPE),
    Spec("hunyuan-image", ("HunyuanImageTransformer2DModel",), _square, layout="bchw", sources=ROPE,
         refuse_config=lambda c: "its 3-D (refiner) form is not tiled yet" if len(c.patch_size) == 3
                                 else None),
    # Lumina 2: caption positions, then the image's (row, column) from the caption's length
    Spec("lumina2", ("Lumina2Transformer2DModel",), _square, layout="bchw",
         sources=(ModuleSource("rope_embedder", take=_lumina2, others="before"),)),
    # HunyuanDiT: the pipeline's 2-D rotary table (cos, sin) per image token; size and crop conditioning
    # (image_meta_size) and style per row, as the pipeline gives them
    Spec("hunyuan-dit", ("HunyuanDiT2DModel",), _square, layout="bchw", tokens={"image_rotary_emb": 0},
         refused={"controlnet_block_samples": CONTROL}),
    # HiDream-I1 / E1: positions (img_ids), token mask and grid sizes made by its `patchify` method (tokens
    # padded to max_seq for a non-square latent); its Llama embeddings are (layers, batch, tokens, D)
    Spec("hidream", ("HiDreamImageTransformer2DModel",), _square, layout="bchw", timestep="timesteps",
         prompt="encoder_hidden_states_t5", pooled="pooled_embeds",
         rows_at={"encoder_hidden_states_llama3": 1},
         method=MethodSource("patchify", ("hidden_states", "hidden_states_masks", "img_sizes", "img_ids"),
                             positions="img_ids", mask="hidden_states_masks")),
    # Qwen-Image 2.1: one block-causal sequence of the vision-language tokens (text, condition images' slots
    # filled with their latents), then the target's tokens, last (`adapters.joint`); one slot of img_mask per
    # 2 x 2 target tokens (tile sides even); its rotary table over the whole sequence from `pos_embed`; its
    # prefix KV cache (kv_cache) holds only what every tile shares, as does each call on all rows
    Spec("qwen-image-2.1", ("QwenImage21Transformer2DModel",), _square, layout="tokens", align=2,
         joint=Joint("img_shapes", slots={"img_mask": 4}), one_call_per_tile=True,
         sources=(ModuleSource("pos_embed", arg=None, grids="img_shapes", mask="image_pad_mask",
                               others="before"),)),
    Spec("mochi", ("MochiTransformer3DModel",), lambda c: (1, c.patch_size, c.patch_size),
         sources=(ModuleSource("rope", arg=None, sizes=("num_frames", "height", "width")),)),
)


def _one(c):
    return (1,)


VIDEO_RESIDUALS = ("(ControlNet residuals of a video UNet: SparseCtrl) are not tiled yet; run the pipeline "
                   "untiled")

# UNets (`adapters.unet`): no positional inputs; the table says the sample's layout and the inputs on the
# latent's grid. Everything else (prompt, added conditioning, Kandinsky 2.2's image embeddings with no
# prompt) passes per row.
UNETS: tuple[Spec, ...] = (
    Spec("unet", ("UNet2DConditionModel", "UNet2DModel"), _one,
         layout="bchw", sample="sample"),
    # AnimateDiff's UNetMotionModel, ModelScope / ZeroScope's UNet3DConditionModel: (B, C, T, H, W)
    Spec("unet-video", ("UNet3DConditionModel", "UNetMotionModel"), _one, layout="bcthw", sample="sample",
         refused=dict.fromkeys(("down_block_additional_residuals", "mid_block_additional_residual"),
                               VIDEO_RESIDUALS)),
    # Stable Video Diffusion: (B, T, C, H, W); the image latents are channels of the sample, added_time_ids
    # (fps, motion bucket, noise augmentation) and the image embeddings per row
    Spec("svd", ("UNetSpatioTemporalConditionModel",), _one, layout="btchw", sample="sample"),
    # I2VGen-XL: the first frame's latents on the latent's grid, image embeddings and fps per row
    Spec("i2vgen-xl", ("I2VGenXLUNet",), _one, layout="bcthw", sample="sample", spatial=("image_latents",)),
    # Stable Cascade (prior and decoder): effnet and pixels, which the model resizes to its grid
    Spec("stable-cascade", ("StableCascadeUNet",), lambda c: (c.patch_size,), layout="bchw", sample="sample",
         timestep="timestep_ratio", spatial=("effnet", "pixels"), resampled=("effnet", "pixels")),
    # ControlNet-XS: the control image (pixels, the VAE's factor times the latent's size)
    Spec("controlnet-xs", ("UNetControlNetXSModel",), _one, layout="bchw", sample="sample",
         spatial=("controlnet_cond",)),
)


# Classes refused by name, with the reason (anything else no entry calls is refused naming the supported).
REFUSED: dict[str, str] = {
    "UVit2DModel": "aMUSEd's UVit2D predicts logits over discrete VQ tokens (input_ids), not a latent; "
                   "TiledDenoiser fuses continuous predictions",
    "Transformer2DModel": "its patched form unpatchifies square token grids only (a tile is rarely square); "
                          "use PixArtTransformer2DModel / DiTTransformer2DModel",
    "HunyuanVideoFramepackTransformer3DModel": "its history latents (clean, 2x, 4x) are packed with their "
                                               "own rotary positions beside the latent's tokens; not tiled "
                                               "yet",
    "WanAnimate2Transformer3DModel": "its call takes lists of per-sample latents with a KV cache of "
                                     "reference segments (offset_grid_sizes, origin_area); not tiled yet "
                                     "(Wan 2.2 Animate, WanAnimateTransformer3DModel, is)",
    "MotionAdapter": "it holds AnimateDiff's motion modules; wrap the UNetMotionModel the pipeline builds "
                     "(pipe.unet)",
}
