"""TiledVAE: exact (or fast, named-approximate) tiled decode and encode of diffusers VAEs.

A wrapper, never a patch: it holds the VAE, lowers its encoder and decoder (with quant convs) into tile
programs once, and offers `decode` / `encode` with the signatures and return types of
`AutoencoderKL.decode` / `.encode` (and AutoencoderTiny's), so `pipe.vae = TiledVAE(pipe.vae)` works.
Every other attribute (config, dtype, device, scaling/shift factors, ...) reads through to the VAE.
This file is the face: settings, checks, the public calls; `plan` plans, `executor` runs exact mode,
`fast` runs fast mode.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..locality.lowering import chain, lower, lower_conv
from ..locality.lowering3d import is_video_vae, lower_video_vae
from ..locality.program import Program
from ..wrapper import ModelWrapper
from . import video_face
from .checks import check_dtype, check_finite, check_fits
from .devices import DeviceProfile, device_options, device_profile, profile
from .executor import Executor, NonFiniteError, check_output
from .fast import crop_stats, fast_split, run_fast
from .plan import Choices, Plan, make_plan
from .settle import settle
from .staging import STAGINGS, TRIM_FREE

logger = logging.getLogger(__name__)

MODES = ("exact", "fast")
DEFAULT_CHOICES = Choices()  # a run outside a settled plan: no bands, nothing streamed, reads ahead
ATTENTIONS = ("global", "tile")


class TiledVAE(ModelWrapper):
    """Wrap an AutoencoderKL / AutoencoderTiny: tile-by-tile decode and encode, exact by default.

    An nn.Module holding the VAE as its submodule `vae`; it presents the VAE (`tilewise.wrapper`):
    `pipe.to(...)` moves it, `pipe.save_pretrained` saves the VAE as stock diffusers does.
    """

    wrapped = "vae"
    _transient = ("_programs",)  # lowered programs hold lambdas: rebuilt on first use after a copy

    def __init__(self, vae, tile_size: int = 32, mode: str = "exact", attention: str = "global",
                 memory_budget: int | str | None = None, staging: str = "auto", retry_on_oom: bool = False,
                 progress: bool = True, color_fix: bool = False, query_chunk: int = 4096,
                 stage_dir: str | None = None, fast_crop: int | None = None, fast_sample: float | None = None,
                 fast_estimator: str = "tiles", fast_low: int = 4, process_group: Any = None,
                 device_kind: str | DeviceProfile | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        if staging not in ("auto", *STAGINGS):
            raise ValueError(f"staging must be 'auto' or one of {STAGINGS}, got {staging!r}")
        if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 1:
            raise ValueError(f"tile_size must be a positive int (latent pixels), got {tile_size!r}")
        if query_chunk < 1:
            raise ValueError(f"query_chunk must be >= 1, got {query_chunk!r}")
        if not isinstance(vae, torch.nn.Module) or isinstance(vae, TiledVAE):
            raise ValueError(f"vae must be a diffusers VAE module (not already tiled), "
                             f"got {type(vae).__name__}")
        super().__init__()
        self.tile_size, self.mode, self.attention = tile_size, mode, attention
        self.memory_budget = None
        if memory_budget is not None:
            from ..memory import parse_bytes

            self.memory_budget = parse_bytes(memory_budget)
        self.staging, self.retry_on_oom, self.progress = staging, retry_on_oom, progress
        self.color_fix, self.query_chunk, self.stage_dir = color_fix, query_chunk, stage_dir
        if fast_estimator not in ("tiles", "crops"):
            raise ValueError(f"fast_estimator must be 'tiles' or 'crops', got {fast_estimator!r}")
        if fast_sample is not None and not 0 < fast_sample <= 1:
            raise ValueError(f"fast_sample must be None (the estimator's default) or in (0, 1], "
                             f"got {fast_sample!r}")
        self.fast_crop, self.fast_sample, self.fast_estimator = fast_crop, fast_sample, fast_estimator
        if isinstance(fast_low, bool) or not isinstance(fast_low, int) or fast_low < 0:
            raise ValueError(f"fast_low must be an int >= 0 (0: no low-resolution pass), got {fast_low!r}")
        self.fast_low = fast_low
        if isinstance(process_group, str) and process_group != "default":
            raise ValueError(f"process_group must be None, 'default' or a ProcessGroup, "
                             f"got {process_group!r}")
        if process_group is not None and retry_on_oom:
            raise ValueError("retry_on_oom=True is single-process only (a retry on one rank would "
                             "desynchronise the others): drop it or process_group")
        self.process_group = process_group
        profile(device_kind, "cpu")  # (checks the value: a kind name, a DeviceProfile or None)
        self.device_kind = device_kind  # what plans are shaped for (None: the device the VAE is on)
        self.last_staged_peak = 0  # most staged bytes this process held in the last tiled run
        self._wrap(vae)  # (moves and casts keep parameter identity, so the lowered programs follow)

    def __repr__(self) -> str:
        return (f"TiledVAE({type(self.vae).__name__}, tile_size={self.tile_size}, mode={self.mode!r}, "
                f"attention={self.attention!r}, staging={self.staging!r})")

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

    def forward(self, sample, sample_posterior: bool = False, return_dict: bool = True, generator=None):
        """The VAE's forward (encode, then decode the posterior mode or a sample) on the tiled paths."""
        from diffusers.models.autoencoders.vae import DecoderOutput

        if self.is_tiny:  # AutoencoderTiny.forward: encode, quantise latents to 8 bits, decode
            enc = self.encode(sample).latents
            z = self.vae.unscale_latents(self.vae.scale_latents(enc).mul_(255).round_().byte() / 255.0)
        else:
            posterior = self.encode(sample).latent_dist
            z = posterior.sample(generator=generator) if sample_posterior else posterior.mode()
        dec = self.decode(z).sample
        return DecoderOutput(sample=dec) if return_dict else (dec,)

    # -- programs -----------------------------------------------------------------------------------

    @property
    def is_tiny(self) -> bool:
        return type(self.vae).__name__ == "AutoencoderTiny"

    @property
    def is_video(self) -> bool:
        """A 3-D causal VAE (Qwen-Image, Wan, LTX-Video): (B, C, T, H, W) values, run by `video_face`."""
        return is_video_vae(self.vae)

    def program(self, kind: str) -> Program:
        """The lowered decoder (post_quant_conv + decoder) or encoder (encoder + quant_conv)."""
        if "_programs" not in self.__dict__:
            self.__dict__["_programs"] = {}
        if kind not in self._programs:
            if self.is_video:
                self._programs[kind] = lower_video_vae(self.vae, kind)
            elif kind == "decode":
                p = lower(self.vae.decoder)
                pq = getattr(self.vae, "post_quant_conv", None)
                self._programs[kind] = chain(lower_conv(pq, "post_quant_conv"), p) if pq is not None else p
            elif kind == "encode":
                p = lower(self.vae.encoder)
                q = getattr(self.vae, "quant_conv", None)
                self._programs[kind] = chain(p, lower_conv(q, "quant_conv")) if q is not None else p
            else:
                raise ValueError(f"kind must be 'decode' or 'encode', got {kind!r}")
        return self._programs[kind]

    def factor(self, kind: str) -> int:
        """Image pixels per latent pixel."""
        p = self.program(kind)
        shapes = p.shapes((64, 64))
        ratio = shapes[p.output][0] / 64
        return round(ratio) if kind == "decode" else round(1 / ratio)

    # -- validation ---------------------------------------------------------------------------------

    def _check(self, t, kind: str) -> None:
        import torch

        p = self.program(kind)
        what = "latent z" if kind == "decode" else "image x"
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{what} must be a (B, C, H, W) tensor, got {shape}")
        if t.shape[1] != p.in_channels:
            raise ValueError(f"{what} has {t.shape[1]} channels, the VAE {kind}r expects {p.in_channels} "
                             f"(shape {tuple(t.shape)})")
        if min(t.shape) == 0:
            raise ValueError(f"{what} is empty: shape {tuple(t.shape)}")
        h, w = t.shape[-2:]
        shapes = p.shapes((h, w))
        small = next((op for op in p.ops if min(shapes[op.dst]) < 1), None)
        if small is not None:
            raise ValueError(f"{what} of {h}x{w} is too small for the VAE {kind}r: {small.name} would have "
                             f"no pixels left (the wrapped VAE fails on it too); use a larger {what}")
        check_dtype(t, what, self.vae)
        check_finite(t, what)
        if torch.is_grad_enabled() and t.requires_grad:
            raise RuntimeError("TiledVAE does not support autograd: tiled paths run under torch.no_grad and "
                               "would break backward(); use the wrapped VAE directly to train")

    # -- public API ---------------------------------------------------------------------------------

    def decode(self, z, return_dict: bool = True, generator=None):
        """Decode latents tile by tile; returns DecoderOutput(sample=...) like AutoencoderKL.decode."""
        from diffusers.models.autoencoders.vae import DecoderOutput

        if self.is_video:
            return video_face.decode(self, z, return_dict)
        self._check(z, "decode")
        sample = self._run("decode", z)
        return DecoderOutput(sample=sample) if return_dict else (sample,)

    def encode(self, x, return_dict: bool = True):
        """Encode images tile by tile; returns AutoencoderKLOutput(latent_dist=...) (or the Tiny output)."""
        if self.is_video:
            return video_face.encode(self, x, return_dict)
        self._check(x, "encode")
        h = self._run("encode", x)
        if self.is_tiny:
            from diffusers.models.autoencoders.autoencoder_tiny import AutoencoderTinyOutput

            return AutoencoderTinyOutput(latents=h) if return_dict else (h,)
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        posterior = DiagonalGaussianDistribution(h)
        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)

    def decode_to(self, z, sink) -> None:
        """Decode one latent into a sink (PNG, TIFF, memmap) tile by tile, never holding the image.

        With a process group every rank calls it; rank 0 writes (its sink receives the other ranks'
        rows), the others pass sink=None. A 3-D VAE streams frames into a video sink
        (`tilewise.sinks.video`), or its one frame into an image sink.
        """
        if self.is_video:
            return video_face.decode_to(self, z, sink)
        self._check(z, "decode")
        if z.shape[0] != 1:
            raise ValueError(f"decode_to streams one image: batch must be 1, got {z.shape[0]}")
        rank = _rank(self._group())
        if (sink is None) != (rank != 0):
            raise ValueError(f"rank {rank}: " + ("only rank 0 writes the image: pass sink=None here" if rank
                                                 else "decode_to needs a sink (PNG, TIFF, memmap), got None"))
        f = self.factor("decode")
        want = (z.shape[-2] * f, z.shape[-1] * f)
        if sink is not None and (sink.height, sink.width) != want:
            raise ValueError(f"sink is {sink.height}x{sink.width} but the decoded image is "
                             f"{want[0]}x{want[1]}")

        def emit(box, value):
            emit.sent = True  # (a rerun after an overflow would write rows twice)
            sink.write(box[0], box[2], value[0].float())

        self._run("decode", z, emit=emit)

    # -- running ------------------------------------------------------------------------------------

    def _run(self, kind: str, t, emit=None):
        """Run the program as planned, halving the tile on out-of-memory when retry_on_oom is set; a
        half-precision overflow (NaN / inf) runs again in float32, as diffusers' force_upcast does."""
        import torch

        plan = settle(self, kind, tuple(t.shape), streamed=emit is not None)
        check_fits(self, kind, tuple(t.shape), plan, streamed=emit is not None)
        tile, staging = plan.tile_size, plan.staging
        bands = plan.choices()
        while True:
            try:
                with torch.no_grad():
                    return self._run_once(kind, t, tile, staging, emit, bands)
            except NonFiniteError as err:
                return self._upcast(kind, t, tile, staging, emit, bands, err)
            except torch.OutOfMemoryError:
                if not self.retry_on_oom or tile <= 1:
                    raise
                logger.warning("TiledVAE %s: out of memory at tile_size %d, retrying with %d%s", kind, tile,
                               tile // 2, " (fast mode in one piece, its low pass in those tiles)"
                               if bands.fast_cuts or bands.low_tile else "")
                tile //= 2
                bands = bands._replace(fast_cuts=(), low_tile=0)
                torch.cuda.empty_cache() if torch.cuda.is_available() else None

    def _upcast(self, kind: str, t, tile: int, staging: str, emit, bands, err):
        """Run again with the VAE in float32 after a half-precision overflow (diffusers' force_upcast:
        the SDXL VAE's float16 activations overflow), said in the log; the result in t's dtype. Raised
        as it is in float32, or once a sink has received rows."""
        import torch

        dtype = self.vae.dtype
        if t.dtype not in (torch.float16, torch.bfloat16) or getattr(emit, "sent", False):
            raise err
        logger.warning("TiledVAE %s: %s overflow (NaN or inf in the output of %r); running it again with "
                       "the VAE in float32, as diffusers' force_upcast does", kind, err.dtype, err.producer)
        self.vae.to(torch.float32)
        try:
            with torch.no_grad():
                out = self._run_once(kind, t.float(), tile, staging, emit, bands)
        finally:
            self.vae.to(dtype)
        return None if out is None else out.to(t.dtype)

    def _executor(self, kind: str, t, tile: int, staging: str, slack: int, bands) -> Executor:
        """The exact (or crop-estimated fast) executor; "device+host" runs as host staging with the
        plan's values on the device."""
        p = self.program(kind)
        ref = p.input if kind == "decode" else p.output
        group = self._group()
        fixed = crop_stats(self, p, kind, t, ref, tile, group) if self.mode == "fast" else {}
        # fast mode runs its tiles end to end, whole (see fast.run_fast); exact segments in row bands
        kv_chunk, query_rows = bands.attention
        return Executor(p, tile, ref, attention=self.attention, staging=staging.split("+")[-1],
                        device=t.device, fixed_stats=fixed, query_chunk=self.query_chunk,
                        progress=self.progress, stage_dir=self.stage_dir, group=group, heap_slack=slack,
                        band_bytes=None if self.mode == "fast" else bands.band_bytes,
                        on_device=bands.on_device, kv_chunk=kv_chunk, query_rows=query_rows,
                        read_ahead=bands.read_ahead, **device_options(self))

    def _group(self):
        """The resolved process group (None: single process)."""
        from ..distributed import resolve_group

        return resolve_group(self.process_group)

    def _run_once(self, kind: str, t, tile: int, staging: str, emit, bands: Choices = DEFAULT_CHOICES):
        """One run; `bands`: what the plan settled beyond tile and staging (`plan.Choices`: row bands of
        exact segments, values staged on the device with "device+host", fast mode's staged estimate,
        streamed attention, reads ahead)."""
        p = self.program(kind)
        shapes = p.shapes(tuple(t.shape[-2:]))
        ref = p.input if kind == "decode" else p.output
        if max(shapes[ref]) <= tile and emit is None:  # fits one tile: the plain untiled path (exact)
            if self.mode == "exact":
                return check_output(p.run(t), p)
            if device_profile(self).kind != "cpu":  # (fast mode's passes on one tile only add work)
                logger.info("TiledVAE %s: one tile covers the input; fast mode runs it untiled (exact)", kind)
                return check_output(p.run(t), p)
        slack = TRIM_FREE  # freed host heap disk staging keeps; budgeted only where the budget is host memory
        if self.memory_budget is not None and staging == "disk" and t.device.type == "cpu":
            slack = self.plan(tuple(t.shape), kind=kind, tile_size=tile, staging=staging).heap_slack
        split = fast_split(self, p, kind)
        if split is not None:
            out, self.last_staged_peak = run_fast(self, kind, p, split, t, tile, staging, emit, slack,
                                                  self._group(), bands.staged_estimate, bands.fast_cuts,
                                                  bands.low_tile)
            return out
        ex = self._executor(kind, t, tile, staging, slack, bands)
        out = ex.run(t, emit=emit)
        self.last_staged_peak = ex.staged_peak
        return out

    def plan(self, shape: tuple[int, ...], kind: str = "decode", tile_size: int | None = None,
             staging: str | None = None) -> Plan:
        """The plan for an input of `shape` (B, C, H, W): grid, halo overhead, staged bytes, peak.

        Fast mode with the sampled-tile estimator is planned pass by pass (`Plan.passes`): decode's exact
        latent-resolution head, the low pass, the sampled tiles (run together), the other tiles, and
        encode's exact latent-resolution tail. A 3-D VAE's plan (`VideoPlan`) has its causal steps and caches.
        """
        if self.is_video:
            return video_face.plan(self, shape, kind, tile_size, staging)
        if tile_size is None and staging is None and self.memory_budget is not None:
            return settle(self, kind, tuple(shape))
        return make_plan(self, shape, kind, tile_size, staging)


def _rank(group) -> int:
    """This process's rank in group (0 without one)."""
    from ..distributed import rank_world

    return rank_world(group)[0]
