"""The options of the recipes' command families, one frozen record each, shared by the CLI and the recipes.

A typer command keeps its typed options (its interface: defaults shown, ranges checked) and builds one of
these; the recipe's `run_*` form takes it (`run_generate`, `run_decode_file`, `run_encode_file`), and the
keyword forms (`generate`, `decode_file`, `encode_file`) build it from their arguments. The records hold
values, not work: what needs the model (sizes against its factor, outputs, memory) is checked by the
recipe, in the order it always has been. Upscale's record, `UpscaleOptions`, lives with `upscale` in
`tilewise.diffusion`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..limits import MAX_STEPS, check_count


@dataclass(frozen=True)
class GenerateOptions:
    """Text to image at any size (`generate`): prompt and size, the denoiser's tiles, the VAE's, the output.

    `regions` are (box (x0, y0, x1, y1) in pixels, prompt); `batch_size` None: 32 tiles per call for the
    embedded model, else 4; `out` None: the image stays in memory; `process_group` ("default" under
    torchrun) splits both stages' tiles over the ranks, rank 0 writes `out`. `frames` (video pipelines:
    Wan 2.x, SkyReels-V2, ...): frames to generate, `out` then a frame pattern, .npy or .tif stack;
    `tile_frames` / `frame_overlap`: the denoiser's overlapping frame windows, in latent frames.
    Text to video is `pipelines.generate_video`."""

    prompt: str
    width: int
    height: int
    negative: str = ""
    regions: tuple[tuple[tuple[int, int, int, int], str], ...] = ()
    method: str = "mixture"
    tile_size: int = 16
    overlap: int = 4
    batch_size: int | None = None
    steps: int = 20
    seed: int = 0
    guidance: float = 5.0
    vae_tile: int = 32
    vae_mode: str = "exact"
    out: str | None = None
    bits: int = 8
    progress: bool = True
    process_group: Any = None
    replace: bool = True
    frames: int | None = None
    tile_frames: int | None = None
    frame_overlap: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "regions", tuple(self.regions or ()))  # a list or None given: a tuple kept
        check_count("steps", self.steps, 1, MAX_STEPS, "schedulers are trained on 1000 timesteps")


@dataclass
class GenerateResult:
    """What a generation did: output path or image tensor (None for a video, streamed), timings, tile counts,
    the VAE plan."""

    out: str | None
    image: Any
    seconds: dict[str, float] = field(default_factory=dict)
    unet_tiles_per_call: int = 0
    vae_plan: Any = None


@dataclass(frozen=True)
class VaeFileOptions:
    """A file job of the tiled VAE (`decode_file`, `encode_file`): the input and output paths and the tiling.

    `source` is the latents .safetensors to decode or the image (a 3-D VAE: or video) to encode; `bits` is
    the decoded image's depth (decode only); `budget` (e.g. "2GiB") picks tile and staging; with
    `process_group` every rank runs its tiles and rank 0 writes `out`. `sigma_data`: a Cosmos pipeline's
    scheduler's (`pipelines.video_latents`); `frames_per_call`: SVD's decode_chunk_size (decode only)."""

    source: str
    out: str
    tile_size: int = 32
    mode: str = "exact"
    budget: str | None = None
    staging: str = "auto"
    bits: int = 8
    progress: bool = True
    process_group: Any = None
    replace: bool = True
    sigma_data: float | None = None
    frames_per_call: int | None = None
