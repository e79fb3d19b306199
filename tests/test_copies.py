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
