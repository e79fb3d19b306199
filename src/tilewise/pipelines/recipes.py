"""The recipes the CLI calls: `generate` (tiled denoise, then tiled decode), `decode_file`, `encode_file`.

Each has a keyword form (its options as arguments) and a `run_*` form that takes the options as one record
(`pipelines.options`), written as numbered steps that call the helpers below. torch, safetensors and the
layers that import torch (`tilewise.vae`, `tilewise.diffusion`) are imported inside the functions that use
them: the CLI reads this package (`parse_region`, `vae_class`) in its checks, before any model loads, and
importing torch and the VAE engine there would delay each refusal by seconds.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import Any

from ..atomic import atomic_path
from ..distributed import rank_world, resolve_group
from ..errors import BadInputFile, BadRequest, WontFit
from ..locality.video_classes import is_video_vae
from ..sinks import open_sink
from ..sources import read_image
from .denoise import denoise, tiled_denoiser
from .fits import check_generate_fits, check_image_output, check_latents_output
from .generate_video import frames_arg, run_generate_video
from .image_latents import as_input, encoded, from_file, latent_scale, patch, to_file
from .image_latents import read as read_file_latents
from .loading import Loaded
from .options import GenerateOptions, GenerateResult, VaeFileOptions
from .video import decode_video_file, encode_video_file, tiled_vae
from .video_latents import SVD

logger = logging.getLogger(__name__)


def parse_region(text: str) -> tuple[tuple[int, int, int, int], str]:
    """'x0,y0,x1,y1:prompt' -> ((x0, y0, x1, y1), prompt) in pixels."""
    box, sep, prompt = text.partition(":")
    try:
        coords = tuple(int(v) for v in box.split(","))
    except ValueError:
        coords = ()
    if not sep or len(coords) != 4 or not prompt.strip():
        raise ValueError(
            f"region {text!r} must look like 'x0,y0,x1,y1:prompt' (pixels, e.g. '0,0,512,512:brick')"
        )
    return coords, prompt.strip()  # type: ignore[return-value]


def generate(
    loaded: Loaded,
    prompt: str,
    width: int,
    height: int,
    *,
    negative: str = "",
    regions: list[tuple[tuple[int, int, int, int], str]] | None = None,
    method: str = "mixture",
    tile_size: int = 16,
    overlap: int = 4,
    batch_size: int | None = None,
    steps: int = 20,
    seed: int = 0,
    guidance: float = 5.0,
    vae_tile: int = 32,
    vae_mode: str = "exact",
    out: str | None = None,
    bits: int = 8,
    progress: bool = True,
    process_group: Any = None,
    replace: bool = True,
    frames: int | None = None,
    tile_frames: int | None = None,
    frame_overlap: int = 0,
) -> GenerateResult:
    """Text to image at any size: tiled denoising (TiledDenoiser) then tiled decoding (TiledVAE).

    With `process_group` ("default" under torchrun) the tiles of both stages are split over the ranks;
    every rank calls this, rank 0 writes `out`. Before anything runs, `out` is checked (suffix, folder,
    replace=False: must not exist) and the full-size buffers of denoising and decoding are estimated
    against the memory (and staging disk) there is (`WontFit` with the figure otherwise). A video
    pipeline (`frames`: Wan 2.x, ...) generates a video to a frame pattern or stack (`generate_video`).
    The options are those of `GenerateOptions`; `run_generate` takes them as that record.
    """
    options = GenerateOptions(
        prompt, width, height, negative=negative, regions=regions, method=method, tile_size=tile_size,
        overlap=overlap, batch_size=batch_size, steps=steps, seed=seed, guidance=guidance,
        vae_tile=vae_tile, vae_mode=vae_mode, out=out, bits=bits, progress=progress,
        process_group=process_group, replace=replace, frames=frames, tile_frames=tile_frames,
        frame_overlap=frame_overlap,
    )
    return run_generate(loaded, options)


def run_generate(loaded: Loaded, options: GenerateOptions) -> GenerateResult:
    """`generate` with its options as one record (the CLI's form), in the steps of a pipeline's __call__."""
    from ..vae import TiledVAE  # (lazy: torch and the layers that import it, see the module docstring)

    o = options
    if o.frames is not None or frames_arg(loaded.pipe) is not None:  # a video pipeline: text to video
        return run_generate_video(loaded, o)
    pipe, attr = loaded.pipe, loaded.denoiser  # "unet", or "transformer" (SD3, Flux, ...)
    f = int(getattr(pipe, "vae_scale_factor", 8))
    # 1. check the request (size, output, regions) and that the full-size buffers fit, before any work
    _check_request(o, f if attr == "unet" else 2 * f)  # transformers take whole 2x2 latent patches
    check_generate_fits(getattr(pipe, attr), o.width, o.height, f, len(o.regions))
    tv = TiledVAE(pipe.vae, tile_size=o.vae_tile, mode=o.vae_mode, progress=o.progress,
                  process_group=o.process_group)
    zshape = (1, int(pipe.vae.config.latent_channels), o.height // f, o.width // f)
    try:  # its staging against the memory and disk there are
        tv.preflight(zshape, streamed=o.out is not None)
    except WontFit as e:
        raise WontFit(f"generate {o.width}x{o.height}: the decode of its latents {zshape}: {e}") from e
    # 2. encode the prompt and the regions' prompts
    cond = loaded.encode(o.prompt, o.negative)
    regions = _region_embeds(loaded, o.regions, o.negative)
    # 3. tile the denoiser
    denoiser = tiled_denoiser(loaded, o, regions, f)
    tiles = denoiser.count(o.height // f, o.width // f)
    logger.info("generate %dx%d: %s over %d %s tiles of %d latent px per call, %d steps", o.width, o.height,
                o.method, tiles, type(getattr(pipe, attr)).__name__, o.tile_size, o.steps)
    # 4. denoise with the pipeline's own loop, its denoiser swapped for the tiled one
    t0 = time.perf_counter()
    latents = denoise(pipe, {attr: denoiser}, o, **cond).images
    seconds = {"denoise": time.perf_counter() - t0}
    # 5. decode: streamed to `out` (rank 0 writes), or in memory
    z = _vae_latents(pipe, latents, o.height, o.width, f)
    plan = tv.plan(tuple(z.shape))
    t0 = time.perf_counter()
    image = _decode_out(tv, z, o.out, o.bits, o.replace)
    seconds["decode"] = time.perf_counter() - t0
    return GenerateResult(out=o.out, image=image, seconds=seconds, unet_tiles_per_call=tiles, vae_plan=plan)


def _check_request(o: GenerateOptions, m: int) -> None:
    """The size (positive multiples of `m` pixels), the output, and every region's box inside the image."""
    if o.width <= 0 or o.height <= 0 or o.width % m or o.height % m:
        raise ValueError(
            f"width and height have to be positive multiples of {m} but are {o.width} and {o.height}"
        )
    check_image_output(o.out, o.bits, o.replace)
    for box, _ in o.regions:
        check_region(box, o.width, o.height)


def check_region(box: tuple[int, int, int, int], width: int, height: int) -> None:
    """A region box (x0, y0, x1, y1) in pixels: not empty, not inverted, inside the width x height image."""
    x0, y0, x1, y1 = box
    if x1 <= x0 or y1 <= y0:
        axis = "x0 < x1" if x1 <= x0 else "y0 < y1"
        what = "empty" if (x1 == x0 or y1 == y0) else "inverted"
        raise BadRequest(f"region box {tuple(box)} is {what}: it needs {axis} (x0,y0 top left, x1,y1 bottom "
                         "right, in pixels)")
    if not (0 <= x0 and x1 <= width and 0 <= y0 and y1 <= height):
        raise BadRequest(f"region box {tuple(box)} lies outside the {width}x{height} image: it needs "
                         f"0 <= x0 < x1 <= {width} and 0 <= y0 < y1 <= {height}")


def _region_embeds(loaded: Loaded, regions, negative: str) -> list:
    """Each (box, prompt) as a `Region` with its own prompt embeddings (and pooled ones, where there are)."""
    from ..diffusion import Region  # (lazy: torch, see the module docstring)

    out = []
    for box, text in regions:
        emb = loaded.region_embeds(text, negative)
        out.append(Region(box=box, prompt_embeds=emb["prompt_embeds"],
                          pooled_prompt_embeds=emb.get("pooled_prompt_embeds")))
    return out


def _vae_latents(pipe, latents, height: int, width: int, f: int):
    """The pipeline's latents as the VAE decodes them: Flux's packed tokens unpacked, scale, shift undone."""
    if latents.ndim == 3 and hasattr(pipe, "_unpack_latents"):  # Flux: packed 2x2 patch tokens
        latents = pipe._unpack_latents(latents, height, width, f)
    sf, shift = latent_scale(pipe.vae)
    return latents / sf + shift


def _decode_out(tv, z, out: str | None, bits: int, replace: bool = True):
    """Decode to a file sink (streamed, atomic) or to memory; returns the image tensor when in memory."""
    if out is None:
        return tv.decode(z).sample
    if not _writes(tv):  # rank 0 writes; this rank sends its rows
        tv.decode_to(z, None)
        return None
    f, p = tv.factor("decode"), tv.program("decode")
    with open_sink(out, z.shape[-2] * f, z.shape[-1] * f, p.channels()[p.output], bits=bits,
                   replace=replace) as sink:
        tv.decode_to(z, sink)
    logger.info("wrote %s", out)
    return None


def _writes(tv) -> bool:
    """Whether this process writes output files: single process, or rank 0 of the TiledVAE's group."""
    return rank_world(resolve_group(tv.process_group))[0] == 0


def vae_factor(vae) -> int:
    """Pixels per latent pixel of an AutoencoderKL-style VAE (8 for SD): 2 ** (blocks - 1)."""
    return int(2 ** (len(vae.config.block_out_channels) - 1))


def decode_file(
    loaded: Loaded | Any,
    latents_path: str,
    out: str,
    *,
    tile_size: int = 32,
    mode: str = "exact",
    budget: str | None = None,
    staging: str = "auto",
    bits: int = 8,
    progress: bool = True,
    process_group: Any = None,
    replace: bool = True,
    sigma_data: float | None = None,
    frames_per_call: int | None = None,
):
    """Decode a latents .safetensors (key 'latents', in the layout the VAE family's pipeline hands its
    denoiser: `pipelines.image_latents`) to an image file; `loaded` is a pipeline or a VAE. A video VAE
    (Qwen-Image, Wan, LTX-Video, Cosmos, SVD, ...) decodes (B, C, T, H, W) latents to an image or a video
    sink (`pipelines.video`; Cosmos' `sigma_data`, SVD's `frames_per_call`: `pipelines.video_latents`).

    The output and the latents file (header, shape, dtype, channels, values) are checked first. The
    options are those of `VaeFileOptions`; `run_decode_file` takes them as that record."""
    return run_decode_file(loaded, VaeFileOptions(
        latents_path, out, tile_size=tile_size, mode=mode, budget=budget, staging=staging, bits=bits,
        progress=progress, process_group=process_group, replace=replace, sigma_data=sigma_data,
        frames_per_call=frames_per_call,
    ))


def run_decode_file(loaded: Loaded | Any, options: VaeFileOptions):
    """`decode_file` with its options as one record (the CLI's form); returns the VAE's plan."""
    o = options
    vae = _vae(loaded)
    # 1. a video VAE decodes to an image or a video (each rank its band of tile rows, rank 0 writes)
    if is_video_vae(vae) or type(vae).__name__ == SVD:
        return decode_video_file(vae, o.source, o.out, tile_size=o.tile_size, mode=o.mode, budget=o.budget,
                                 staging=o.staging, bits=o.bits, progress=o.progress, replace=o.replace,
                                 process_group=o.process_group, sigma_data=o.sigma_data,
                                 frames_per_call=o.frames_per_call)
    if o.frames_per_call is not None:
        raise BadRequest(f"--decode-chunk-size applies to SVD's temporal decoder ({SVD}), not to a "
                         f"{type(vae).__name__}")
    # 2. check the output, read the latents in the family's layout (checked as they are read, `image_latents`)
    check_image_output(o.out, o.bits, o.replace)
    z = from_file(vae, read_file_latents(vae, o.source))
    tv = _tiled_vae(vae, o)  # (a class no tile program reproduces is refused here, with the reason)
    # 3. plan and decode the raw latents, streamed to the output
    plan = tv.plan(tuple(z.shape))
    _decode_out(tv, z, o.out, o.bits, o.replace)
    return plan


def _tiled_vae(vae, o: VaeFileOptions):
    """A TiledVAE over `vae` with a file job's tiling, budget, staging and process group (`tiled_vae`:
    ModelProblem where its family refuses the VAE's configuration)."""
    return tiled_vae(vae, tile_size=o.tile_size, mode=o.mode, memory_budget=o.budget, staging=o.staging,
                     progress=o.progress, process_group=o.process_group)


def load_image(path: str, multiple: int = 8, channels: int = 3):
    """An image file as a (1, 3, H, W) float tensor in [-1, 1], read at its depth (`tilewise.sources`);
    sides must be multiples of `multiple`. channels=4 (an RGBA VAE: Qwen-Image 2.1): (1, 4, H, W), its
    alpha last (opaque where the file has none)."""
    if channels not in (3, 4):
        raise BadRequest(f"the VAE encodes {channels}-channel images; tilewise reads images as RGB (3) or "
                         "RGBA (4)")
    pic = read_image(path, alpha=channels == 4)
    check_image_size(path, pic.width, pic.height, multiple)
    return pic.tensor((-1.0, 1.0), alpha=channels == 4)


def check_image_size(path: str, w: int, h: int, multiple: int) -> None:
    """An image to encode has sides that are multiples of the VAE's factor (BadInputFile otherwise)."""
    if h % multiple or w % multiple:
        raise BadInputFile(
            f"image {path!r} is {w}x{h}; both sides must be multiples of {multiple} to encode "
            f"(crop to {w - w % multiple or multiple}x{h - h % multiple or multiple} or pad)"
        )


def encode_file(
    loaded: Loaded | Any,
    image_path: str,
    out: str,
    *,
    tile_size: int = 32,
    mode: str = "exact",
    budget: str | None = None,
    staging: str = "auto",
    progress: bool = True,
    process_group: Any = None,
    replace: bool = True,
    sigma_data: float | None = None,
):
    """Encode an image file to a latents .safetensors (the raw latent of the VAE's output, e.g. the mean
    of its latent distribution, in its family's layout: `pipelines.image_latents`).

    With `process_group` every rank encodes its band of tiles and rank 0 writes the file. `loaded` is a
    pipeline or a VAE; a video VAE encodes an image or a video (`pipelines.frames`; Cosmos' `sigma_data`:
    `pipelines.video_latents`). The options are those of `VaeFileOptions` (its `bits` unused);
    `run_encode_file` takes them as that record."""
    return run_encode_file(loaded, VaeFileOptions(
        image_path, out, tile_size=tile_size, mode=mode, budget=budget, staging=staging, progress=progress,
        process_group=process_group, replace=replace, sigma_data=sigma_data,
    ))


def run_encode_file(loaded: Loaded | Any, options: VaeFileOptions):
    """`encode_file` with its options as one record (the CLI's form); returns the VAE's plan."""
    o = options
    # 1. check the output
    check_latents_output(o.out, o.replace)
    vae = _vae(loaded)
    # 2. a video VAE encodes an image or a video (each rank its band of tile rows, rank 0 writes)
    if is_video_vae(vae) or type(vae).__name__ == SVD:
        return encode_video_file(vae, o.source, o.out, tile_size=o.tile_size, mode=o.mode, budget=o.budget,
                                 staging=o.staging, progress=o.progress, replace=o.replace,
                                 process_group=o.process_group, sigma_data=o.sigma_data)
    # 3. read the image (RGBA for a 4-channel VAE), plan and encode: the raw latent of the family's output
    # (the distribution's mean, DC-AE's latent, VQModel's latents), in its latents file's layout
    tv = _tiled_vae(vae, o)
    x = load_image(o.source, tv.factor("encode") * patch(vae), int(vae.config.in_channels))
    x = as_input(vae, x).to(vae.device, vae.dtype)
    plan = tv.plan(tuple(x.shape), kind="encode")
    latents, metadata = to_file(vae, encoded(tv.encode(x)))
    # 4. rank 0 writes the file
    if _writes(tv):
        _save_latents(latents, o.out, metadata, o.replace)
    return plan


def _save_latents(latents, out: str, metadata: dict[str, str], replace: bool) -> None:
    """Write latents to a .safetensors file atomically, with how they are normalised as metadata."""
    from safetensors.torch import save_file  # (lazy: imports torch, see the module docstring)

    with atomic_path(out, replace=replace) as tmp:
        try:
            save_file({"latents": latents.cpu()}, str(tmp), metadata=metadata)
        except Exception as e:  # safetensors' errors name neither the file nor errno
            if "os error 28" in str(e) or "No space left" in str(e):
                raise OSError(errno.ENOSPC, "No space left on device", str(out)) from e
            raise


def _vae(loaded):
    """The VAE of a Loaded pipeline, or the VAE itself."""
    return loaded.pipe.vae if isinstance(loaded, Loaded) else loaded
