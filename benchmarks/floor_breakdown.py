"""Where an exact GPU plan moves more than its staging floor (issue #31): per staged value, the bytes it
writes to and reads from host memory, summed over the tiles' boxes as the plan counts them.

SD-architecture VAE on fake tensors (benchmarks/counting.py), float16, a 4096 px decode planned for
devices.CUDA with a fixed 64 GiB host (as counts.py). "host" is the value's bytes in host memory (a split
value's rows past its split), "read / k" its reads over its host bytes and its k reading segments (above
1: halos re-read); what the per-value sums miss of the plan's bytes is attention's keys and values
streamed from host memory and the statistics' merges.

    PYTHONPATH=src .venv/bin/python benchmarks/floor_breakdown.py --budgets 539,4096
"""

from __future__ import annotations

import argparse

import torch
from counting import build_vae, fake

import tilewise as tw
from tilewise.locality.boxes import box_area, map_box
from tilewise.locality.ops import OpKind
from tilewise.locality.program import back_propagate
from tilewise.vae.devices import CUDA
from tilewise.vae.plan.counts import Scope, _tile_boxes
from tilewise.vae.plan.memo import grid, segments
from tilewise.vae.plan.op_costs import Setting
from tilewise.vae.run.bands import band_rows, row_local
from tilewise.vae.run.options import pass_options

MIB, GIB = 1 << 20, 1 << 30


def value_bytes(tv, plan, shape):
    """(written, read): value -> host bytes its stores write; (value, segment) -> host bytes read there."""
    job, settings = tv.job("decode"), tv.settings
    p, run = job.program, pass_options(settings, job.profile, plan.choices)
    s = Setting(run, True, job.item, shape[0])
    shapes, chans = p.shapes(tuple(shape[-2:])), p.channels()
    tracked = {}
    for op in p.ops:
        if op.kind is OpKind.GROUP_NORM:
            tracked.setdefault(op.src[0], set()).add(op.groups)
    scope, unit = Scope(p, shapes, chans, job.ref, tracked, s), shape[0] * job.item
    tiles = grid(shapes[job.ref], plan.tile_size)
    written, read = {}, {}
    for i, seg in enumerate(segments(p, frozenset(), settings.attention, plan.choices.recompute)):
        rows = None
        if run.band_bytes and row_local(seg):  # (as counts._segment_cost bands a segment)
            big = max(tiles, key=lambda t: box_area(t.core))
            cores = {v: map_box(big.core, shapes[job.ref], shapes[v]) for v in seg.outputs}
            rows = band_rows(back_propagate(seg.ops, cores, shapes), chans, unit, big.core, run.band_bytes)
        for t in tiles:
            for cores, need in zip(*_tile_boxes(seg, t, scope, rows, None), strict=True):
                for v in seg.inputs:
                    if v in need and v != p.input and s.off(v):
                        read[v, i] = read.get((v, i), 0) + s.host_area(v, need[v]) * chans[v] * unit
                for v, core in cores.items():
                    if v != p.output and v not in seg.measured and s.off(v):
                        written[v] = written.get(v, 0) + s.host_area(v, core) * chans[v] * unit
    return written, read


def report(budget_mib: int) -> None:
    with fake():
        vae = build_vae("sd", torch.float16, "meta")
    tv = tw.TiledVAE(vae, mode="exact", memory_budget=budget_mib * MIB, progress=False,
                     device_kind=CUDA.replace(host_memory=64 * GIB))
    shape = (1, 4, 512, 512)
    plan = tv.plan(shape, kind="decode")
    written, read = value_bytes(tv, plan, shape)
    moved, w, r = plan.h2d + plan.d2h, sum(written.values()), sum(read.values())
    print(f"\nwithin {budget_mib:,} MiB: tile {plan.tile_size}, moves {moved / GIB:.2f} GiB, floor "
          f"{plan.staging_floor / GIB:.2f} GiB ({moved / plan.staging_floor:.2f}x); per value {w / GIB:.2f} "
          f"written + {r / GIB:.2f} read, the rest {(moved - w - r) / GIB:.2f} (keys / values, merges)")
    print("| value | MiB | host MiB | lifetime | readers | written MiB | read MiB | read / host / k |")
    print("|---|---|---|---|---|---|---|---|")
    rows = dict(plan.choices.split)
    for st in plan.stages:
        v = st.value
        k = len(plan.readers.get(v, ()))
        host = 0 if st.where == "device" else st.bytes - st.bytes // st.shape[-2] * rows.get(v, 0)
        got = sum(b for (u, _), b in read.items() if u == v)
        factor = f"{got / host / k:.3f}" if host and k else "-"
        print(f"| {v} ({st.producer}) | {st.bytes / MIB:,.0f} | {host / MIB:,.0f} | {plan.lifetimes[v]} | "
              f"{k} | {written.get(v, 0) / MIB:,.0f} | {got / MIB:,.0f} | {factor} |")
    print("segments' own device bytes (MiB):", [round(h / MIB) for h in plan.segment_bytes])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="539,4096", help="MiB, comma-separated (default: %(default)s)")
    for b in ap.parse_args().budgets.split(","):
        report(int(b))


if __name__ == "__main__":
    main()
