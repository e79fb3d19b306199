"""Memory accounting: byte budgets, tensor sizes and measured peaks (CUDA allocator, CPU resident set).

Measuring on the CPU uses the kernel's own peak: the resident-set high-water mark (``VmHWM`` in
``/proc/self/status``) is reset before the call by writing ``5`` to ``/proc/self/clear_refs``
(Linux >= 4.0) and read after it. Where that reset is not allowed, a background thread samples the
resident set from ``/proc/self/statm`` every ``interval`` seconds (default 1 ms) and the largest sample
is used; a spike shorter than the interval can then be missed. Benchmarks should prefer
:func:`peak_rss_subprocess`, which measures a fresh process and so is not disturbed by what earlier code
left allocated.

torch (~2 s) and numpy are imported inside the functions that use them: `import tilewise.memory` imports
neither (tests/test_memory.py checks torch); `resource` (Unix only) is imported only where /proc is absent.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_UNIT_NAMES = "B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024)"
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

# dtype names numpy does not know (or spells differently) -> bytes per element
_EXTRA_ITEMSIZE: dict[str, int] = {"bfloat16": 2, "bf16": 2, "fp16": 2, "half": 2, "fp32": 4, "fp64": 8}


def parse_bytes(value: int | float | str) -> int:
    """Parse a byte count: an int, or text such as ``"2GiB"``, ``"512MB"``, ``"1.5 GiB"``, ``"1024"``."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"byte count must be an int or a string such as '2GiB', got {value!r}")
    if isinstance(value, int | float):
        number, unit = float(value), "b"
    else:
        match = _BYTES_RE.match(value)
        if match is None:
            raise ValueError(f"cannot parse byte count {value!r}: expected a number and a unit, one of "
                             f"{_UNIT_NAMES}, e.g. '2GiB' or '512MB'")
        number, unit = float(match.group(1)), (match.group(2).lower() or "b")
        if unit not in _UNITS:
            raise ValueError(f"unknown unit {match.group(2)!r} in byte count {value!r}; valid units: "
                             f"{_UNIT_NAMES}")
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"byte count must be finite and >= 0, got {value!r}")
    return int(round(number * _UNITS[unit]))


def format_bytes(n: int | float) -> str:
    """Format a byte count with binary units: ``512 B``, ``1.50 KiB``, ``2.00 GiB``."""
    if isinstance(n, bool) or not isinstance(n, int | float) or not math.isfinite(n):
        raise ValueError(f"byte count must be a finite number, got {n!r}")
    sign, n = ("-" if n < 0 else ""), abs(n)
    if n < 1024:
        return f"{sign}{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1024 or unit == "PiB":
            return f"{sign}{n:.2f} {unit}"
    raise AssertionError("unreachable")


def dtype_itemsize(dtype: Any) -> int:
    """Bytes per element of a torch dtype, numpy dtype or dtype name (``"float16"``, ``"bf16"``)."""
    itemsize = getattr(dtype, "itemsize", None)  # torch.dtype (>= 2.1) and numpy.dtype
    if isinstance(itemsize, int) and not isinstance(dtype, type):
        return itemsize
    name = str(dtype).removeprefix("torch.")
    if name in _EXTRA_ITEMSIZE:
        return _EXTRA_ITEMSIZE[name]
    import numpy as np

    try:
        return np.dtype(dtype if isinstance(dtype, type) else name).itemsize
    except TypeError as err:
        raise ValueError(f"unknown dtype {dtype!r}: use a torch or numpy dtype or a name such as "
                         f"'float32', 'float16', 'bfloat16', 'uint8'") from err


def tensor_bytes(shape: Sequence[int], dtype: Any = "float32") -> int:
    """Bytes of a dense tensor: prod(shape) * itemsize(dtype)."""
    dims = tuple(shape)
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
        raise ValueError(f"shape must be a sequence of non-negative ints, got {shape!r}")
    return math.prod(dims) * dtype_itemsize(dtype)


# --------------------------------------------------------------------------------------------------
# CPU resident set


def _page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def current_rss() -> int:
    """Resident set size of this process in bytes (``/proc/self/statm``; ru_maxrss where absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _page_size()
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_rss() -> int | None:
    """Resident-set high-water mark of this process in bytes (``VmHWM``), None where unavailable."""
    return _status_kib("VmHWM")


def reset_peak_rss() -> bool:
    """Reset the kernel's resident-set high-water mark (``echo 5 > /proc/self/clear_refs``); True if done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class _RSSSampler(threading.Thread):
    """Background thread that records the largest resident set seen every ``interval`` seconds."""

    def __init__(self, interval: float):
        super().__init__(daemon=True, name="tilewise-rss-sampler")
        self.interval = interval
        self.peak = current_rss()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.peak = max(self.peak, current_rss())

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, current_rss())
        return self.peak


def _cuda_device(device: Any) -> Any | None:
    """The torch.device if ``device`` names a CUDA device, else None (CPU measurement)."""
    if device is None:
        return None
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise ValueError(f"measure_peak supports device None/'cpu' (resident set) or 'cuda', got {device}")
    return device


class MemoryMeter:
    """Context manager measuring peak memory growth: CUDA max allocated, or CPU peak resident set.

    ``peak_bytes`` is the peak during the block minus what was in use when it started (CUDA:
    ``memory_allocated``; CPU: resident set). ``baseline_bytes`` is that starting value.
    """

    def __init__(self, device: Any = None, interval: float = 0.001):
        if not interval > 0:
            raise ValueError(f"sampling interval must be > 0 seconds, got {interval!r}")
        self.device = _cuda_device(device)
        self.interval = interval
        self.baseline_bytes = 0
        self.peak_bytes = 0
        self.method = ""

    def __enter__(self) -> MemoryMeter:
        if self.device is not None:
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline_bytes = torch.cuda.memory_allocated(self.device)
            self.method = "cuda max_memory_allocated"
            return self
        self.baseline_bytes = current_rss()
        self._hwm = reset_peak_rss() and peak_rss() is not None
        self.method = "VmHWM reset via clear_refs" if self._hwm else f"statm sampled every {self.interval}s"
        self._sampler = _RSSSampler(self.interval)
        self._sampler.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device is not None:
            import torch

            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = self._sampler.stop()
            if self._hwm:
                peak = max(peak, peak_rss() or 0)
        self.peak_bytes = max(0, peak - self.baseline_bytes)


def measure_peak(fn: Callable[..., Any], *args: Any, device: Any = None, interval: float = 0.001,
                 **kwargs: Any) -> tuple[Any, int]:
    """Run ``fn(*args, **kwargs)`` and return ``(result, peak_bytes)``: the peak memory growth it caused."""
    with MemoryMeter(device, interval=interval) as meter:
        result = fn(*args, **kwargs)
    logger.debug("measure_peak(%s): %s (%s)", getattr(fn, "__name__", fn), format_bytes(meter.peak_bytes),
                 meter.method)
    return result, meter.peak_bytes


def measure_live_peak(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """Run ``fn(*args, **kwargs)`` and return ``(result, peak_bytes)``: the peak of the tensor storages it
    created that were alive at once (every operator's new outputs, autograd's backward included, from birth
    to release), whatever the allocator caches: the same on any machine."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    live: dict[int, int] = {}
    peak = [0, 0]  # now, peak

    def release(key: int) -> None:
        peak[0] -= live.pop(key)

    class Live(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(r.alias_info is not None for r in func._schema.returns):
                return out  # a view or an in-place result: no new storage
            for t in out if isinstance(out, (tuple, list)) else (out,):
                storage = t.untyped_storage() if hasattr(t, "untyped_storage") else None
                if storage is not None and storage._cdata not in live:
                    live[storage._cdata] = storage.nbytes()
                    peak[0] += storage.nbytes()
                    peak[1] = max(peak)
                    weakref.finalize(storage, release, storage._cdata)
            return out

    with Live():
        result = fn(*args, **kwargs)
    return result, peak[1]


# --------------------------------------------------------------------------------------------------
# fresh subprocess


@dataclass(frozen=True)
class SubprocessPeak:
    """Peak resident memory of a child process (bytes); baseline is the resident set after ``setup``."""

    peak_bytes: int
    baseline_bytes: int | None
    growth_bytes: int | None
    returncode: int
    result: Any
    wall_s: float
    stdout: str
    stderr: str


_BOOTSTRAP = r"""
import json, os, sys, time
def _status(field):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(field + ':'):
                return int(line.split()[1]) * 1024
_spec = json.loads(sys.argv[1])
sys.path[:0] = _spec['sys_path']
_ns = {'__name__': '__tilewise_peak__'}
if _spec['setup']:
    exec(compile(_spec['setup'], '<setup>', 'exec'), _ns)
if _spec['target']:
    import importlib
    _mod, _, _qual = _spec['target'].partition(':')
    _fn = importlib.import_module(_mod)
    for _part in _qual.split('.'):
        _fn = getattr(_fn, _part)
_baseline = _status('VmRSS')
try:
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    _reset = True
except OSError:
    _reset = False
_t0 = time.perf_counter()
if _spec['target']:
    _result = _fn(*_spec['args'], **_spec['kwargs'])
else:
    exec(compile(_spec['code'], '<code>', 'exec'), _ns)
    _result = _ns.get('result')
_wall = time.perf_counter() - _t0
_report = {'baseline': _baseline, 'hwm': _status('VmHWM'), 'reset': _reset, 'wall': _wall,
           'result': _result}
with open(_spec['report'], 'w') as f:
    json.dump(_report, f, default=repr)
"""


def _target_spec(target: str | Callable[..., Any]) -> str:
    """``"module:qualname"`` for a callable or a spec string; raises ValueError for anything else."""
    if callable(target):
        module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
        if not module or module == "__main__" or "<" in qualname:
            raise ValueError(f"callable {target!r} is not importable by a fresh process (module {module!r}, "
                             f"qualname {qualname!r}); define it at module level in an importable module")
        return f"{module}:{qualname}"
    if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", target):
        raise ValueError(f"target must be 'package.module:function', a command list or a callable, "
                         f"got {target!r}")
    return target


_RUSAGE_WRAPPER = r"""
import json, os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
with open(sys.argv[1], 'w') as f:
    json.dump({'maxrss': usage.ru_maxrss * 1024, 'status': os.waitstatus_to_exitcode(status)}, f)
sys.exit(os.waitstatus_to_exitcode(status) & 255)
"""


def peak_rss_subprocess(target: str | Sequence[str] | Callable[..., Any] | None = None, *,
                        args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                        code: str | None = None, setup: str | None = None,
                        sys_path: Sequence[str] = (), env: dict[str, str] | None = None,
                        timeout: float | None = None, check: bool = True) -> SubprocessPeak:
    """Peak resident memory of work run in a fresh Python process (``ru_maxrss`` via ``os.wait4``).

    ``target`` is a command list (run as is; no baseline), a ``"module:function"`` string or an
    importable callable called with JSON-able ``args``/``kwargs``; or give ``code`` (Python source; its
    global ``result`` is returned). ``setup`` runs first (imports, building inputs); the resident set
    after it is the baseline, and the high-water mark is reset there (``clear_refs``) where allowed, so
    ``growth_bytes`` = peak after setup - baseline. ``peak_bytes`` is the whole child's ``ru_maxrss``.
    """
    if (target is None) == (code is None):
        raise ValueError(f"give exactly one of target or code, got target={target!r}, code={code!r}")
    with tempfile.TemporaryDirectory(prefix="tilewise-peak-") as tmp:
        usage_path, report_path = os.path.join(tmp, "usage.json"), os.path.join(tmp, "report.json")
        if target is not None and not isinstance(target, str) and not callable(target):
            command, report_path = [str(c) for c in target], None
            if not command:
                raise ValueError("command list is empty")
        else:
            spec = {"target": None if code is not None else _target_spec(target), "code": code,
                    "setup": setup, "args": list(args), "kwargs": dict(kwargs or {}),
                    "sys_path": [os.fspath(p) for p in sys_path], "report": report_path}
            command = [sys.executable, "-c", _BOOTSTRAP, json.dumps(spec)]
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _RUSAGE_WRAPPER, usage_path, *command],
                              capture_output=True, text=True, env=env, timeout=timeout)
        wall = time.perf_counter() - t0
        if check and proc.returncode != 0:
            raise RuntimeError(f"subprocess failed with exit code {proc.returncode}: {command[:3]}...\n"
                               f"stderr:\n{proc.stderr[-4000:]}")
        with open(usage_path) as f:
            usage = json.load(f)
        report = None
        if report_path is not None and os.path.exists(report_path):
            with open(report_path) as f:
                report = json.load(f)
    if report is None:
        return SubprocessPeak(usage["maxrss"], None, None, proc.returncode, None, wall, proc.stdout,
                              proc.stderr)
    baseline = report["baseline"]
    peak_after = report["hwm"] if report["reset"] else usage["maxrss"]
    return SubprocessPeak(usage["maxrss"], baseline, max(0, peak_after - baseline), proc.returncode,
                          report["result"], report["wall"], proc.stdout, proc.stderr)
