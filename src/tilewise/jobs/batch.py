"""Batch jobs with one model load: `generate` over a prompts file, `upscale` over a folder of images.

An item is one output file under DIR: a prompt line's image (`NNNNN.png`, its line number) or an input
image's upscale (its path under the input folder, suffix .png). Resumable: an item whose output is there
is kept (outputs are written under a temporary name, renamed when complete). One item's failure (a line
that does not parse, a size the model refuses, an unreadable image) is reported with its reason and the
rest go on; an out-of-memory error or an interrupt ends the job (never swallowed). The same items run on
a Ray cluster through `jobs.ray_runner`; `Runner` is what each process (or Ray worker) holds: the model,
loaded once, and how to make one item.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import BadInputFile, BadRequest
from .devices import worker_device
from .readers import IMAGE_SUFFIXES

logger = logging.getLogger(__name__)

PROMPT_KEYS = ("prompt", "width", "height", "seed", "negative", "regions", "steps", "guidance")
OVERRIDES = ("width", "height", "seed", "negative", "steps", "guidance")  # a line's keys over the options


@dataclass(frozen=True)
class BatchItem:
    """One output of a batch job: its file name under DIR, what makes it, or why it cannot be made."""

    name: str
    spec: dict = field(default_factory=dict)
    error: str | None = None


def _prompt_spec(line: str, number: int) -> dict[str, Any]:
    """A prompts-file line as the options it sets: plain text is the prompt; '{...}' is JSON."""
    from ..pipelines import parse_region

    if not line.lstrip().startswith("{"):
        return {"prompt": line.strip()}
    try:
        spec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {number} starts with '{{' but is not JSON: {e}") from None
    unknown = sorted(set(spec) - set(PROMPT_KEYS))
    if not isinstance(spec.get("prompt"), str) or unknown:
        raise ValueError(f"line {number} needs a \"prompt\" string and only the keys {PROMPT_KEYS}"
                         + (f"; unknown: {unknown}" if unknown else ""))
    for k in ("width", "height", "seed", "steps"):
        if k in spec and (isinstance(spec[k], bool) or not isinstance(spec[k], int)):
            raise ValueError(f"line {number}: {k} must be an integer, got {spec[k]!r}")
    spec["regions"] = [r if isinstance(r, str) else f"{','.join(map(str, r[0]))}:{r[1]}"
                       for r in spec.get("regions", [])]
    for r in spec["regions"]:
        parse_region(r)
    return spec


def read_prompts(path: str | os.PathLike) -> list[BatchItem]:
    """The items of a prompts file: one per non-blank line (a prompt, or JSON with prompt / width /
    height / seed / negative / regions / steps / guidance), named by line number; a line that does not
    parse is an item with its error."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BadRequest(f"--prompts {os.fspath(path)!r} cannot be read: {e}") from e
    items = []
    for n, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            items.append(BatchItem(f"{n:05d}.png", _prompt_spec(line, n)))
        except ValueError as e:
            items.append(BatchItem(f"{n:05d}.png", {}, str(e)))
    if not items:
        raise BadRequest(f"--prompts {os.fspath(path)!r} has no prompt line")
    return items


def image_items(folder: str | os.PathLike) -> list[BatchItem]:
    """The images under a folder (recursive, by suffix), each to its relative path with suffix .png."""
    root = Path(folder)
    paths = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()
                   and not p.name.startswith("."))
    if not paths:
        kinds = ", ".join(IMAGE_SUFFIXES)
        raise BadInputFile(f"{os.fspath(folder)!r} is a folder with no images in it ({kinds}); give an "
                           "image, or a folder of images")
    return [BatchItem(p.relative_to(root).with_suffix(".png").as_posix(), {"source": str(p)}) for p in paths]


@dataclass
class BatchResult:
    """What a batch job did: outputs made now, kept from before, and failed ones with their reasons."""

    done: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> str:
        n = len(self.done) + len(self.kept) + len(self.failed)
        lines = [f"{n} items: {len(self.done)} made, {len(self.kept)} kept from a previous run, "
                 f"{len(self.failed)} failed, {self.seconds:.1f}s"]
        lines += [f"  failed {k}: {v}" for k, v in self.failed.items()]
        return "\n".join(lines)


def _fatal(e: BaseException) -> bool:
    """Errors that end the job instead of one item: out of memory (never swallowed), not Exceptions."""
    return not isinstance(e, Exception) or isinstance(e, MemoryError) or type(e).__name__ in (
        "OutOfMemoryError", "WontFit")


def run_item(runner: Callable[[BatchItem, str], None], item: BatchItem, out_dir: str | os.PathLike) -> dict:
    """Make one item unless its output is there; {name, status: made | kept | failed, error}."""
    target = Path(out_dir) / item.name
    if target.exists():
        return {"name": item.name, "status": "kept", "error": None}
    if item.error is not None:
        return {"name": item.name, "status": "failed", "error": item.error}
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        runner(item, str(target))
    except BaseException as e:
        if _fatal(e):
            raise
        logger.warning("%s failed: %s", item.name, e)
        return {"name": item.name, "status": "failed", "error": f"{type(e).__name__}: {e}"}
    return {"name": item.name, "status": "made", "error": None}


def collect(rows: Sequence[dict], seconds: float) -> BatchResult:
    """A BatchResult from run_item's rows."""
    out = BatchResult(seconds=seconds)
    for r in sorted(rows, key=lambda r: r["name"]):
        {"made": out.done, "kept": out.kept}.get(r["status"], []).append(r["name"])
        if r["status"] == "failed":
            out.failed[r["name"]] = r["error"]
    return out


def run_batch(factory: Callable[[], Callable[[BatchItem, str], None]], items: Sequence[BatchItem],
              out_dir: str | os.PathLike, progress: bool = True) -> BatchResult:
    """Every item in this process, one progress bar over the items (each item's own bars inside it).
    `factory` builds the runner (loads the model) once, when the first item needs it."""
    from tqdm.auto import tqdm

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows, made = [], []

    def runner(item: BatchItem, target: str) -> None:
        if not made:
            made.append(factory())
        made[0](item, target)

    bar = tqdm(items, desc="items", unit="item", disable=not progress)
    for item in bar:
        rows.append(run_item(runner, item, out_dir))
        bar.set_postfix(failed=sum(r["status"] == "failed" for r in rows))
    return collect(rows, time.perf_counter() - t0)


# ---- runners: the model loaded once, one item made per call ---------------------------------------------
@dataclass(frozen=True)
class RunnerFactory:
    """What a process needs to build its Runner: the job kind ('generate', 'upscale', 'encode') and its
    settings as JSON (picklable and hashable, so that a Ray worker builds one per process)."""

    kind: str
    config: str  # JSON

    def __call__(self) -> Callable[[BatchItem, str], None]:
        return make_runner(self.kind, json.loads(self.config))


def make_runner(kind: str, config: dict[str, Any]) -> Callable[[BatchItem, str], None]:
    """The runner of a job kind from its settings (the model loaded here, once)."""
    if kind == "generate":
        return GenerateRunner.from_config(config)
    if kind == "upscale":
        return UpscaleRunner.from_config(config)
    if kind == "encode":
        from .cache import ShardRunner

        return ShardRunner.from_config(config)
    raise ValueError(f"job kind must be 'generate', 'upscale' or 'encode', got {kind!r}")


def _load(config: dict[str, Any]):
    from ..pipelines import load_pipeline

    return load_pipeline(config.get("model"), config=config.get("config"),
                         device=worker_device(config.get("device")), dtype=config.get("dtype", "float32"),
                         scheduler=config.get("scheduler", "ddim"))


class GenerateRunner:
    """A loaded pipeline and the base options; an item's prompt, size, seed, regions override them."""

    def __init__(self, loaded: Any, base: Any):
        self.loaded, self.base = loaded, base

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GenerateRunner:
        from ..pipelines import GenerateOptions

        options = {"width": 512, "height": 512, **config.get("options", {})}
        return cls(_load(config), GenerateOptions(prompt="", **options))

    def __call__(self, item: BatchItem, target: str) -> None:
        from ..pipelines import parse_region, run_generate

        s = item.spec
        o = replace(self.base, prompt=s["prompt"], out=target,
                    regions=tuple(parse_region(r) for r in s.get("regions", ())),
                    **{k: s[k] for k in OVERRIDES if k in s})
        run_generate(self.loaded, o)


class UpscaleRunner:
    """A loaded pipeline, the upscale options and the prompt's embeddings; an item is an input image."""

    def __init__(self, loaded: Any, options: Any, prompt: str = "", guidance: float = 5.0):
        self.loaded, self.options, self.guidance = loaded, options, guidance
        self.cond = loaded.encode(prompt, "")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> UpscaleRunner:
        from ..diffusion import UpscaleOptions

        return cls(_load(config), UpscaleOptions(**config.get("options", {})), config.get("prompt", ""),
                   config.get("guidance", 5.0))

    def __call__(self, item: BatchItem, target: str) -> None:
        from ..diffusion import run_upscale
        from ..sinks import open_sink
        from ..sources import read_image

        src = read_image(item.spec["source"])
        result = run_upscale(self.loaded.pipe, src.tensor((0.0, 1.0)), self.options,
                             guidance_scale=self.guidance, **self.cond)
        h, w = result.shape[-2:]
        with open_sink(target, h, w, 3, bits=src.bits, value_range=(0.0, 1.0)) as sink:
            sink.write(0, 0, result)
