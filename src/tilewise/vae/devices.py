"""The devices a plan is shaped for, and the time model its estimate comes from.

A `DeviceProfile` says how the executor runs on a device kind and what its work costs:

- CPU (today's shape): convolutions in row bands that bound the im2col workspace (`conv_workspace`),
  big tiles of local segments in row bands (`band_bytes`), GroupNorm moments a small chunk at a time;
  these keep the resident set small and cost nothing on a CPU, where an operator is a function call.
- CUDA: every operator is a kernel launch, so nothing is split for cache or workspace reasons: no im2col
  bands, row bands only where the memory budget needs them (the planner decides), moments in one pass,
  tiles as big as the budget allows. Host staging uses pinned memory.

Estimated time (`seconds`, less `hidden` per segment), a stated model, not a measurement:
    compute   = FLOPs / flops (half or float32 throughput) + kernel launches x launch_s
    transfers = host<->device bytes / link_bytes_s
    time      = compute + transfers - hidden
    hidden    = per segment, min(its side-stream copies' time, its compute)
Host staging's device -> host copies and its reads of the next tile's inputs run on a side stream
(`copies.CudaLane`, contiguous copies through pinned blocks: one DMA each, holding neither the compute
stream nor the host) and overlap the compute of their segment; the other host -> device reads (the
first tile's, later row bands', keys and values) run on the compute stream (strided views: through
PyTorch's pageable temporaries) and are summed. The model leaves out the host's gathers and writes of
those pinned blocks (memory copies on the thread that launches the kernels), memory-bound kernel time
(GroupNorm, activations, copies read and write every byte once: at ~3 TB/s small beside the
convolutions) and cuDNN's choice of algorithm; `benchmarks/gpu.sh` measures the real times beside it
(not run on a GPU yet: the overlap is the model's, unmeasured).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

DEVICE_KINDS = ("cpu", "cuda")

# CPU plans: local segments whose tile holds more than this (three largest values) run in row bands of
# about this much (`run.bands`). Measured in-process at 1024 px, 32-latent tiles, disk staging: exact
# decode 121 s / 180 MiB peak growth with whole tiles, 115 s / 175 MiB in bands; fast decode's
# sampled-tile pass peak 325 -> 254 MiB.
BAND_BYTES = 32 << 20


@dataclass(frozen=True)
class DeviceProfile:
    """How plans are shaped for a device kind and what its work costs (see the module docstring)."""

    kind: str  # "cpu" or "cuda"
    name: str  # what the constants describe, printed with the plan
    flops: float  # sustained FLOP/s of convolutions in float16 / bfloat16
    flops_fp32: float  # ... in float32
    launch_s: float  # seconds per kernel launch (eager PyTorch: dispatch plus launch)
    link_bytes_s: float  # host<->device bytes per second, pinned memory, each direction (inf: shared)
    conv_workspace: int  # bytes of im2col workspace one convolution call may use (0: unbounded)
    band_bytes: int | None  # local segments' big tiles run in row bands of this (None: planner decides)
    stats_chunk: int  # bytes of one pass of GroupNorm moments (float32 rows at a time)
    host_memory: int | None = None  # host bytes host staging may use (None: this machine's available)

    def replace(self, **changes) -> DeviceProfile:
        """A copy with some constants changed, e.g. `CUDA.replace(launch_s=10e-6)`."""
        return dataclasses.replace(self, **changes)

    def seconds(self, flops: int, launches: int, transfer_bytes: int, half: bool) -> float:
        """Estimated time of the work (module docstring): compute plus launches plus transfers."""
        rate = self.flops if half else self.flops_fp32
        return flops / rate + launches * self.launch_s + transfer_bytes / self.link_bytes_s

    def hidden(self, flops: int, launches: int, side_bytes: int, half: bool) -> float:
        """Seconds of side-stream copies (`side_bytes`) that overlap compute of (flops, launches)."""
        rate = self.flops if half else self.flops_fp32
        return min(side_bytes / self.link_bytes_s, flops / rate + launches * self.launch_s)

    def host_bytes(self) -> int:
        """Host memory host staging may fill: host_memory, or what this machine has available now."""
        if self.host_memory is not None:
            return self.host_memory
        return available_memory()


# One current datacenter GPU: NVIDIA H100 SXM5 80 GB. Convolutions sustain about half of the dense
# tensor-core peak (989 TFLOP/s FP16/BF16, 495 TF32: cuDNN convolutions use TF32 for float32 by
# default); eager PyTorch spends ~5 us per operator (CPU dispatch plus launch; the GPU is idle in
# between when kernels are short); PCIe Gen5 x16 moves ~50 GB/s per direction from pinned memory.
CUDA = DeviceProfile("cuda", "NVIDIA H100 SXM 80GB (model constants)", flops=500e12, flops_fp32=250e12,
                     launch_s=5e-6, link_bytes_s=50e9, conv_workspace=0, band_bytes=None,
                     stats_chunk=0)
# This project's 2-core CI machine, one thread: ~80 GFLOP/s float32 convolutions (measured: the untiled
# 1024 px SD decode, 9.9 TFLOP, in ~125 s); host and device are one memory (no transfers).
CPU = DeviceProfile("cpu", "x86_64 CPU, 1 thread (model constants)", flops=20e9, flops_fp32=80e9,
                    launch_s=2e-6, link_bytes_s=float("inf"), conv_workspace=32 << 20,
                    band_bytes=BAND_BYTES, stats_chunk=1 << 20)
PROFILES = {"cpu": CPU, "cuda": CUDA}


def profile(device_kind: str | DeviceProfile | None, device) -> DeviceProfile:
    """The profile to plan with: the one given, the named kind's, or the kind of `device` (a torch
    device: "cpu" plans CPU-shaped, any accelerator and "meta" CUDA-shaped)."""
    if isinstance(device_kind, DeviceProfile):
        return device_kind
    if device_kind is None:
        return CPU if torch.device(device).type == "cpu" else CUDA
    if device_kind not in PROFILES:
        raise ValueError(f"device_kind must be None (the VAE's device), a DeviceProfile or one of "
                         f"{DEVICE_KINDS}, got {device_kind!r}")
    return PROFILES[device_kind]


def vae_device(vae):
    """The device a VAE's parameters are on."""
    try:
        return torch.device(vae.device)
    except AttributeError:
        return next(vae.parameters()).device


def available_memory() -> int:
    """Bytes of memory this machine has available now (MemAvailable; total physical memory elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
