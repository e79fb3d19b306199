"""TiledVAE: exact (or fast, named-approximate) tiled decode and encode of diffusers VAEs.

A wrapper, never a patch: it holds the VAE, lowers its encoder and decoder (with quant convs) into tile
programs once, and offers `decode` / `encode` with the signatures and return types of
`AutoencoderKL.decode` / `.encode` (and AutoencoderTiny's), so `pipe.vae = TiledVAE(pipe.vae)` works.
Every other attribute (config, dtype, device, scaling/shift factors, ...) reads through to the VAE.

This file is the face: the settings (one checked `Settings` record; each setting is also an attribute
that reads and writes it), the checks, the public calls and the return types. Each call becomes a `Job`
(its program, device profile, dtype) that the layers below take with the settings: `runner` settles the
plan and runs it, `plan` plans, `video.face` does the same for 3-D causal VAEs. Nothing below this file
takes the TiledVAE.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from diffusers.models.autoencoders.vae import DecoderOutput

from ..distributed import rank_world, resolve_group
from ..locality.program import Program
from ..wrapper import ModelWrapper
from . import frames, gradient, planning, runner
from .checks import check_input, check_vae
from .devices import DeviceProfile, profile, vae_device
from .families import bind, encode_output, family_of
from .family_programs import lower_calls, lower_family
from .plan.records import Plan
from .settings import Attention, FastSettings, Job, Kind, Mode, Settings
from .video import batch
from .video import face as video
from .video import gradient as video_gradient

logger = logging.getLogger(__name__)

MODES = Mode.words()
ATTENTIONS = Attention.words()


class _Setting:
    """A TiledVAE attribute that reads one field of its `settings` (of `settings.fast` with `fast`), and
    writes it into a new record, checked again (`tv.tile_size = 3`)."""

    def __init__(self, field: str, fast: bool = False):
        self.field, self.fast = field, fast

    def __get__(self, tv, owner=None):
        if tv is None:
            return self
        return getattr(tv.settings.fast if self.fast else tv.settings, self.field)

    def __set__(self, tv, value) -> None:
        s = tv.settings
        tv.settings = (s.replace(fast=FastSettings(**{**s.fast.__dict__, self.field: value})) if self.fast
                       else s.replace(**{self.field: value}))


class _Staging(_Setting):
    """The staging as the user gives it: "auto", "device", "host" or "disk"."""

    def __get__(self, tv, owner=None):
        return self if tv is None else tv.settings.staging_word


class TiledVAE(ModelWrapper):
    """Wrap an AutoencoderKL / AutoencoderTiny: tile-by-tile decode and encode, exact by default.

    An nn.Module holding the VAE as its submodule `vae`; it presents the VAE (`tilewise.wrapper`):
    `pipe.to(...)` moves it, `pipe.save_pretrained` saves the VAE as stock diffusers does.
    """

    wrapped = "vae"

    # the settings, as attributes (each reads `settings`, and writes a new record, checked again)
    tile_size = _Setting("tile_size")
    mode = _Setting("mode")
    attention = _Setting("attention")
    memory_budget = _Setting("memory_budget")
    staging = _Staging("staging")
    retry_on_oom = _Setting("retry_on_oom")
    progress = _Setting("progress")
    query_chunk = _Setting("query_chunk")
    stage_dir = _Setting("stage_dir")
    process_group = _Setting("process_group")
    device_kind = _Setting("device_kind")
    color_fix = _Setting("color_fix", fast=True)
    fast_crop = _Setting("crop", fast=True)
    fast_sample = _Setting("sample", fast=True)
    fast_estimator = _Setting("estimator", fast=True)
    fast_low = _Setting("low", fast=True)

    def __init__(self, vae, tile_size: int = 32, mode: str = "exact", attention: str = "global",
                 memory_budget: int | str | None = None, staging: str = "auto", retry_on_oom: bool = False,
                 progress: bool = True, color_fix: bool = False, query_chunk: int = 4096,
                 stage_dir: str | None = None, fast_crop: int | None = None, fast_sample: float | None = None,
                 fast_estimator: str = "tiles", fast_low: int = 4, process_group: Any = None,
                 device_kind: str | DeviceProfile | None = None):
        if not isinstance(vae, torch.nn.Module) or isinstance(vae, TiledVAE):
            raise ValueError(f"vae must be a diffusers VAE module (not already tiled), "
                             f"got {type(vae).__name__}")
        check_vae(vae)
        fast = FastSettings(fast_estimator, fast_sample, fast_low, fast_crop, color_fix)
        settings = Settings(tile_size, mode, attention, memory_budget, staging, retry_on_oom, progress,
                            query_chunk, stage_dir, fast, process_group, device_kind)
        for kind in Kind:  # (refused here, not at the first call; the programs are cached by `families`)
            lower_calls(vae, family_of(vae), kind)
        super().__init__()
        self.settings = settings
        self.last_staged_peak = 0  # most staged bytes this process held in the last tiled run
        self._wrap(vae)  # (moves and casts keep parameter identity, so the lowered programs follow)

    def __repr__(self) -> str:
        return (f"TiledVAE({type(self.vae).__name__}, tile_size={self.tile_size}, mode={self.mode.value!r}, "
                f"attention={self.attention.value!r}, staging={self.staging!r})")

    def enable_tiling(self, *args, **kwargs) -> None:
        """diffusers' tiling is not used through this wrapper: tilewise's tiling is active already."""
        logger.info("TiledVAE: enable_tiling() ignored, tilewise's %s tiling is active (tile %d latent px)",
                    self.mode, self.tile_size)

    def enable_slicing(self, *args, **kwargs) -> None:
        """Batch slicing is not needed: tiles bound the memory whatever the batch."""
        logger.info("TiledVAE: enable_slicing() ignored, tilewise's %s tiling is active (tile %d latent px)",
                    self.mode, self.tile_size)

    def disable_tiling(self) -> None:
        logger.info("TiledVAE: disable_tiling() ignored; decode with the wrapped VAE (tv.vae) to run untiled")

    def disable_slicing(self) -> None:
        logger.info("TiledVAE: disable_slicing() ignored (tilewise's tiling is active)")

    def forward(self, sample, *args, num_frames: int | None = None, **kwargs):
        """The VAE's forward (encode, then decode the posterior mode or a sample) on the tiled paths, with
        the wrapped class's arguments (`num_frames`: SVD's; its pipeline passes it where forward names it)."""
        kwargs = kwargs if num_frames is None else {**kwargs, "num_frames": num_frames}
        family = family_of(self.vae)
        call = bind(type(self.vae).forward, self.vae, (sample, *args), kwargs,
                    {"sample_posterior": False, "return_dict": True, "generator": None, **_inputs(family)})
        if family.decoded != "output" or family.output is not None:
            raise NotImplementedError(f"TiledVAE.forward() for {type(self.vae).__name__}: its forward pads "
                                      "the video in time first, which the tiled path does not follow; call "
                                      "tv.encode and tv.decode")
        z = self.encode(sample, return_dict=False)[0]
        if family.quantize:  # VQModel.forward: encode, decode (quantised)
            dec = self.decode(z)
            return dec if call["return_dict"] else (dec.sample, dec.commit_loss)
        if family.encoded == "tiny":  # AutoencoderTiny.forward: encode, quantise latents to 8 bits, decode
            z = self.vae.unscale_latents(self.vae.scale_latents(z).mul_(255).round_().byte() / 255.0)
        elif family.encoded in ("posterior", "identity"):  # (the others decode what encode returns: DC-AE)
            z = z.sample(generator=call["generator"]) if call["sample_posterior"] else z.mode()
        dec = self.decode(z, **{k: call[k] for k in _inputs(family)}).sample
        return DecoderOutput(sample=dec) if call["return_dict"] else (dec,)

    # -- programs and jobs --------------------------------------------------------------------------

    @property
    def is_tiny(self) -> bool:
        return family_of(self.vae).encoded == "tiny"

    @property
    def is_video(self) -> bool:
        """A 3-D causal VAE (Qwen-Image, Wan, LTX-Video): (B, C, T, H, W) values, run by `video.face`."""
        return family_of(self.vae).video

    def program(self, kind: str, frames: int | None = None) -> Program:
        """The lowered decode (e.g. post_quant_conv + decoder) or encode (encoder + quant_conv) of the
        VAE's family (`families`): lowered again when its layers or their training modes changed; a
        chunked loop's (CogVideoX's) for an input of `frames` frames (its first call's)."""
        return lower_family(self.vae, family_of(self.vae), _kind(kind), frames)

    def factor(self, kind: str) -> int:
        """Image pixels per latent pixel."""
        p = self.program(kind)
        ratio = p.shapes((64, 64))[p.output][0] / 64
        return round(ratio) if _kind(kind) is Kind.DECODE else round(1 / ratio)

    def job(self, kind: str, frames: int | None = None) -> Job:
        """What a decode or encode call runs: the lowered program (a chunked loop's for an input of
        `frames` frames), the device profile its plans are made for (`device_kind`, or the VAE's device),
        the VAE's dtype and device."""
        kind, family = _kind(kind), family_of(self.vae)
        why = family.frames(self.vae, kind, frames) if family.frames is not None and frames else ""
        if why:  # (before its first call is lowered: the frame counts the wrapped VAE takes)
            raise ValueError(f"TiledVAE.{kind.value}(): {why}")
        dtype = next((q.dtype for q in self.vae.parameters()), torch.float32)
        device = vae_device(self.vae)
        return Job(kind, self.program(kind, frames), profile(self.device_kind, device), dtype, device,
                   self.factor(kind), type(self.vae).__name__)

    # -- public API ---------------------------------------------------------------------------------

    def decode(self, z, *args, **kwargs):
        """Decode latents tile by tile, with the arguments and return type of the wrapped VAE's decode
        (AutoencoderKL: DecoderOutput(sample=...); VQModel: quantised first unless force_not_quantize,
        DecoderOutput(sample=..., commit_loss=...); LTX-Video 0.9.5+ / LTX-2: decode(z, temb), the
        timestep's embedding computed once per call; Qwen-Image 2.1: (B, C, 1, H, W) in and out)."""
        family, job = family_of(self.vae), self.job("decode", _frames(z))
        z, job = self._kept(job, z)
        call = bind(type(self.vae).decode, self.vae, (z, *args), kwargs,
                    {"return_dict": True, "force_not_quantize": False, **_inputs(family)})
        if self.is_video or family.batched:  # (SVD's: the frames of each video in the batch, `video.batch`)
            z = batch.as_video(job, z, call["num_frames"]) if family.batched else z
            video.check(self.settings, job, z)
            temb = call.get("temb")
            graph = gradient.wants(self.vae, z) or (torch.is_grad_enabled() and job.program.call is not None
                                                    and isinstance(temb, torch.Tensor) and temb.requires_grad)
            with self._bound(job, temb, z, graph):
                sample = self._ran(self._run_video(job, z, graph))
            sample = batch.as_rows(sample) if family.batched else sample
            if family.frames_first:  # (Allegro's decode returns (B, T, C, H, W))
                sample = sample.permute(0, 2, 1, 3, 4).contiguous()
            if family.decoded == "frames":  # (VidTok's decode returns its frames)
                return sample
            return DecoderOutput(sample=sample) if call["return_dict"] else (sample,)
        if family.frame:  # (an image in a video's layout: the program runs its one frame)
            z = frames.one_frame(job, z)
        check_input(job, z)
        z, loss = self._quantized(z, family, call["force_not_quantize"], gradient.wants(self.vae, z))
        sample = self._ran(self._run(job, z))
        if family.frame:
            sample = sample.unsqueeze(2)
        if not family.quantize:
            return DecoderOutput(sample=sample) if call["return_dict"] else (sample,)
        return DecoderOutput(sample=sample, commit_loss=loss) if call["return_dict"] else (sample, loss)

    def encode(self, x, *args, **kwargs):
        """Encode images tile by tile; returns what the wrapped VAE's encode does (AutoencoderKLOutput
        (latent_dist=...), AutoencoderTinyOutput(latents=...), VQEncoderOutput(latents=...))."""
        family, job = family_of(self.vae), self.job("encode", _frames(x))
        call = bind(type(self.vae).encode, self.vae, (x, *args), kwargs, {"return_dict": True})
        if self.is_video:
            video.check(self.settings, job, x)
            video.dropped_frames(job, x)
            h = self._ran(self._run_video(job, x))
        else:
            x = frames.one_frame(job, x) if family.frame else x
            check_input(job, x)
            h = self._ran(self._run(job, x))
            h = h.unsqueeze(2) if family.frame else h
        return encode_output(family, h, call["return_dict"], self.vae)

    def _run_video(self, job: Job, t, graph: bool | None = None) -> tuple:
        """A 3-D decode or encode: with a graph (`video.gradient`: the causal steps recomputed last to
        first as its backward) when the call asks for gradients (`graph`; by default `gradient.wants`:
        a timestep-conditioned decode's temb may ask too), else the plain tiled run."""
        family = family_of(self.vae)
        note = family.note(self.vae, job.kind, tuple(t.shape)) if family.note is not None else ""
        if note:
            logger.info("TiledVAE %s: %s", job.model, note)
        if gradient.wants(self.vae, t) if graph is None else graph:
            return video_gradient.run(self.settings, job, t, self.vae)
        return video.run(self.settings, job, t)

    def _bound(self, job: Job, temb, z, gradients: bool = False):
        """The context a video decode's program reads its call's values in (`video.bound`: LTX's timestep
        embedding; SVD's AlphaBlender weights, `batch.bound`)."""
        if family_of(self.vae).batched:
            return batch.bound(job, z, gradients)
        return video.bound(job, temb, z, gradients)

    def _video(self, kind: Kind) -> bool:
        """Whether a decode or encode runs a video program (a 3-D VAE's; SVD's decode)."""
        return self.is_video or family_of(self.vae).batched and kind is Kind.DECODE

    def _run(self, job: Job, t) -> tuple:
        """A 2-D decode or encode: with a graph (`gradient`: the reverse tile program as its backward)
        when the call asks for gradients, else the plain tiled run."""
        if gradient.wants(self.vae, t):
            return gradient.run(self.settings, job, t, self.vae)
        return runner.run(self.settings, job, t, None, self.vae)

    def _quantized(self, z, family, force_not_quantize: bool, graph: bool = False):
        """A VQ family's latent as its decode quantises it (the nearest codebook entry at each position:
        the wrapped VAE's own quantizer, untiled, the latent is small) and the commitment loss; other
        families' as given. `graph`: the quantizer runs with autograd, as the stock decode's does (its
        straight-through estimator passes the decode's gradient to z; the loss reaches the codebook)."""
        if not family.quantize:
            return z, None
        if force_not_quantize:
            if getattr(self.vae.config, "lookup_from_codebook", False):
                raise ValueError(f"{type(self.vae).__name__}.decode(force_not_quantize=True) with "
                                 "lookup_from_codebook reads codebook indices, not latents: use the wrapped "
                                 "VAE")
            return z, torch.zeros((z.shape[0],), dtype=z.dtype, device=z.device)
        with torch.set_grad_enabled(graph):
            quant, loss, _ = self.vae.quantize(z)
        return quant, loss

    def decode_to(self, z, sink, temb=None) -> None:
        """Decode one latent into a sink (PNG, TIFF, memmap) tile by tile, never holding the image.

        With a process group every rank calls it; rank 0 writes (its sink receives the other ranks'
        rows), the others pass sink=None. A 3-D VAE streams frames into a video sink
        (`tilewise.sinks.video`), or its one frame into an image sink; an image VAE in a video's layout
        (Qwen-Image 2.1) its (1, C, 1, H, W) latent into an image sink; SVD's temporal decoder the (1, C,
        T, H, W) video of one decode call's frames. `temb`: a timestep-conditioned decoder's (LTX-Video
        0.9.5+, LTX-2), as decode takes it.
        """
        job = self.job("decode", _frames(z))  # (a chunked loop's program is its first call's: per frames)
        z, job = self._kept(job, z)
        if self._video(Kind.DECODE):
            video.check(self.settings, job, z)
            with self._bound(job, temb, z):
                self._ran((None, video.decode_to(self.settings, job, z, sink)))
            return
        z = frames.one_frame(job, z) if family_of(self.vae).frame else z
        check_input(job, z)
        if z.shape[0] != 1:
            raise ValueError(f"decode_to streams one image: batch must be 1, got {z.shape[0]}")
        z = self._quantized(z, family_of(self.vae), False)[0]
        rank = rank_world(resolve_group(self.process_group))[0]
        if (sink is None) != (rank != 0):
            raise ValueError(f"rank {rank}: " + ("only rank 0 writes the image: pass sink=None here" if rank
                                                 else "decode_to needs a sink (PNG, TIFF, memmap), got None"))
        want = (z.shape[-2] * job.factor, z.shape[-1] * job.factor)
        if sink is not None and (sink.height, sink.width) != want:
            raise ValueError(f"sink is {sink.height}x{sink.width} but the decoded image is "
                             f"{want[0]}x{want[1]}")

        def emit(box, value):
            emit.sent = True  # (a rerun after an overflow would write rows twice)
            sink.write(box[0], box[2], value[0].float())

        self._ran(runner.run(self.settings, job, z, emit, self.vae))

    def plan(self, shape: tuple[int, ...], kind: str = "decode", tile_size: int | None = None,
             staging: str | None = None, streamed: bool = False, sequential: bool = False,
             backward: bool = False) -> Plan:
        """The plan for an input of `shape` (B, C, H, W): grid, halo overhead, staged bytes, peak (an image
        VAE in a video's layout, Qwen-Image 2.1: (B, C, 1, H, W), planned as the one frame it runs).

        Fast mode with the sampled-tile estimator is planned pass by pass (`Plan.passes`): decode's exact
        latent-resolution head, the low pass, the sampled tiles (run together), the other tiles, and
        encode's exact latent-resolution tail. A 3-D VAE's plan (`VideoPlan`) has its causal steps and
        caches. `streamed`: the plan of `decode_to` (a sink; within a memory budget, no untiled run);
        `sequential` (3-D VAEs): its sink takes frames in order. `backward`: the plan of a call that asks
        for gradients, its `backward` the reverse program's peak and work (`BackwardPlan`; a 3-D VAE's:
        `VideoBackwardPlan`, its causal steps recomputed; within a memory budget both the forward's and
        the backward's peaks fit it).
        """
        job = self.job(kind, int(shape[2]) if len(shape) == 5 else None)
        shape, job = self._kept_shape(job, tuple(shape))
        return planning.plan(self.settings, job, self.vae, tuple(shape), self._video(job.kind), tile_size,
                             staging, streamed=streamed, sequential=sequential, backward=backward)

    def preflight(self, shape: tuple[int, ...], kind: str = "decode", streamed: bool = False) -> Plan:
        """The plan a decode (`streamed`: decode_to) or encode of `shape` will follow, checked against the
        memory and disk there are (WontFit otherwise): what a recipe calls before its expensive work."""
        job = self.job(kind, int(shape[2]) if len(shape) == 5 else None)
        shape, job = self._kept_shape(job, tuple(shape))
        return planning.preflight(self.settings, job, self.vae, tuple(shape), self._video(job.kind),
                                  streamed, self.stage_dir)

    def _kept(self, job: Job, t) -> tuple:
        """t and its job with the frames the wrapped VAE's own call drops dropped (`Family.kept`: VidTok's
        non-causal decode keeps a multiple of its latent frames batch), said in a warning; after `job`
        checked the frame count."""
        shape, kept = self._kept_shape(job, tuple(t.shape))
        if kept is job:
            return t, job
        logger.warning("%s %ss %d of %d input frames, as its own %s does (the last %d dropped)", job.model,
                       job.kind.value, shape[2], t.shape[2], job.kind.value, t.shape[2] - shape[2])
        return t[:, :, : shape[2]], kept

    def _kept_shape(self, job: Job, shape: tuple) -> tuple:
        """(shape, job) of the frames of an input of `shape` the wrapped VAE's own call keeps (`_kept`)."""
        family = family_of(self.vae)
        if family.kept is None or len(shape) != 5:
            return shape, job
        n = family.kept(self.vae, job.kind, int(shape[2]))
        return (shape, job) if n == shape[2] else ((*shape[:2], n, *shape[3:]), self.job(job.kind.value, n))

    def _ran(self, result: tuple):
        """The output of a run, keeping its staged peak (`last_staged_peak`; an untiled run has none)."""
        out, peak = result
        if peak is not None:
            self.last_staged_peak = peak
        return out


def _inputs(family) -> dict:
    """The per-call arguments a family's decode takes by name, with their defaults (LTX: temb; SVD:
    num_frames)."""
    if family.batched:
        return {"num_frames": 1}
    return {"temb": None} if family.inputs is not None else {}


def _frames(t) -> int | None:
    """The frames of a (B, C, T, H, W) call input (None for another: its check says why)."""
    return int(t.shape[2]) if isinstance(t, torch.Tensor) and t.ndim == 5 else None


def _kind(kind) -> Kind:
    """'decode' or 'encode' as a Kind."""
    if kind not in Kind.words():
        raise ValueError(f"kind must be 'decode' or 'encode', got {kind!r}")
    return Kind(kind)
