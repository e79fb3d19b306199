"""The calls of Wan's and Qwen-Image's causal loops (`families.Family.loop`): `AutoencoderKLWan._decode`
runs post_quant_conv, then its decoder on one latent frame a call (the first with first_chunk=True), then
unpatchify and the clamp to [-1, 1]; `_encode` patchify, its encoder on the first frame, then on 4 frames a
call (the frames of an incomplete last call dropped), then quant_conv. Every call reads the caches the
calls before it left (`feat_cache`, one slot a causal convolution, "Rep" where the first call skipped a
temporal upsampler); the per-frame layers around the loop (post_quant_conv and quant_conv are 1x1x1, the
(un)patchify and the clamp per pixel) are computed in each call as they are around the loop.

`wan_loop` gives the steps and the first and a later call, each with the caches the calls before it left
(made by capturing those calls on meta examples: nothing is computed), which `locality.trace.calls`
lowers into one program."""

from __future__ import annotations

import inspect

import torch

from ..locality.trace.capture import capture
from ..locality.trace.state import is_attention
from .settings import Kind

ENCODE_CHUNK = 4  # (the frames of each call of `_encode` after the first: a literal there)


def wan_loop(vae, kind: Kind, example) -> tuple[tuple[int, int, bool], list, tuple]:
    """((first, every, drop), [(the first call, its example), (a later call, its example)], (before,
    after)) of a Wan / Qwen-Image decode or encode loop: each call a function of its input, with the
    caches the calls before it left, and a meta input of its frames (`example(frames)`: the decode's or
    encode's input; the patchified one the calls take); before / after: what runs on every frame around
    the loop, (function, the channels it takes), or None (encode's patchify; decode's unpatchify, clamp)."""
    steps = (1, 1, False) if kind is Kind.DECODE else (1, ENCODE_CHUNK, True)
    count = sum(type(m).__name__.endswith("CausalConv3d") for m in _coder(vae, kind).modules())
    p = vae.config.get("patch_size")

    def given(frames):  # (what a call takes: the input, patchified before the loop)
        x = example(frames)
        return _patch(x, p, inverse=False) if p and kind is Kind.ENCODE else x

    calls = []
    for k in range(2):
        cache = [None] * count
        for j in range(k):  # (the calls before it, captured on meta examples: their caches meta tensors)
            run = lambda x, j=j, c=cache: _call(vae, kind, x, c, j)  # noqa: E731
            capture(vae, run, (given(steps[j > 0]),), is_attention)
        calls.append((lambda x, k=k, cache=cache: _call(vae, kind, x, list(cache), k), given(steps[k > 0])))
    if kind is Kind.DECODE:
        after = (lambda x: torch.clamp(_patch(x, p, inverse=True) if p else x, min=-1.0, max=1.0),
                 int(vae.decoder.conv_out.out_channels))
        return steps, calls, (None, after)
    return steps, calls, (((lambda x: _patch(x, p, inverse=False)), wan_channels(vae)) if p else None, None)


def wan_channels(vae) -> int:
    """The video channels Wan's encode takes: its encoder's conv_in takes them patchified (2.2's: 3 p^2)."""
    p = vae.config.get("patch_size") or 1
    return int(vae.encoder.conv_in.in_channels) // (p * p)


def _coder(vae, kind: Kind):
    return vae.decoder if kind is Kind.DECODE else vae.encoder


def _call(vae, kind: Kind, x, cache: list, k: int):
    """Call k of the loop on x (its frames), reading and updating `cache`."""
    if kind is Kind.DECODE:
        takes = inspect.signature(vae.decoder.forward).parameters  # (Qwen-Image's takes no first_chunk)
        first = {"first_chunk": k == 0} if "first_chunk" in takes else {}
        return vae.decoder(vae.post_quant_conv(x), feat_cache=cache, feat_idx=[0], **first)
    return vae.quant_conv(vae.encoder(x, feat_cache=cache, feat_idx=[0]))


def _patch(x, p: int, inverse: bool):
    """AutoencoderKLWan's patchify / unpatchify (diffusers' own functions)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify, unpatchify

    return unpatchify(x, p) if inverse else patchify(x, p)
