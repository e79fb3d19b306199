"""Plans counted to the byte where a settle's search shares its counts (#31): split values' classes of
tiles counted under the split being planned, a lazily upsampled convolution's tile held as it runs, and
SDXL decode at 4096 px within diffusers' own peak planned within it and as its run counts."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from counting import build_vae, count, fake  # noqa: E402

import tilewise as tw  # noqa: E402
from tilewise.locality import lower  # noqa: E402
from tilewise.locality.ops import OpKind  # noqa: E402
from tilewise.locality.program import back_propagate, last_use, run_op  # noqa: E402
from tilewise.vae.devices import CUDA  # noqa: E402
from tilewise.vae.plan.live import Sizes, live_peak  # noqa: E402
from tilewise.vae.plan.make import make_plan, request  # noqa: E402
from tilewise.vae.plan.memo import remembered  # noqa: E402
from tilewise.vae.run.context import ExecContext  # noqa: E402
from tilewise.vae.runner import run_once  # noqa: E402
from tilewise.vae.settings import Place  # noqa: E402

NARROW = dict(blocks=(16, 32, 32, 32), groups=8)


def _split_at(plan, fraction: float) -> tuple[tuple[str, int], ...]:
    """Every staged value of `plan` split `fraction` of the way down (at least one row on the device)."""
    return tuple(sorted((s.value, max(1, int(s.shape[-2] * fraction))) for s in plan.stages))


def test_split_plans_in_one_search_count_each_split_as_its_run_does():
    with fake():  # (48 x 48 in tiles of 8: six tile rows; split at one row every interior tile reads from
        # the host, at half the rows the upper ones read from the device and the lower ones from the host)
        vae = build_vae("sd", torch.float16, "meta", **NARROW)
        tv = tw.TiledVAE(vae, progress=False, device_kind="cuda", memory_budget=1 << 30)
        z = torch.randn(1, 4, 48, 48).to("meta", torch.float16)
        shape, job = tuple(z.shape), tv.job("decode")
        host = make_plan(tv.settings, job, shape, request(tv.settings, job, 8, Place.HOST))
        asks = [host.choices.replace(staging=Place.MIXED, split=_split_at(host, f), read_ahead=ahead)
                for f, ahead in ((0.0, True), (0.5, False))]
        with remembered():  # (as in one settle: the first split's classes of tiles counted first; the
            # second's reads ahead differ, so its classes are counted again, on their own boxes)
            searched = [make_plan(tv.settings, job, shape, ask) for ask in asks]
        counted = []
        for ask in asks:
            with count("meta") as c:
                run_once(tv.settings, job, z, ask, None)
            counted.append(c)
    alone = make_plan(tv.settings, job, shape, asks[1])
    for plan, c in zip(searched, counted, strict=True):
        assert (plan.h2d, plan.d2h, plan.flops) == (c.h2d, c.d2h, c.flops)  # (to the byte)
        assert c.device_peak("meta") <= plan.peak <= 1.15 * c.device_peak("meta")
    assert (searched[1].h2d, searched[1].peak, searched[1].seconds) == (alone.h2d, alone.peak, alone.seconds)
    assert 0 < counted[1].h2d < counted[0].h2d


@pytest.mark.parametrize("row", [0, 1], ids=["top border", "interior"])
def test_a_lazily_upsampled_convolution_holds_what_its_tile_is_planned_to(row):
    with fake():  # (the conv reads rows 2k - 1 .. of the 2x value: rows from 2k - 2 are upsampled)
        p = lower(build_vae("sd", torch.float16, "meta", **NARROW).decoder)
        i = next(i for i, op in enumerate(p.ops) if op.kind is OpKind.RESAMPLE
                 and p.ops[i + 1].kind is OpKind.CONV and p.ops[i + 1].src == (op.dst,))
        ops, shapes, chans = p.ops[i : i + 2], p.shapes((32, 32)), p.channels()
        out, src = ops[1].dst, ops[0].src[0]
        cores = {out: (16 * row, 16 * row + 16, 16, 32)}
        need = back_propagate(ops, cores, shapes)
        y0, y1, x0, x1 = need[src]
        last, ctx = last_use(ops, [out]), ExecContext(conv_workspace=0)
        with count("meta") as c:  # (the source made in the run, as the segment's own value)
            vals = {src: (torch.zeros(1, chans[src], y1 - y0, x1 - x0, dtype=torch.float16, device="meta"),
                          need[src])}
            for k in range(len(ops)):
                run_op(ops, k, ctx, vals, need, shapes, last, keep=cores)
            del vals
    planned = live_peak(ops, need, Sizes(shapes, chans, 2), {src}, cores, last)
    assert need[ops[0].dst][0] % 2 == 1 or row == 0  # (an odd first row: one row more upsampled above)
    assert planned == c.device_peak("meta")


@pytest.mark.slow  # (~40 s: SDXL decode at 4096 px planned within 1,686 MiB and counted)
def test_sdxl_decode_at_4096_px_within_diffusers_peak_runs_within_it_as_planned():
    budget = 1_768_030_208  # diffusers' tiled decode's counted peak (benchmarks/counts.py)
    with fake():
        vae = build_vae("sdxl", torch.float16, "meta")
        tv = tw.TiledVAE(vae, memory_budget=budget, progress=False,
                         device_kind=CUDA.replace(host_memory=64 << 30))
        z = torch.randn(1, 4, 512, 512).to("meta", torch.float16)
        plan = tv.plan(tuple(z.shape))
        with count("meta") as c:
            tv.decode(z)
    assert plan.staging == "device+host" and plan.choices.recompute
    assert (plan.h2d, plan.d2h, plan.flops) == (c.h2d, c.d2h, c.flops)
    assert c.device_peak("meta") <= plan.peak <= budget
