"""Will it fit? The memory and disk there are, and the checks that refuse a request before it starts.

A request whose buffers cannot fit is refused with `WontFit` naming what it would allocate, what is
there, and what would fit, instead of running until the kernel's out-of-memory killer ends it. The
figures: host memory is /proc/meminfo's MemAvailable plus free swap (what can be allocated without
killing anything), lowered to a cgroup's memory.max where one is set; a CUDA device's is its free memory
plus what torch's caching allocator holds unused; disk is the free space of the folder's file system.
Estimates are meant as lower bounds of what the work allocates, so a refusal is never a guess.
"""

from __future__ import annotations

import math
import os
import shutil
from typing import Any

from .errors import WontFit
from .memory import format_bytes

# denoising and inversion steps: diffusers' schedulers are trained on 1000 timesteps, and a step count past
# them only repeats timesteps while the run's memory and time grow with it
MAX_STEPS = 1000


def check_count(name: str, value: Any, low: int, high: int, what: str = "") -> int:
    """A count the user gives (steps, frames, ranks): an int in [low, high], else a ValueError naming it and
    the range (`what`: why the bound is there)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        why = f" ({what})" if what else ""
        raise ValueError(f"{name} must be an int in [{low}, {high}]{why}, got {value!r}")
    return value


def host_memory_available() -> int:
    """Bytes of host memory that can still be allocated: MemAvailable + SwapFree, within a cgroup limit."""
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    avail = info.get("MemAvailable", info.get("MemFree", 0)) + info.get("SwapFree", 0)
    if not avail:  # not Linux: physical memory as the bound
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (OSError, ValueError, AttributeError):
            return 1 << 62
    limit = _cgroup_room()
    return min(avail, limit) if limit is not None else avail


def _cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), None when there is no limit."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), None)
        if path is None:
            return None
        base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            top = f.read().strip()
        if top == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            return max(0, int(top) - int(f.read().strip()))
    except (OSError, ValueError, StopIteration):
        return None


def device_memory_available(device: Any = None) -> int:
    """Bytes that can still be allocated on `device`: host memory for the CPU (or None)."""
    import torch  # (lazy: the host-memory checks, e.g. TileGrid's, import this module without torch)

    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(0, unused))
    if device.type == "cpu":
        return host_memory_available()
    return 1 << 62  # mps, xpu, ...: no portable figure; their own allocator error names the shortage


def disk_free(folder: str | os.PathLike) -> int:
    """Free bytes on the file system of `folder` (its nearest existing parent)."""
    folder = os.path.abspath(os.fspath(folder))
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return shutil.disk_usage(folder).free


def check_memory(need: int, what: str, device: Any = None, hint: str = "") -> None:
    """Refuse (WontFit) when `need` bytes for `what` exceed the memory available on `device`."""
    avail = device_memory_available(device)
    if need > avail:
        where = "host" if device is None or str(device).startswith("cpu") else str(device)
        raise WontFit(f"{what} needs at least {format_bytes(need)} of {where} memory but "
                      f"{format_bytes(avail)} is available{'; ' + hint if hint else ''}")


def check_disk(need: int, folder: str | os.PathLike, what: str, hint: str = "") -> None:
    """Refuse (WontFit) when `need` bytes for `what` exceed the free space of `folder`'s file system."""
    free = disk_free(folder)
    if need > free:
        raise WontFit(f"{what} needs at least {format_bytes(need)} of disk in {os.fspath(folder)!r} but "
                      f"{format_bytes(free)} is free{'; ' + hint if hint else ''}")


def fitting_size(width: int, height: int, need: int, room: int, multiple: int = 8) -> tuple[int, int]:
    """The largest (width, height) of the same aspect, multiples of `multiple`, whose need (proportional
    to the area) fits `room` bytes."""
    s = math.sqrt(max(room, 0) / need) if need > 0 else 1.0
    return (max(multiple, int(width * s) // multiple * multiple),
            max(multiple, int(height * s) // multiple * multiple))


__all__ = ["check_disk", "check_memory", "device_memory_available", "disk_free", "fitting_size",
           "host_memory_available"]
