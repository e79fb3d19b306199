"""Host staging's device -> host copies (vae/copies.py) against a lane that makes them late.

A GPU runs the copies on a side stream: a copy whose source changes before it runs, or a read of a value
before its copies are done, is a race that no CPU run shows. `LateLane` makes the race visible on a CPU:
each copy marks its destination NaN at once and copies the source as it is when the value is next
needed (`ready`), or at the end (`finish`). A run that waits where the protocol says is exact; one that
skips a wait reads NaN.
"""

import pytest

torch = pytest.importorskip("torch")

from vae_support import kl_vae, structured_latent  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality import lower  # noqa: E402
from tilewise.vae.run import copies  # noqa: E402
from tilewise.vae.run.executor import Executor, NonFiniteError  # noqa: E402
from tilewise.vae.run.options import RunOptions  # noqa: E402


class LateLane:
    """Copies made when their value is next needed; until then their destination holds NaN. Boxes read
    ahead (`fetch`) are read after the copies into their value (one stream) and handed over at `take`."""

    prefetch = True

    def __init__(self):
        self.pending: dict[str, list] = {}
        self.copies = self.late = self.fetches = self.taken = 0

    def fetch(self, name, src, device):
        self.ready(name)  # (the side stream's order: after the copies into it)
        self.fetches += 1
        return src.to(device, copy=True)

    def take(self, handle):
        self.taken += 1
        return handle

    def copy(self, name, dst, src):
        dst.fill_(float("nan"))
        self.pending.setdefault(name, []).append((dst, src))  # (src held: record_stream's part)
        self.copies += 1

    def ready(self, name):
        for dst, src in self.pending.pop(name, []):
            dst.copy_(src)
            self.late += 1

    def finish(self):
        for name in list(self.pending):
            self.ready(name)


class SkippingLane(LateLane):
    """A broken protocol: reads do not wait for the copies."""

    def ready(self, name):
        pass

    def fetch(self, name, src, device):
        return src.to(device, copy=True)


def _lane(monkeypatch, cls):
    lanes = []

    def make(device, where):
        lanes.append(cls() if where == "host" else copies.InlineLane())
        return lanes[-1]

    monkeypatch.setattr(copies, "copy_lane", make)
    return lanes


@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_host_staging_with_late_copies_equals_the_untiled_module(monkeypatch, kind):
    lanes = _lane(monkeypatch, LateLane)
    vae = kl_vae("sd")
    with torch.no_grad():
        if kind == "decode":
            z = structured_latent(1, 4, 13, 17)
            p, t, ref = lower(vae.decoder), z, vae.decoder(z)
        else:
            t = torch.randn(1, 3, 88, 72, generator=torch.Generator().manual_seed(2))
            p, ref = lower(vae.encoder), vae.encoder(t)
        ref_v = p.input if kind == "decode" else p.output
        out = Executor(p, 5, ref_v, RunOptions(staging="host", progress=False)).run(t).output
    assert (out - ref).abs().max() <= 1e-4
    lane = lanes[0]
    assert lane.copies > 0 and lane.late == lane.copies and not lane.pending
    assert lane.fetches > 0 and lane.taken == lane.fetches  # (every box read ahead was used)


def test_device_plus_host_staging_and_streamed_attention_with_late_copies_are_exact(monkeypatch):
    _lane(monkeypatch, LateLane)
    vae = kl_vae("sd")
    z = structured_latent(1, 4, 16, 16)
    plan = tw.TiledVAE(vae, tile_size=8, progress=False, device_kind="cuda", staging="host").plan(z.shape)
    on = frozenset(s.value for s in plan.stages[::2])
    p = lower(vae.decoder)
    with torch.no_grad():
        out = Executor(p, 8, p.input, RunOptions(staging="host", on_device=on, kv_chunk=32, query_rows=4,
                                                 progress=False)).run(z).output
        assert (out - vae.decoder(z)).abs().max() <= 1e-4


def test_split_values_with_late_copies_are_exact(monkeypatch):
    """Values split at a row (their first rows on the device, `staging.SplitValue`): a box's host rows are
    written through the lane and read (or read ahead) after its copies, its device rows copied at once."""
    lanes = _lane(monkeypatch, LateLane)
    vae = kl_vae("sd")
    z = structured_latent(1, 4, 9, 11)
    p = lower(vae.decoder)
    shapes = p.shapes((9, 11))
    plan = tw.TiledVAE(vae, tile_size=5, progress=False, device_kind="cuda", staging="host").plan(z.shape)
    split = tuple((s.value, shapes[s.value][0] // 2 + 1) for s in plan.stages)
    with torch.no_grad():
        out = Executor(p, 5, p.input, RunOptions(staging="device+host", split=split,
                                                 progress=False)).run(z).output
        assert (out - vae.decoder(z)).abs().max() <= 1e-4
    lane = lanes[0]
    assert lane.copies > 0 and lane.late == lane.copies and lane.fetches > 0 and lane.taken == lane.fetches


def test_a_lane_that_does_not_wait_is_caught(monkeypatch):
    _lane(monkeypatch, SkippingLane)
    vae = kl_vae("sd")
    z = structured_latent(1, 4, 13, 17)
    p = lower(vae.decoder)
    with torch.no_grad(), pytest.raises(NonFiniteError):
        Executor(p, 5, p.input, RunOptions(staging="host", progress=False)).run(z)


def test_cpu_and_device_staging_copy_inline():
    assert isinstance(copies.copy_lane("cpu", "host"), copies.InlineLane)
    assert isinstance(copies.copy_lane("meta", "host"), copies.InlineLane)
    assert isinstance(copies.copy_lane("cpu", "device"), copies.InlineLane)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CudaLane: a CUDA side stream, pinned memory")
def test_cuda_lane_host_staging_equals_the_untiled_module():
    """On a GPU: host staging through the side stream (contiguous copies into pinned blocks written into
    their boxes later, reads ahead gathered into pinned blocks) equals the untiled decoder."""
    vae = kl_vae("sd").to("cuda")
    z = structured_latent(1, 4, 13, 17).to("cuda")
    p = lower(vae.decoder)
    with torch.no_grad():
        run = Executor(p, 5, p.input, RunOptions(staging="host", progress=False), device="cuda")
        out = run.run(z).output
        assert (out - vae.decoder(z)).abs().max() <= 1e-4


class _Event:
    """A stand-in CUDA event: done once `_Clock.tick` has passed it (copies finish late)."""

    def __init__(self, clock):
        self.clock, self.at = clock, clock.now

    def query(self):
        return self.clock.done >= self.at

    def synchronize(self):
        self.clock.done = max(self.clock.done, self.at)


class _Clock:
    def __init__(self):
        self.now = self.done = 0


class _Stream:
    def __init__(self, clock):
        self.clock = clock

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self):
        self.clock.now += 1
        self.clock.done = self.clock.now - 3  # (the last three copies still running)
        return _Event(self.clock)

    def synchronize(self):
        self.clock.done = self.clock.now


class _Torch:
    """torch with CUDA's streams stood in and pinned memory plain (CPU runs of CudaLane's bookkeeping)."""

    def __init__(self):
        import contextlib

        self.clock = _Clock()
        self.cuda = type("cuda", (), {"stream": staticmethod(lambda s: contextlib.nullcontext())})

    def empty(self, *shape, dtype, pin_memory):
        return torch.empty(*shape, dtype=dtype)


class _CpuCudaLane(copies.CudaLane):
    """CudaLane's protocol over `_Torch`: its blocks are written into their boxes only when `_settle` says."""

    def __init__(self):
        self.torch = _Torch()
        self.compute, self.stream = _Stream(self.torch.clock), _Stream(self.torch.clock)
        self.events, self.pending = {}, {}
        self.settled = 0

    def _record(self, t, stream):
        pass

    def _settle(self, name):
        before = sum(len(b) for b in self.pending.values())
        super()._settle(name)
        self.settled += before - sum(len(b) for b in self.pending.values())


def test_cuda_lane_writes_its_pinned_blocks_before_a_value_is_read(monkeypatch):
    """CudaLane's own bookkeeping on the CPU (streams stood in, copies done three events late): every block
    of a value is written into its box before the value is read or read ahead, so host staging is exact."""
    lanes = []

    def make(device, where):
        lanes.append(_CpuCudaLane() if where == "host" else copies.InlineLane())
        return lanes[-1]

    monkeypatch.setattr(copies, "copy_lane", make)
    vae = kl_vae("sd")
    z = structured_latent(1, 4, 13, 17)
    p = lower(vae.decoder)
    with torch.no_grad():
        out = Executor(p, 5, p.input, RunOptions(staging="host", progress=False)).run(z).output
        assert (out - vae.decoder(z)).abs().max() <= 1e-4
    assert lanes[0].settled > 0 and not lanes[0].pending
