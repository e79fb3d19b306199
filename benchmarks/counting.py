"""Count what a run dispatches, the same on any machine: kernel launches, FLOPs, live bytes, transfers.

`Counter` is a TorchDispatchMode over every aten operator a run dispatches:
- an operator that writes a storage (mutable schema: copy_, add_, out=) or returns a new one is a kernel
  launch (on a GPU each is at least one kernel; what a kernel does inside, e.g. cuDNN's own workspace
  transforms, is below this level and not counted); `empty` allocates without a kernel (`allocs`);
- views and metadata-only operators (view, slice, permute, expand, as_strided, ...) are counted apart;
- `_local_scalar_dense` (`.item()`, `bool(t)`) is a host synchronisation (`syncs`);
- a copy between the device and the host is a transfer: its bytes, host->device and device->host;
- live storages are tracked by identity from birth (an operator's output) to death (a weakref on the
  storage), per device type: the peak is what an allocator holding the same tensors would hold.
FLOPs come from `torch.utils.flop_counter.FlopCounterMode` (convolutions, matmuls, attention).

Sizes that cannot run here run on fake tensors (`fake()`): `torch._subclasses.FakeTensorMode` on the
meta device, which allocates nothing and dispatches the same operators. The device under count is then
"meta" and the host "cpu" (fake too); scaled_dot_product_attention, whose meta dispatch is the unfused
math graph, is given the fused kernel CPU and CUDA dispatch (one operator, flash attention's FLOPs).
`tests/test_counting.py` checks that a fake-meta run counts what a real CPU run counts at a small size.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter as Tally
from dataclasses import dataclass, field

import torch
import torch.utils.flop_counter as flop_counter
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu
# the fused CPU attention kernel has the same FLOPs as CUDA's flash attention (the counter lacks it)
_FLASH_FLOPS = flop_counter.flop_registry[aten._scaled_dot_product_flash_attention]
flop_counter.flop_registry.setdefault(_CPU_FLASH, _FLASH_FLOPS)

_ALLOC = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided}
_SYNC = {aten._local_scalar_dense}
_META_ONLY = {aten.record_stream, aten.lift_fresh, aten.detach, aten.alias}
_PRIM = "prim."  # metadata queries fake tensors dispatch (prim.device, ...)


@dataclass
class Counts:
    """What one run dispatched (see the module docstring for the categories)."""

    launches: int = 0
    views: int = 0
    allocs: int = 0
    syncs: int = 0
    copies: int = 0  # host <-> device copies
    stats: int = 0  # launches while `counter.in_stats` is set (a benchmark's own attribution)
    flops: int = 0
    h2d: int = 0  # bytes host -> device
    d2h: int = 0  # bytes device -> host
    peak: dict[str, int] = field(default_factory=dict)  # device type -> peak live bytes born in the run
    ops: Tally = field(default_factory=Tally)  # launch operator name -> count
    view_ops: Tally = field(default_factory=Tally)  # view / metadata operator name -> count
    counter: object = field(default=None, repr=False)  # the Counter that fills these

    def device_peak(self, device: str) -> int:
        return self.peak.get(device, 0)


class Counter(TorchDispatchMode):
    """Counts launches, views, allocations, syncs, transfers and peak live storage bytes (module doc).

    `device`: the device type under count ("cuda", "cpu", or "meta" for fake runs); the host is "cpu"."""

    def __init__(self, device: str = "meta"):
        super().__init__()
        self.device, self.counts = device, Counts()
        self.counts.counter, self.in_stats = self, False
        self._live: dict[int, tuple[int, str]] = {}  # storage key -> (bytes, device type)
        self._seen: set[int] = set()  # storages that existed before they were first seen (weights, input)
        self._now: Tally = Tally()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if str(packet).startswith(_PRIM):
            return func(*args, **kwargs)
        tensors_in = [t for t in _tensors((args, kwargs))]
        for t in tensors_in:
            self._remember(t)
        c = self.counts
        if packet in _SYNC:
            c.syncs += 1
            if _is_fake(tensors_in[0]):
                return True  # a fake run has no values: every check passes (finite, non-zero)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        outs = list(_tensors(out))
        moved = self._transfer(packet, tensors_in, outs)
        new = [t for t in outs if self._birth(t)]
        if moved:
            c.copies += 1
        elif packet not in _META_ONLY and (func._schema.is_mutable or (new and packet not in _ALLOC)):
            c.launches += 1
            c.stats += self.in_stats
            c.ops[str(packet).removeprefix("aten.")] += 1
        elif new and packet not in _META_ONLY:
            c.allocs += 1
        else:
            c.views += 1
            c.view_ops[str(packet).removeprefix("aten.")] += 1
        return out

    # -- pieces --------------------------------------------------------------------------------

    def _transfer(self, packet, ins, outs) -> bool:
        """Count a copy between host and device (bytes, by direction); True when it was one."""
        if packet is aten.copy_:
            dst, src = ins[0], ins[1]
        elif packet is aten._to_copy and outs:
            dst, src = outs[0], ins[0]
        else:
            return False
        a, b = src.device.type, dst.device.type
        if a == b:
            return False
        n = dst.numel() * dst.element_size()
        if b == self.device:
            self.counts.h2d += n
        elif a == self.device:
            self.counts.d2h += n
        return True

    def _remember(self, t) -> None:
        s = t.untyped_storage()
        key = s._cdata
        if key not in self._live and key not in self._seen:
            self._seen.add(key)
            weakref.finalize(s, self._seen.discard, key)

    def _birth(self, t) -> bool:
        """Track t's storage when it is new; True when it is."""
        s = t.untyped_storage()
        key = s._cdata
        if key in self._live or key in self._seen:
            return False
        dev = t.device.type
        self._live[key] = (s.nbytes(), dev)
        self._now[dev] += s.nbytes()
        peak = self.counts.peak
        peak[dev] = max(peak.get(dev, 0), self._now[dev])
        weakref.finalize(s, self._death, key)
        return True

    def _death(self, key: int) -> None:
        n, dev = self._live.pop(key)
        self._now[dev] -= n


class _FusedAttention(TorchFunctionMode):
    """On the meta device, scaled_dot_product_attention as the one fused operator CPU and CUDA run."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plain = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None)
        if func is torch.nn.functional.scaled_dot_product_attention and args[0].device.type == "meta" \
                and len(args) == 3 and all(plain.get(k, object()) == v for k, v in kwargs.items()):
            return _CPU_FLASH(*args)[0]
        return func(*args, **kwargs)


def _tensors(tree):
    """The tensors in a nested structure of args."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, list | tuple):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def count(device: str = "meta"):
    """Count everything dispatched inside: `with count("meta") as c: ...; c.launches, c.flops`."""
    counter = Counter(device)
    flops = flop_counter.FlopCounterMode(display=False)
    with _FusedAttention(), flops, counter, torch.no_grad():
        yield counter.counts
    counter.counts.flops = flops.get_total_flops()


@contextlib.contextmanager
def fake():
    """Fake tensors (nothing allocated) with the meta device as the counted device: build models and
    inputs inside, under `torch.device("meta")`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


# -- the VAEs of the tables ------------------------------------------------------------------------

SHAPES = {
    # SD 1.x / 2.x: the AutoencoderKL of runwayml/stable-diffusion-v1-5
    "sd": dict(latent_channels=4, sample_size=512),
    # SDXL: the same architecture with its own config (scaling 0.13025, force_upcast: its fp16 overflows)
    "sdxl": dict(latent_channels=4, scaling_factor=0.13025, force_upcast=True, sample_size=1024),
    # Flux: 16 latent channels, no quant convs
    "flux": dict(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611,
                 shift_factor=0.1159, force_upcast=True, sample_size=1024),
}


def build_vae(kind: str = "sd", dtype=torch.float32, device: str = "cpu", seed: int = 0,
              blocks: tuple[int, ...] = (128, 256, 512, 512), groups: int = 32):
    """An AutoencoderKL shaped like the named one (block_out_channels `blocks`: 128, 256, 512, 512 as
    the real ones; 2 resnets a block; seeded random weights); on "meta" inside `fake()` it allocates
    nothing."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: fake parameters cannot be cast after
    try:
        with torch.device(device):
            vae = AutoencoderKL(block_out_channels=blocks, layers_per_block=2, norm_num_groups=groups,
                                down_block_types=("DownEncoderBlock2D",) * len(blocks),
                                up_block_types=("UpDecoderBlock2D",) * len(blocks), **SHAPES[kind])
    finally:
        torch.set_default_dtype(default)
    return vae.eval()
