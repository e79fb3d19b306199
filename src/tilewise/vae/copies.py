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

Pinned host blocks a copy used are not reused before the copy ends (PyTorch's host allocator records an
event for them). Elsewhere (CPU, the meta device of counted runs) copies are made where they are
called (`InlineLane`). `tests/test_copies.py` runs the protocol against a lane that makes copies late
and marks unfinished ones NaN, so a missing wait shows.
"""

from __future__ import annotations


class InlineLane:
    """Copies made at once, on the caller's stream."""

    def copy(self, name: str, dst, src) -> None:
        dst.copy_(src, non_blocking=True)

    def ready(self, name: str) -> None:
        """Copies into `name` have been made (always, here)."""

    def finish(self) -> None:
        """Every copy has been made (always, here)."""


class CudaLane:
    """Copies on a CUDA side stream (the module docstring's protocol)."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.compute = torch.cuda.current_stream(device)
        self.stream = torch.cuda.Stream(device)
        self.events: dict = {}  # staged value -> event after its last copy

    def copy(self, name: str, dst, src) -> None:
        self.stream.wait_stream(self.compute)
        with self.torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.stream)
        self.events[name] = self.stream.record_event()

    def ready(self, name: str) -> None:
        event = self.events.pop(name, None)
        if event is not None:
            self.compute.wait_event(event)

    def finish(self) -> None:
        self.stream.synchronize()
        self.events.clear()


def copy_lane(device, where: str):
    """The lane of a staging: a CUDA side stream for host staging on a CUDA device, else inline."""
    import torch

    if where == "host" and torch.device(device).type == "cuda":
        return CudaLane(device)
    return InlineLane()
