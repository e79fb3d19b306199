"""Which plan a run follows: tile, staging and row bands within a memory budget, for the device.

CPU plans keep the largest tile up to tile_size and the nearest staging that fit. GPU plans search from
the whole latent down, staging on the device, on the device where it fits and in pinned host memory
where it does not ("device+host", `place`), in host memory, or on disk (which of those, `run.staging`'s
`candidates` and `admits`), each with its same-shape tiles batched as far as the budget allows
(`_batched`), and take the fitting plan of least estimated time (`devices`).
"""

from __future__ import annotations

from ...locality.ops import OpKind
from ...locality.program import SegmentKind, recomputable
from ...memory import format_bytes
from ..devices import BAND_BYTES
from ..run.options import Choices
from ..run.staging import admits, candidates
from ..settings import Attention, Job, Mode, Place, Settings
from .fast_programs import staged_cuts
from .make import make_plan, request
from .memo import remembered, segments
from .records import PassKind, Plan

CPU_TILES = (128, 96, 64, 48, 32, 24, 16, 12, 8, 4)  # the tiles a CPU plan tries, biggest first
GPU_TILES = (256, 192, 128, 96, 64, 48, 32, 24, 16, 12, 8, 4)  # ... a GPU plan, below the whole latent
# Key / value chunks (tokens) streamed attention tries, biggest first: at 512 channels in float16 a chunk
# of keys and values is 64 MiB at 32768 tokens (fewer merges: 6 launches a chunk), 8 MiB at 4096; every
# power of two between (a budget that misses one by a few MiB takes the next, not a chunk 8x smaller),
# the smaller ones for small budgets and latents.
STREAM_CHUNKS = (32768, 16384, 8192, 4096, 2048, 1024, 512, 64)
# Tiles a GPU plan tries to run at a time where they have the same shape (the interior tiles of a grid),
# smallest first: each a launch per operator for the batch instead of per tile, for a working set as
# many times bigger.
TILE_BATCHES = (2, 4, 8, 16, 32, 64)
# FAST_DESCENT: a fast GPU plan tries the stagings that do not fit yet down to half the tile of the first
# that fits, no further. Its device-staged plans fit, if at all, at the tile where the sampled tiles first
# run together on the device (SD decode at 4096 px in 4 GiB: host fits at 128, device at 64); below that
# each smaller tile only adds halo work and launches, and counting a fast plan's sampled tiles costs
# CPU time with the number of tiles (SDXL decode at 4096 px within 1,686 MiB: device staging, which
# never fits there, was tried down to tiles of 4 latent px, over 15 minutes of planning).


def settle(settings: Settings, job: Job, shape: tuple[int, ...], streamed: bool = False) -> Plan:
    """The plan a run follows: tile and staging as given (no memory_budget), else within the budget.

    CPU plans: the largest tile up to tile_size, then the nearest staging, whose peak fits. GPU plans
    (`devices`; tile_size does not cap them): tiles from the whole latent down (one tile: the untiled
    run, unless `streamed` to a sink), each with device staging, then host (pinned), then disk (only
    when host memory cannot hold the staged values, or when asked), whole tiles unless only row bands
    fit; of the plans that fit, the one with the least estimated time."""
    with remembered():  # (the search counts most segments many times over)
        return _settle(settings, job, shape, streamed)


def _settle(settings: Settings, job: Job, shape: tuple[int, ...], streamed: bool) -> Plan:
    if settings.memory_budget is None:
        return make_plan(settings, job, shape, request(settings, job), untiled=not streamed)
    if job.gpu:
        return _settle_device(settings, job, shape, streamed)
    stagings = candidates(settings.staging, gpu=False, mixed=False)
    tiles = [s for s in CPU_TILES if s <= max(settings.tile_size, 4)]
    for tile in tiles:
        for st in stagings:
            plan = make_plan(settings, job, shape, request(settings, job, tile, st))
            if plan.peak <= settings.memory_budget:
                return plan
    raise _no_fit(settings, make_plan(settings, job, shape, request(settings, job, tiles[-1], stagings[-1])))


def _settle_device(settings: Settings, job: Job, shape, streamed: bool) -> Plan:
    """`settle` on a GPU: the fitting plan of least estimated time, from the biggest tile down to the
    biggest that fits with each staging (smaller tiles only add launches and halo work; in fast mode no
    further than half the tile of the first that fits, FAST_DESCENT); row bands (BAND_BYTES) only when no
    whole-tile plan fits."""
    side = max(job.program.shapes(tuple(shape[-2:]))[job.ref])
    tiles = [side] + [s for s in GPU_TILES if s < side]
    mixed = settings.mode is Mode.EXACT and settings.process_group is None
    stagings = candidates(settings.staging, gpu=True, mixed=mixed)
    search = _Search(settings, job, shape, streamed, job.profile.host_bytes())
    for bands in (None, BAND_BYTES):
        fits, settled = [], set()  # stagings that fit at a bigger tile, or at none
        for tile in tiles:
            if settings.mode is Mode.FAST and fits and 2 * tile < max(q.tile_size for q in fits):
                break  # (FAST_DESCENT)
            for st in stagings:
                if st not in settled:
                    search.visit(tile, st, bands, fits, settled)
            if settled >= set(stagings) or any(q.staging is Place.DEVICE for q in fits):
                break  # (device staging at this tile beats every staging at a smaller one)
        if fits:
            fits = [_batched(settings, job, shape, _recomputed(settings, job, shape, q)) for q in fits]
            return min(fits, key=lambda q: (q.seconds, -q.tile_size))
    raise _no_fit(settings, search.least or search.last)


def _recomputed(settings: Settings, job: Job, shape, plan: Plan) -> Plan:
    """`plan` with the staged values its time model finds cheaper to recompute than to move across the
    link (`locality.program.recompute`, `longer`: a reader remakes a value from staged ones, through
    chains of recomputed values): each recomputable value in program order, kept where the plan with it
    fits and is faster (one kept may make later ones recomputable through it), then each pair of the
    others that one segment reads (a resnet's residual and shortcut: recomputing one alone still reads
    the other's leaves). Host-staged plans on one process: exact ones, and fast ones in their exact
    latent-resolution pass, low pass and staged sampled tiles (`fast_programs.staged_cuts`: each cut with the
    `Choices` field naming its values); device staging moves nothing to save."""
    if plan.untiled or plan.staging is Place.DEVICE or settings.process_group is not None:
        return plan
    if settings.mode is Mode.EXACT:
        def cuts(choices: Choices) -> list:
            segs = segments(job.program, {}, settings.attention, choices.recompute)
            return [(segs, job.program.input, "recompute")]
    else:
        def cuts(choices: Choices) -> list:
            return staged_cuts(job, settings, choices)

    def left(choices: Choices) -> list[tuple[str, str]]:
        return [(f, v) for segs, given, f in cuts(choices) for v in recomputable(segs, given, longer=True)]

    best, tried = plan, set()
    while True:  # (values one by one, in program order)
        fv = next((fv for fv in left(best.choices) if fv not in tried), None)
        if fv is None:
            break
        tried.add(fv)
        best = _faster(settings, job, shape, best, fv[1:], fv[0])
    for segs, given, f in cuts(best.choices):  # (then pairs one segment reads: alone, neither paid)
        rest = recomputable(segs, given, longer=True)
        for i, v in enumerate(rest):
            for w in rest[i + 1:]:
                if any(v in s.inputs and w in s.inputs for s in segs) \
                        and not {v, w} & set(getattr(best.choices, f)):
                    best = _faster(settings, job, shape, best, (v, w), f)
    return best


def _faster(settings: Settings, job: Job, shape, plan: Plan, values, field: str = "recompute") -> Plan:
    """`plan` with `values` recomputed too (`Choices.recompute`, or the `field` naming them) where that
    fits and is faster, else `plan`."""
    ask = plan.choices.replace(**{field: (*getattr(plan.choices, field), *values)})
    got = _plan_at(settings, job, shape, ask)
    if got is not None and got.peak <= settings.memory_budget and got.seconds < plan.seconds:
        return got
    return plan


def _batched(settings: Settings, job: Job, shape, plan: Plan) -> Plan:
    """`plan` with its same-shape tiles run in batches (`run.batches`): of the batches in TILE_BATCHES
    that fit the budget (each a bigger working set) and launch less, the one of least estimated time (1:
    the plan)."""
    best = plan
    one = plan.untiled or settings.process_group is not None or bool(plan.choices.split)
    # (ranks run their tile rows one by one; a split value's tiles of one class differ in their rows on
    # the device)
    for n in TILE_BATCHES if not one else ():
        if n > plan.grid[0] * plan.grid[1]:
            break
        got = _plan_at(settings, job, shape, plan.choices.replace(tile_batch=n))
        if got is None or got.peak > settings.memory_budget or got.launches >= plan.launches:
            break  # (a bigger batch holds more; a batch that saves no launch: no two tiles share a shape)
        if got.seconds < best.seconds:  # (what the batch saves, not a placement re-made with the plan's
            best = got  # final choices: launches fewer)
    return best


class _Search:
    """`_settle_device`'s search: each (tile, staging, bands) planned and shrunk to the budget; the
    smallest peak tried is kept for the error when nothing fits."""

    def __init__(self, settings: Settings, job: Job, shape, streamed: bool, host: int):
        self.settings, self.job, self.shape, self.streamed, self.host = settings, job, shape, streamed, host
        self.last: Plan | None = None
        self.least: Plan | None = None

    def visit(self, tile: int, st: Place, bands, fits: list, settled: set) -> None:
        """Plan one (tile, staging, bands); a plan that fits joins `fits`; a staging that cannot do better
        at a smaller tile joins `settled`."""
        settings, job, shape, budget = self.settings, self.job, self.shape, self.settings.memory_budget
        ask = Choices(tile, st, band_bytes=bands, fast_cuts=None)
        if st is Place.MIXED:
            plan = _shrink(settings, job, shape, ask, place(settings, job, shape, ask))
            if plan is not None and plan.peak <= budget and admits(st, settings.staging, plan.staged_peak,
                                                                   self.host):
                fits.append(plan)
                settled.add(st)
            return
        last = self.last = make_plan(settings, job, shape, ask, untiled=not self.streamed)
        if last.untiled and bands:
            return  # (row bands do not apply to the untiled run)
        if not admits(st, settings.staging, last.staged_peak, self.host):
            settled.add(st)  # (disk only when host memory cannot hold the staged values)
            return
        last = self.last = _shrink(settings, job, shape, ask, last)
        if self.least is None or last.peak < self.least.peak:
            self.least = last
        if last.peak <= budget:
            fits.append(last)
            settled.add(st)  # (a smaller tile only adds launches and halo work)
        elif not last.untiled and _resident(last) > budget:
            settled.add(st)  # what a smaller tile cannot shrink exceeds the budget


def _plan_at(settings: Settings, job: Job, shape, ask: Choices) -> Plan | None:
    """The plan of some choices (MIXED staging: `place`, None when it places nothing)."""
    if ask.staging is Place.MIXED:
        return place(settings, job, shape, ask)
    return make_plan(settings, job, shape, ask)


def _shrink(settings: Settings, job: Job, shape, ask: Choices, plan: Plan | None) -> Plan | None:
    """`plan`, or where it exceeds the budget the same tile and staging with less on the device: first
    without the next tile's inputs read ahead (exact mode), then with attention's keys and values
    streamed from host memory (`_stream`)."""
    budget = settings.memory_budget
    if plan is not None and plan.peak > budget and plan.read_ahead and settings.mode is Mode.EXACT:
        plan = _plan_at(settings, job, shape, ask.replace(read_ahead=False)) or plan
    if (plan is None or plan.peak > budget) and not (plan is not None and plan.untiled) \
            and _can_stream(settings, job):
        plan = _stream(settings, job, shape, ask) or plan
    return plan


def _can_stream(settings: Settings, job: Job) -> bool:
    """Whether exact global attention could stream its keys and values (one process, exact mode)."""
    return (settings.mode is Mode.EXACT and settings.attention is Attention.GLOBAL
            and settings.process_group is None and any(op.kind is OpKind.ATTENTION for op in job.program.ops))


def _stream(settings: Settings, job: Job, shape, ask: Choices) -> Plan | None:
    """The plan of a tile and staging with global attention's keys and values in host memory (`run.
    attention`), or None when none fits: the least (kv_chunk, query_rows) first (when even that does
    not fit, the other segments do not), then for each key chunk in STREAM_CHUNKS (biggest first) the
    biggest query bands that fit, where they are bigger than a bigger chunk's; the one of least
    estimated time."""
    budget = settings.memory_budget
    h = job.program.shapes(tuple(shape[-2:]))[job.ref][0]
    rows = sorted({max(1, h >> i) for i in range(12)} | {min(ask.tile_size, h)}, reverse=True)

    def plan(kv, q):  # (the tight budgets streaming is for: no tile's inputs read ahead)
        return _plan_at(settings, job, shape, ask.replace(kv_chunk=kv, query_rows=q, read_ahead=False))

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


def place(settings: Settings, job: Job, shape, ask: Choices) -> Plan | None:
    """The "device+host" plan of some choices: some staged values on the device, the others in pinned
    host memory; of two placements (`_shortest_first`, `_spill_longest`), each also with the room left
    beside it given to the other values' first rows (`_split_rest`), the fitting one of least estimated
    time. The room is measured on the all-host plan (every read a copy) and, where `ask` places values on
    the device already (settle's recomputation and batches re-place a plan), also on the plan that keeps
    them there (their reads views: nearer what such a placement holds, but blind to the others). None
    when none places some but not all on the device."""
    hosts = [ask.replace(staging=Place.HOST, on_device=frozenset(), split=())]
    if ask.on_device:
        hosts.append(ask.replace(staging=Place.HOST, split=()))
    whole = _whole_readers(job, settings, ask)
    plans, tried = [], []
    for host in (make_plan(settings, job, shape, h) for h in hosts):
        room = [settings.memory_budget - n for n in host.segment_bytes]
        size = {s.value: s.bytes for s in host.stages}
        rows = {s.value: s.shape[-2] for s in host.stages}
        for chosen in (_shortest_first(host.lifetimes, size, room),
                       _spill_longest(host.lifetimes, size, room)):
            split = () if ask.tile_batch > 1 else \
                _split_rest(host.lifetimes, host.readers, size, rows, room, chosen, whole)
            more = frozenset(v for v, r in split if r >= rows[v])  # (all its rows fit: whole on the device)
            for on, sp in ((chosen, ()), (chosen | more, tuple((v, r) for v, r in split if v not in more))):
                if on | {v for v, _ in sp} and len(on) < len(size) and (on, sp) not in tried:
                    tried.append((on, sp))
                    plans.append(_fitted(settings, job, shape, ask.replace(staging=Place.MIXED, on_device=on,
                                                                           split=sp)))
    if not plans:
        return None
    return min(plans, key=lambda q: (q.peak > settings.memory_budget, q.seconds))  # (a tie: the first)


def _fitted(settings: Settings, job: Job, shape, ask: Choices) -> Plan:
    """The plan of a placement; where its split values' device rows overrun the budget (the room was
    measured on the all-host plan), the same with fewer of them (3/4, 1/2, 1/4, none)."""
    plan = make_plan(settings, job, shape, ask)
    for k in (3, 2, 1, 0):
        if plan.peak <= settings.memory_budget or not ask.split:
            return plan
        split = tuple((v, r * k // 4) for v, r in ask.split if r * k // 4 > 0)
        plan = make_plan(settings, job, shape, ask.replace(split=split))
    return plan


def _whole_readers(job: Job, settings: Settings, ask: Choices) -> frozenset:
    """Staged values a segment reads whole (attention's keys and values, a module run whole): not split."""
    segs = segments(job.program, {}, settings.attention, ask.recompute)
    return frozenset(v for seg in segs if seg.kind in (SegmentKind.ATTENTION, SegmentKind.WHOLE)
                     for v in seg.inputs)


def _split_rest(lifetimes, readers, size, rows, room, chosen, whole) -> tuple[tuple[str, int], ...]:
    """Split placement: the room each segment has left beside `chosen` (on the device whole) given, value
    by value, to the first rows of the others (the least room over a value's lifetime, in whole rows);
    the values that save the most per byte and segment held first (a byte on the device saves its
    write out and its read back at each segment reading it)."""
    left = list(room)
    for v in chosen:
        a, z = lifetimes[v]
        for i in range(a, z + 1):
            left[i] -= size[v]
    rest = [v for v in lifetimes if v not in chosen and v not in whole]
    rest.sort(key=lambda v: (-(1 + len(readers.get(v, ()))) / (lifetimes[v][1] - lifetimes[v][0] + 1), v))
    split = []
    for v in rest:
        a, z = lifetimes[v]
        row = size[v] // rows[v]
        r = min(rows[v], max(0, min(left[a : z + 1])) // row)
        if r:
            split.append((v, r))
            for i in range(a, z + 1):
                left[i] -= r * row
    return tuple(sorted(split))


def _shortest_first(lifetimes, size, room) -> frozenset:
    """Values on the device while they fit beside what each segment holds, the values read soonest after
    they are made first (they are held the shortest for the transfers they save)."""
    room, chosen = list(room), set()
    for v, (a, z) in sorted(lifetimes.items(), key=lambda kv: (kv[1][1] - kv[1][0], size[kv[0]])):
        if all(room[i] >= size[v] for i in range(a, z + 1)):
            for i in range(a, z + 1):
                room[i] -= size[v]
            chosen.add(v)
    return frozenset(chosen)


def _spill_longest(lifetimes, size, room) -> frozenset:
    """Values on the device but those spilled to cover each segment's shortfall, scanning the segments
    in order and spilling the values alive longest first (`records.staging_floor`'s covering, whole
    values)."""
    spilled: set[str] = set()
    for i, r in enumerate(room):
        alive = sorted((v for v, (a, z) in lifetimes.items() if a <= i <= z), key=lambda v: -lifetimes[v][1])
        short = sum(size[v] for v in alive if v not in spilled) - r
        for v in alive:
            if short <= 0:
                break
            if v not in spilled:
                spilled.add(v)
                short -= size[v]
    return frozenset(lifetimes) - spilled


def _resident(plan: Plan) -> int:
    """Device bytes of a plan that no smaller tile shrinks: staged values on the device, the output (not
    fast mode's staged sampled tiles: a smaller tile samples smaller regions, or few enough to run
    together)."""
    if plan.staging is not Place.DEVICE:
        return plan.output_bytes
    staged = [q.staged_peak for q in plan.passes if q.kind is not PassKind.SAMPLED_STAGED]
    return (max(staged, default=0) if plan.passes else plan.staged_peak) + plan.output_bytes


def _no_fit(settings: Settings, best: Plan) -> ValueError:
    return ValueError(f"no plan fits memory_budget={format_bytes(settings.memory_budget)}: the smallest "
                      f"(tile {best.tile_size}, staging {best.staging}) needs ~{format_bytes(best.peak)}; "
                      f"raise the budget or use mode='fast'")
