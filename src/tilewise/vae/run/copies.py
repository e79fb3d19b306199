"""Device -> host copies of staged values beside the compute: on a GPU, a side stream.

Host staging writes every tile's cores to pinned host memory. On the compute stream those copies stall
the next tile's kernels; on a side stream (`CudaLane`) they overlap them. The protocol, for every copy
of a staged value's box:

1. the side stream waits for the compute stream (the source is made: `wait_stream`);
2. the copy runs on the side stream, and the source's memory is kept from reuse until it is done
   (`record_stream`: the caching allocator would hand it to the next tile otherwise);
3. an event after the value's last copy is kept; whoever reads the value next (a later segment's
   host -> device read, a halo exchange, freeing it) first makes the compute stream wait for that event
   (`ready`: a wait on the device, no host synchronisation).

The other way, the executor reads the next tile's host-staged inputs while this tile computes
(`fetch` on the side stream, after the compute so far; `take` makes the compute stream wait for it
and hands the tensor's memory to the compute stream with record_stream).

Every copy is contiguous on both sides, so that it is one DMA that holds neither stream nor the host: a
staged value's box is a strided view of its (B, C, H, W) host tensor, and PyTorch copies a strided view
between host and device through a contiguous pageable temporary (`copy_requires_temporaries` in ATen's
cuda/Copy.cu), from which a device -> host copy returns only once it is done (CUDA's rule for pageable
memory): every store would hold the host until the device had run everything before it. So a store's
source is made contiguous on the side stream and copied into a pinned block of its own, which the host
writes into the staged value's box later, once the copy is done (`_settle`: at the next copy, for those
done by then; for all of a value before it is read; at `finish`); a read ahead gathers its box on the
host into a pinned block first, then copies that. The host's gathers and writes are memory copies on
the thread that launches the kernels (the time model leaves them out). Pinned host blocks a copy used
are not reused before the copy ends (PyTorch's host allocator records an event for them). Elsewhere
(CPU, the meta device of counted runs) copies are made where they are called (`InlineLane`).
`tests/test_copies.py` runs the protocol against a lane that makes copies late and marks unfinished ones
NaN, so a missing wait shows.
"""

from __future__ import annotations

import torch


class InlineLane:
    """Copies made at once, on the caller's stream. `prefetch`: the executor reads the next tile's inputs
    before it runs this one (the meta device of counted runs: a CUDA run's order and memory)."""

    def __init__(self, prefetch: bool = False):
        self.prefetch = prefetch

    def copy(self, name: str, dst, src) -> None:
        dst.copy_(src, non_blocking=True)

    def fetch(self, name: str, src, device):
        """A host box of `name` read onto the device ahead of its use: a handle for `take`."""
        return src.to(device, non_blocking=True)

    def take(self, handle):
        """The tensor of a `fetch`, ready for the compute stream."""
        return handle

    def ready(self, name: str) -> None:
        """Copies into `name` have been made (always, here)."""

    def finish(self) -> None:
        """Every copy has been made (always, here)."""


class CudaLane:
    """Copies on a CUDA side stream (the module docstring's protocol)."""

    prefetch = True

    def __init__(self, device):
        self.torch = torch
        self.compute = torch.cuda.current_stream(device)
        self.stream = torch.cuda.Stream(device)
        self.events: dict = {}  # staged value -> event after its last copy
        self.pending: dict[str, list] = {}  # staged value -> (event, box view, pinned block) to write

    def fetch(self, name: str, src, device):
        """Read a host box of `name` onto the device on the side stream (after the copies into it, and after
        the compute so far: the memory it lands in may have been the compute's), through a pinned block."""
        self._settle(name)
        block = self.torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        block.copy_(src)  # (on the host: the box gathered)
        self.stream.wait_stream(self.compute)
        with self.torch.cuda.stream(self.stream):
            t = block.to(device, non_blocking=True)
        return t, self.stream.record_event()

    def take(self, handle):
        """The fetched tensor, once its copy is done on the compute stream's clock; its memory is then
        the compute stream's too (record_stream)."""
        t, event = handle
        self.compute.wait_event(event)
        self._record(t, self.compute)
        return t

    def copy(self, name: str, dst, src) -> None:
        self._settle(None)  # (the blocks whose copies are done: host memory stays bounded)
        self.stream.wait_stream(self.compute)
        with self.torch.cuda.stream(self.stream):
            block = self.torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            block.copy_(src.contiguous(), non_blocking=True)
        self._record(src, self.stream)
        event = self.stream.record_event()
        self.events[name] = event
        self.pending.setdefault(name, []).append((event, dst, block))

    def ready(self, name: str) -> None:
        self._settle(name)
        event = self.events.pop(name, None)
        if event is not None:
            self.compute.wait_event(event)

    def finish(self) -> None:
        self.stream.synchronize()
        for name in list(self.pending):
            self._settle(name)
        self.events.clear()

    def _record(self, t, stream) -> None:
        """Keep t's device memory from reuse until `stream`'s work so far is done."""
        t.record_stream(stream)

    def _settle(self, name: str | None) -> None:
        """Write the pinned blocks into their boxes: all of `name`'s (waiting for their copies), or with
        None every block whose copy is done already."""
        for v in [name] if name is not None else list(self.pending):
            blocks = self.pending.get(v, [])
            while blocks and (name is not None or blocks[0][0].query()):
                event, dst, block = blocks.pop(0)
                event.synchronize()
                dst.copy_(block)
            if not blocks:
                self.pending.pop(v, None)


def copy_lane(device, where: str):
    """The lane of a staging: a CUDA side stream for host staging on a CUDA device, else inline."""

    kind = torch.device(device).type
    if where == "host" and kind == "cuda":
        return CudaLane(device)
    return InlineLane(prefetch=where == "host" and kind == "meta")
