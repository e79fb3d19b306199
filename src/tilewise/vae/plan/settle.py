"""Which plan a run follows: tile, staging and row bands within a memory budget, for the device.

CPU plans keep the largest tile up to tile_size and the nearest staging that fit. GPU plans search from
the whole latent down, staging on the device, on the device where it fits and in pinned host memory
where it does not ("device+host", `place`), in host memory, or on disk, and take the fitting plan of
least estimated time (`devices`).
"""

from __future__ import annotations

from .bands import BAND_BYTES
from .devices import DeviceProfile, device_profile
from .plan import Plan, make_plan
from .staging import STAGINGS


def choose(tv, kind: str, shape: tuple[int, ...]) -> tuple[int, str]:
    """Tile size and staging: as given, or the largest tile and nearest staging within the budget."""
    plan = settle(tv, kind, shape)
    return plan.tile_size, plan.staging


def settle(tv, kind: str, shape: tuple[int, ...], streamed: bool = False) -> Plan:
    """The plan a run follows: tile and staging as given (no memory_budget), else within the budget.

    CPU plans: the largest tile up to tile_size, then the nearest staging, whose peak fits. GPU plans
    (`devices`; tile_size does not cap them): tiles from the whole latent down (one tile: the untiled
    run, unless `streamed` to a sink), each with device staging, then host (pinned), then disk (only
    when host memory cannot hold the staged values, or when asked), whole tiles unless only row bands
    fit; of the plans that fit, the one with the least estimated time."""
    prof = device_profile(tv)
    default = "device" if prof.kind != "cpu" or tv.staging == "auto" else tv.staging
    if tv.memory_budget is None:
        st = default if tv.staging == "auto" else tv.staging
        return make_plan(tv, shape, kind, tv.tile_size, st, untiled=not streamed)
    if prof.kind != "cpu":
        return _settle_device(tv, kind, shape, prof, streamed)
    stagings = STAGINGS if tv.staging == "auto" else (tv.staging,)
    tiles = [s for s in (128, 96, 64, 48, 32, 24, 16, 12, 8, 4) if s <= max(tv.tile_size, 4)]
    for tile in tiles:
        for st in stagings:
            plan = make_plan(tv, shape, kind, tile, st)
            if plan.peak <= tv.memory_budget:
                return plan
    raise _no_fit(tv, make_plan(tv, shape, kind, tiles[-1], stagings[-1]))


def _settle_device(tv, kind: str, shape, prof: DeviceProfile, streamed: bool) -> Plan:
    """`settle` on a GPU: the fitting plan of least estimated time, from the biggest tile down to the
    biggest that fits with each staging (smaller tiles only add launches and halo work); row bands
    (BAND_BYTES) only when no whole-tile plan fits."""
    p = tv.program(kind)
    ref = p.input if kind == "decode" else p.output
    side = max(p.shapes(tuple(shape[-2:]))[ref])
    tiles = [side] + [s for s in (256, 192, 128, 96, 64, 48, 32, 24, 16, 12, 8, 4) if s < side]
    stagings = (tv.staging,)
    if tv.staging == "auto":
        mixed = tv.mode == "exact" and tv.process_group is None
        stagings = ("device", "device+host", "host", "disk") if mixed else ("device", "host", "disk")
    host = prof.host_bytes()
    budget, last, least = tv.memory_budget, None, None  # (least: the smallest peak tried, for the error)
    for bands in (None, BAND_BYTES):
        fits, settled = [], set()  # stagings that fit at a bigger tile, or at none
        for tile in tiles:
            for st in stagings:
                if st in settled:
                    continue
                if st == "device+host":
                    plan = _shrink(tv, shape, kind, tile, st, bands, place(tv, shape, kind, tile, bands))
                    if plan is not None and plan.peak <= budget and plan.staged_peak <= host:
                        fits.append(plan)
                        settled.add(st)
                    continue
                last = make_plan(tv, shape, kind, tile, st, bands, untiled=not streamed)
                if last.untiled and bands:
                    continue  # (row bands do not apply to the untiled run)
                if st == "disk" and tv.staging == "auto" and last.staged_peak <= host:
                    settled.add(st)  # disk only when host memory cannot hold the staged values
                    continue
                if st == "host" and last.staged_peak > host:
                    settled.add(st)
                    continue
                last = _shrink(tv, shape, kind, tile, st, bands, last)
                if least is None or last.peak < least.peak:
                    least = last
                if last.peak <= budget:
                    fits.append(last)
                    settled.add(st)  # (a smaller tile only adds launches and halo work)
                elif not last.untiled and _resident(last) > budget:
                    settled.add(st)  # what a smaller tile cannot shrink exceeds the budget
            if settled >= set(stagings) or any(q.staging == "device" for q in fits):
                break  # (device staging at this tile beats every staging at a smaller one)
        if fits:
            return min(fits, key=lambda q: (q.seconds, -q.tile_size))
    raise _no_fit(tv, least or last)


def _plan_at(tv, shape, kind: str, tile: int, staging: str, bands, attention: tuple[int, int] = (0, 0),
             read_ahead: bool = True) -> Plan | None:
    """The plan of a tile and staging ("device+host": `place`, None when it places nothing)."""
    if staging == "device+host":
        return place(tv, shape, kind, tile, bands, attention, read_ahead)
    return make_plan(tv, shape, kind, tile, staging, bands, attention=attention, read_ahead=read_ahead)


def _shrink(tv, shape, kind: str, tile: int, staging: str, bands, plan: Plan | None) -> Plan | None:
    """`plan`, or where it exceeds the budget the same tile and staging with less on the device: first
    without the next tile's inputs read ahead (exact mode), then with attention's keys and values
    streamed from host memory (`_stream`)."""
    budget = tv.memory_budget
    if plan is not None and plan.peak > budget and plan.read_ahead and tv.mode == "exact":
        plan = _plan_at(tv, shape, kind, tile, staging, bands, read_ahead=False) or plan
    if (plan is None or plan.peak > budget) and not (plan is not None and plan.untiled) \
            and _can_stream(tv, kind):
        plan = _stream(tv, shape, kind, tile, staging, bands) or plan
    return plan


def _can_stream(tv, kind: str) -> bool:
    """Whether exact global attention could stream its keys and values (one process, exact mode)."""
    return (tv.mode == "exact" and tv.attention == "global" and tv.process_group is None
            and any(op.kind == "attention" for op in tv.program(kind).ops))


def _stream(tv, shape, kind: str, tile: int, staging: str, bands) -> Plan | None:
    """The plan of a tile and staging with global attention's keys and values in host memory (`vae.
    attention`), or None when none fits: the least (kv_chunk, query_rows) first (when even that does
    not fit, the other segments do not), then for each key chunk in STREAM_CHUNKS (biggest first) the
    biggest query bands that fit, where they are bigger than a bigger chunk's; the one of least
    estimated time."""
    budget = tv.memory_budget
    p = tv.program(kind)
    h = p.shapes(tuple(shape[-2:]))[p.input if kind == "decode" else p.output][0]
    rows = sorted({max(1, h >> i) for i in range(12)} | {min(tile, h)}, reverse=True)

    def plan(kv, q):  # (the tight budgets streaming is for: no tile's inputs read ahead)
        return _plan_at(tv, shape, kind, tile, staging, bands, (kv, q), read_ahead=False)

    def fits(got):
        return got is not None and got.peak <= budget

    least = plan(STREAM_CHUNKS[-1], rows[-1])
    if not fits(least):
        return None
    found, limit = [least], len(rows)  # (a smaller chunk is worth it only with bigger bands: rows[:limit])
    for kv in STREAM_CHUNKS:
        lo, hi = 0, limit - 1  # rows[hi] fits (or it is the least); find the biggest that does
        best = plan(kv, rows[hi]) if limit else None
        if not fits(best):
            continue
        while lo < hi:  # (the peak grows with the query band)
            mid = (lo + hi) // 2
            got = plan(kv, rows[mid])
            if fits(got):
                best, hi = got, mid
            else:
                lo = mid + 1
        found.append(best)
        limit = hi  # (the same bands in smaller chunks: the same transfers, more launches)
    return min(found, key=lambda q: q.seconds)


# Key / value chunks (tokens) streamed attention tries, biggest first: at 512 channels in float16 a chunk
# of keys and values is 64 MiB at 32768 tokens (fewer merges: 6 launches a chunk), 8 MiB at 4096; every
# power of two between (a budget that misses one by a few MiB takes the next, not a chunk 8x smaller),
# the smaller ones for small budgets and latents.
STREAM_CHUNKS = (32768, 16384, 8192, 4096, 2048, 1024, 512, 64)


def place(tv, shape, kind: str, tile: int, bands, attention: tuple[int, int] = (0, 0),
          read_ahead: bool = True) -> Plan | None:
    """The "device+host" plan of a tile: staged values on the device while they fit beside what each
    segment holds (the values read soonest after they are made first: they are held the shortest for
    the transfers they save), the others in pinned host memory. None when none fits."""
    host = make_plan(tv, shape, kind, tile, "host", bands, attention=attention,  # (every read a copy)
                     read_ahead=read_ahead)
    room = [tv.memory_budget - n for n in host.segment_bytes]
    size = {s.value: s.bytes for s in host.stages}
    chosen = set()
    for v, (a, z) in sorted(host.lifetimes.items(), key=lambda kv: (kv[1][1] - kv[1][0], size[kv[0]])):
        if all(room[i] >= size[v] for i in range(a, z + 1)):
            for i in range(a, z + 1):
                room[i] -= size[v]
            chosen.add(v)
    if not chosen or len(chosen) == len(size):
        return None  # (all of them: device staging itself)
    return make_plan(tv, shape, kind, tile, "device+host", bands, on_device=frozenset(chosen),
                     attention=attention, read_ahead=read_ahead)


def _resident(plan: Plan) -> int:
    """Device bytes of a plan that no smaller tile shrinks: staged values on the device, the output."""
    return (plan.staged_peak if plan.staging == "device" else 0) + plan.output_bytes


def _no_fit(tv, best: Plan) -> ValueError:
    from ..memory import format_bytes

    return ValueError(f"no plan fits memory_budget={format_bytes(tv.memory_budget)}: the smallest "
                      f"(tile {best.tile_size}, staging {best.staging}) needs ~{format_bytes(best.peak)}; "
                      f"raise the budget or use mode='fast'")
