"""Staged values held split at a row (`run.staging.SplitValue`): their first rows on the device, the rest
in host memory, read and written box by box on both. On the CPU both halves are host tensors, so a run
with split values is checked against the untiled module (the placement's counts: tests/test_counting.py).
"""

import pytest

torch = pytest.importorskip("torch")

from vae_support import kl_vae, structured_latent  # noqa: E402

from tilewise.locality import lower  # noqa: E402
from tilewise.locality.boxes import box_empty, map_box  # noqa: E402
from tilewise.locality.program import back_propagate  # noqa: E402
from tilewise.vae.run.executor import Executor  # noqa: E402
from tilewise.vae.run.options import Choices, RunOptions  # noqa: E402
from tilewise.vae.run.segments import tile_grid  # noqa: E402
from tilewise.vae.run.staging import SplitValue  # noqa: E402


def _splits(p, tile: int, shape, ref: str):
    """Every staged value of p split a third, half or three quarters of the way down (plus a row, off the
    tiles' edges), and the reads whose boxes straddle the split row: (value, segment) pairs."""
    ex = Executor(p, tile, ref, RunOptions(staging="host", progress=False))
    segs, shapes = ex.segments(), p.shapes(tuple(shape[-2:]))
    staged = [v for seg in segs for v in seg.outputs if v != p.output and v not in seg.measured]
    split = {v: shapes[v][0] * (k % 3 + 1) // 4 + 1 for k, v in enumerate(staged)}
    straddles, readers = set(), {}
    for i, seg in enumerate(segs):
        for t in tile_grid(shapes[ref], tile):
            cores = {v: map_box(t.core, shapes[ref], shapes[v]) for v in seg.outputs}
            need = back_propagate(seg.ops, {v: b for v, b in cores.items() if not box_empty(b)}, shapes)
            for v in seg.inputs:
                if v in split and v in need:
                    readers.setdefault(v, set()).add(i)
                    if need[v][0] < split[v] < need[v][1]:
                        straddles.add((v, i))
    return tuple(split.items()), straddles, readers


@pytest.mark.parametrize("kind", ["decode", "encode"])
def test_split_values_equal_the_untiled_module(kind):
    vae = kl_vae("sd")
    with torch.no_grad():
        if kind == "decode":
            t = structured_latent(1, 4, 9, 11)
            p, ref = lower(vae.decoder), vae.decoder(t)
        else:
            t = torch.randn(1, 3, 64, 72, generator=torch.Generator().manual_seed(2))
            p, ref = lower(vae.encoder), vae.encoder(t)
        ref_v = p.input if kind == "decode" else p.output
        split, straddles, readers = _splits(p, 5, t.shape, ref_v)
        opts = RunOptions(staging="device+host", split=split, progress=False)
        out = Executor(p, 5, ref_v, opts).run(t).output
    assert (out - ref).abs().max() <= 1e-4
    assert len(straddles) > 5 and any(len(r) > 1 for r in readers.values())  # (read by two segments)
    assert any(len(readers[v]) > 1 and all((v, i) in straddles for i in readers[v]) for v in readers)


def test_split_values_with_no_or_every_row_on_the_device_and_some_on_it_whole():
    vae = kl_vae("sd")
    z = structured_latent(1, 4, 9, 11)
    p = lower(vae.decoder)
    split, _, _ = _splits(p, 5, z.shape, p.input)
    names = [v for v, _ in split]
    ends = tuple((v, 0 if k % 2 else 10_000 if k % 3 else r) for k, (v, r) in enumerate(split) if k % 5)
    on = frozenset(names[::5])
    with torch.no_grad():
        ref = vae.decoder(z)
        with pytest.raises(ValueError, match="keeps 0 to"):  # (10,000 rows of a 9-row value)
            Executor(p, 5, p.input, RunOptions(staging="device+host", split=ends, progress=False)).run(z)
        ends = tuple((v, min(r, p.shapes((9, 11))[v][0])) for v, r in ends)
        opts = RunOptions(staging="device+host", on_device=on, split=ends, progress=False)
        out = Executor(p, 5, p.input, opts).run(z).output
    assert (out - ref).abs().max() <= 1e-4


def test_split_choices_are_checked():
    with pytest.raises(ValueError, match="staging must be 'device\\+host', got 'host'"):
        Choices(8, "host", split=(("v1", 3),))
    with pytest.raises(ValueError, match="device rows >= 0"):
        RunOptions(staging="device+host", split=(("v1", -1),))
    with pytest.raises(ValueError, match="keeps 0 to 4 of them on the device, got 5"):
        SplitValue((1, 2, 4, 3), torch.float32, "cpu", 5)
