"""Where fast mode cuts a program, and its low pass: shared by the run (`fast.run`) and its plan.

The sampled-tile estimator cuts the program where one value crosses (`fast_split`): decode before the
first upsampling, encode after the last downsampling. The latent-resolution part runs exact; the
high-resolution part (the estimated part) may be cut again into pieces at its resolution changes
(`piece_cuts`, `split_pieces`); its statistics are corrected by a `low` times smaller low pass
(`low_pass`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ...locality.ops import OpKind
from ...locality.program import Program
from ..settings import Estimator, FastSettings, Kind, Mode


def fixed_ops(p: Program, kind: Kind, color_fix: bool) -> set[int]:
    """GroupNorms whose statistics fast mode estimates (color_fix: only before the first downsampling)."""
    ops = set()
    for op in p.ops:
        if kind is Kind.ENCODE and color_fix and op.kind is OpKind.CONV and op.stride[0] > 1:
            break
        if op.kind is OpKind.GROUP_NORM:
            ops.add(id(op))
    return ops


def fast_split(p: Program, kind: Kind, mode: Mode, fast: FastSettings) -> int | None:
    """Where fast mode with the sampled-tile estimator cuts the program (None: exact mode, or the crop
    estimator).

    Decode: before the first upsampling (the latent-resolution head runs exact, the high-resolution
    tail is estimated). Encode: after the last downsampling (the high-resolution head is estimated, the
    latent-resolution tail with the mid-block attention runs exact); not with color_fix, which
    estimates only before the first downsampling. The cut needs one value crossing it, GroupNorms and no
    attention in the estimated part.
    """
    if mode is not Mode.FAST or fast.estimator is not Estimator.TILES:
        return None
    if kind is Kind.ENCODE and fast.color_fix:
        return None
    if kind is Kind.DECODE:
        k = next((i for i, op in enumerate(p.ops) if op.kind is OpKind.RESAMPLE), None)
    else:
        down = [i for i, op in enumerate(p.ops) if op.kind is OpKind.CONV and op.stride[0] > 1]
        k = down[-1] + 1 if down else None
    if k is None or k == 0 or k >= len(p.ops) or len(crossing(p, k)) != 1:
        return None
    part = p.ops[k:] if kind is Kind.DECODE else p.ops[:k]
    kinds = {op.kind for op in part}
    if OpKind.ATTENTION in kinds or OpKind.WHOLE in kinds or OpKind.GROUP_NORM not in kinds:
        return None
    return k


def estimated_part(p: Program, k: int, kind: Kind) -> Program:
    """The part of p fast mode estimates, cut at k: decode's tail, encode's head."""
    first, second = split_program(p, k)
    return second if kind is Kind.DECODE else first


def piece_cuts(p: Program, kind: Kind, mode: Mode, fast: FastSettings) -> tuple[int, ...]:
    """Where fast mode's estimated part may be cut into pieces (positions in it): at its resolution
    changes, on the lower-resolution side (decode: before an upsampling; encode: after a downsampling),
    where one value crosses. () without the sampled-tile estimator."""
    k = fast_split(p, kind, mode, fast)
    if k is None:
        return ()
    part = estimated_part(p, k, kind)
    if kind is Kind.DECODE:
        found = [i for i, op in enumerate(part.ops) if op.kind is OpKind.RESAMPLE and i > 0]
    else:
        found = [i + 1 for i, op in enumerate(part.ops[:-1]) if op.kind is OpKind.CONV and op.stride[0] > 1]
    return tuple(i for i in found if len(crossing(part, i)) == 1)


def split_pieces(part: Program, cuts: tuple[int, ...]) -> list[Program]:
    """part cut before each position in `cuts` (increasing; one value crossing each)."""
    pieces, rest, at = [], part, 0
    for c in cuts:
        head, rest = split_program(rest, c - at)
        pieces.append(head)
        at = c
    pieces.append(rest)
    if len(pieces) == 1:
        return pieces
    return [dataclasses.replace(q, name=f"{part.name}[piece {j + 1} of {len(pieces)}]")
            for j, q in enumerate(pieces)]


def recomputed_in(piece: Program, values) -> tuple[str, ...]:
    """Those of `values` (a fast plan's recomputed values, `Choices.recompute`) that `piece` makes: each
    pass that recomputes (the exact latent-resolution pass, each piece's staged sampled tiles) its own."""
    made = {op.dst for op in piece.ops}
    return tuple(v for v in values if v in made)


def piece_grid(piece: Program, shapes, ref: str, tile: int, kind: Kind) -> tuple[str, int]:
    """A piece's reference value, its lower-resolution end (decode: its input; encode: its output), and
    the tile in its pixels: the part's tile scaled by that value's size over the part's reference."""
    v = piece.input if kind is Kind.DECODE else piece.output
    return v, tile * shapes[v][0] // shapes[ref][0]


def crossing(p: Program, k: int) -> set[str]:
    """Values made before op k (or p's input) that ops from k on read."""
    made = {op.dst for op in p.ops[:k]} | {p.input}
    return {s for op in p.ops[k:] for s in op.src if s in made}


def split_program(p: Program, k: int) -> tuple[Program, Program]:
    """p cut before op k, where one value crosses (decode: the first upsampling's input, between the
    latent-resolution head and the high-resolution tail; encode: the last downsampling's output)."""
    (cut,) = crossing(p, k)
    up = p.ops[k].kind is OpKind.RESAMPLE
    head = Program(ops=p.ops[:k], input=p.input, output=cut, in_channels=p.in_channels,
                   name=p.name + ("[low-res]" if up else "[high-res]"))
    tail = Program(ops=p.ops[k:], input=cut, output=p.output, in_channels=head.channels()[cut],
                   name=p.name + ("[high-res]" if up else "[low-res]"))
    return head, tail


def low_pass(kind: Kind, part: Program, x, ref: str, low: int, factor: int):
    """(program, input, reference value) of the low pass, `low` times smaller than the part; x may be a
    shape (planning). Decode: the reduction is taken out of the upsampling ops (nearest x2 becomes x1,
    `low_program`), what they cannot absorb is average-pooled out of the input. Encode: the image is
    resized down (antialiased) to multiples of `factor`, the VAE's image pixels per latent pixel."""
    tensor = isinstance(x, torch.Tensor)
    shape = tuple(x.shape) if tensor else tuple(x)
    if kind is Kind.DECODE:
        small, left = low_program(part, low)
        size = (-(-shape[-2] // left), -(-shape[-1] // left))  # avg_pool2d with ceil_mode
        if tensor and left > 1:
            x = F.avg_pool2d(x, left, ceil_mode=True)
        return small, (x if tensor else (*shape[:2], *size)), small.input
    size = tuple(max(factor, round(d / low / factor) * factor) for d in shape[-2:])
    if tensor:
        x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
    return part, (x if tensor else (*shape[:2], *size)), ref


def low_program(tail: Program, factor: int) -> tuple[Program, int]:
    """The tail run `factor` times smaller: upsamplings reduced (nearest x2 -> x1) as far as they absorb
    the factor; returns it and the factor left over (by which its input is average-pooled).

    (Stopping it before the last upsampling saves a third of its time, but the GroupNorms after it then
    lack the correction: measured at 1024 px with half the tiles sampled, max error 0.028 -> 0.039 on
    the SD-architecture VAE, 0.30 -> 1.40 on the narrow test model; so the whole tail runs.)
    """
    left, ops = factor, []
    for op in tail.ops:
        if op.kind is OpKind.RESAMPLE and left > 1:
            d = math.gcd(op.scale, left)
            left //= d
            op = dataclasses.replace(op, scale=op.scale // d)
        ops.append(op)
    small = Program(ops=ops, input=tail.input, output=tail.output, in_channels=tail.in_channels,
                    name=tail.name + "[low pass]")
    return small, left
