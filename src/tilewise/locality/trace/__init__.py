"""Lower a module into a tile program from what it computes: its captured torch calls (`capture`).

Each recorded call on spatial values ((B, C, H, W) tensors the program carries, starting with the input)
becomes a primitive op by what the call is, not by the module class it ran in:

- `conv2d`: `Conv` (its zero padding, merged with an `F.pad` of zeros before it); `group_norm`:
  `GroupNorm` (the sync op); `interpolate(mode="nearest")` by an integer factor: `Resample`;
  `pixel_shuffle` / `pixel_unshuffle`: a block rearrangement (`ops3d.Rearrange`);
- elementwise functions of one spatial value (activations, casts, arithmetic with numbers or per-channel
  constants): `Pointwise` (chains of them fused into one, their kernels summed); of two: `Add`
  (`(a + b) / s` fused) or `Combine`; `cat` along channels: `Cat`; channel slices (`chunk`, `split`,
  `x[:, a:b]`): `Slice`; calls that return their input (`contiguous`, `dropout` in eval, a cast to the
  same dtype) nothing;
- diffusers' `Attention` (a unit of the capture): a `GroupNorm` and an `AttentionCore` (`units.attention`:
  queries tiled, keys and values global); Qwen-Image 2.1's `QwenImage21AttentionBlock` likewise (its
  channel norm and an `AttentionCore`, `units.channel_attention`);
- a call that leaves the spatial layout (`permute`, `view`, ...) inside a module whose inputs and
  output are spatial: that module as one op, if it computes position by position (checked on the
  example: perturbing one position changes only that position of its output, and its output on a crop
  is the crop of its output): `Pointwise` running the module on the op's box (channel norms over a
  permuted tensor, quantisers, ...).

Anything else is refused with the call, the module path it ran in and why (`LoweringError`). Python
control flow follows the example, so the example must take the branches the real inputs take (a
decoder's example is a latent of the right channels; sizes are free). The result is scheduled so that a
value's last reader comes first where it can (a resnet's shortcut projection before its GroupNorm: the
block input then dies sooner, as the hand lowering orders it).

Video values ((B, C, T, H, W): a 3-D VAE's) have their own rules (`video`: conv3d with its causal padding,
slices / repeats / splits / concatenations of frames, nearest interpolation, GroupNorm over the step's
frames; `video_tokens`: HunyuanVideo's attention over every frame's tokens; `video_fold`: a GroupNorm of
each frame and an attention over each position's frames, their axes folded into the batch (Mochi's,
Cosmos' GroupNorms); `video_batch`: a video value's frames in the batch for 2-D layers of each frame, SVD's
temporal decoder; `video_sdpa`: a scaled_dot_product_attention of a video value's tokens over each
frame or each position's frames (Cosmos' attention blocks); `video_windows`: a causal convolution's loop
over its input's windows of frames, concatenated, one convolution (Magvit's); `video_rows`: a run of
calls on each position's frames as rows (B H W, C, T), one op (VidTok's 1-D resnet halves);
`video_samples`: a loop over a video value's batch, each sample back in a batch of one (VidTok's
non-causal upsampler); measured ops keep or change the frames as measured); a video example gives a
one-step video program (`program3d.VideoProgram`: every frame in one step, as the computation ran them),
which the video executor runs.

An image VAE in a video's layout ((B, C, 1, H, W) values whose convolutions are 2-D ones on the one
frame: Qwen-Image 2.1's) is traced on a (B, C, H, W) example: its one-frame values are carried without the
frame axis and the calls replayed on them get it back (`frames`), so it lowers into a 2-D program.

The package: `capture` records the calls; `rules` places each call by what it is (`layers`: the 2-D
layers' rules); `video` the calls on video values (`video_tokens` their tokens through an Attention,
`video_fold` their axes folded into the batch, `video_batch` their frames in the batch through 2-D
layers, `video_sdpa` their tokens through scaled_dot_product_attention, `video_windows` a convolution's
loop over their windows of frames, `video_rows` their positions' frames as rows, `video_samples` a loop
over their batch); `frames` a 2-D program's
one-frame values; `measured` places what no rule does by measuring it (a run of calls back to the
spatial layout, or the module around a call); `schedule` orders and fuses the ops; `lower` drives
them (`lower_traced`); `state` is what they share.
"""

from .capture import capture
from .lower import lower_traced
from .measured import measure

__all__ = ["capture", "lower_traced", "measure"]
