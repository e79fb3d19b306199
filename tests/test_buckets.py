"""Bucket sets, assignment policies (pad / resize / crop / auto), masks, micro-conditioning, batching."""

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st
from PIL import Image

from tilewise.buckets import BucketPlanner, batch_by_bucket, grid_buckets

F = 8  # latent factor
SIDES = st.integers(8, 160)
BUCKETS = [(64, 64), (96, 64), (64, 96), (128, 64), (64, 128), (160, 96), (96, 160), (128, 128), (192, 64)]
PLANNER = BucketPlanner(buckets=BUCKETS, step=32, max_aspect=3)


def rand_image(kind, w, h, seed=0):
    """A random image of one kind: numpy float32 HWC, torch (1, 3, H, W), or PIL RGB."""
    rng = np.random.default_rng(seed)
    if kind == "numpy":
        return rng.random((h, w, 3), dtype=np.float32)
    if kind == "torch":
        return torch.from_numpy(rng.random((1, 3, h, w), dtype=np.float32))
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def hw(image):
    """(height, width) of any of the three kinds."""
    if isinstance(image, Image.Image):
        return image.size[1], image.size[0]
    return tuple(image.shape[-2:]) if isinstance(image, torch.Tensor) else tuple(image.shape[:2])


def as_np(image):
    """HWC numpy view of any kind."""
    if isinstance(image, Image.Image):
        return np.asarray(image)
    if isinstance(image, torch.Tensor):
        return image[0].permute(1, 2, 0).numpy()
    return image


def smooth(w, h):
    """Low-frequency HWC float image (resampling error on it is small and measurable)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    return np.stack(
        [0.5 + 0.4 * np.sin(2 * np.pi * x / w), 0.5 + 0.4 * np.cos(2 * np.pi * y / h), (x + y) / (w + h)], -1
    )


# ---- bucket sets --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "area,step,lo,hi,aspect",
    [(1024**2, 64, 256, 2048, 4.0), (256**2, 16, 64, 512, 4.0), (512**2, 64, 64, 1024, 2.0)],
)
def test_grid_matches_brute_force(area, step, lo, hi, aspect):
    """The grid is the set of (w, tallest h) pairs under the budget, both orientations, within max_aspect."""
    sides = range(lo, hi + 1, step)
    tallest = {w: max((h for h in sides if w * h <= area), default=None) for w in sides}
    expect = {(w, h) for w, h in tallest.items() if h is not None and max(w, h) / min(w, h) <= aspect}
    expect |= {(h, w) for w, h in expect}
    got = BucketPlanner(area=area, step=step, min_side=lo, max_side=hi, max_aspect=aspect).buckets
    assert set(got) == expect == set(grid_buckets(area, step, lo, hi, aspect))
    assert all(w % step == 0 and h % step == 0 and w * h <= area for w, h in got)


def test_kohya_sdxl_grid_contains_known_buckets():
    """Known buckets of the SDXL 1024^2 / step 64 grid are present; none exceeds the area budget."""
    got = set(BucketPlanner(area=1024**2, step=64, min_side=256, max_side=2048).buckets)
    assert {(1024, 1024), (832, 1216), (1216, 832), (896, 1152), (512, 2048)} <= got


@pytest.mark.parametrize(
    "batch_sizes,guidance,ns",
    [((1, 2), 1.0, {1, 2}), ((1, 2), 7.5, {2, 4}), ((2, 1, 2), 5.0, {2, 4}), ((4,), 1.0, {4})],
)
def test_compiled_shapes_cfg_doubles(batch_sizes, guidance, ns):
    """One shape per (batch after CFG doubling, bucket), in latent units."""
    shapes = PLANNER.shapes(batch_sizes, guidance)
    assert set(shapes) == {(n, h // F, w // F) for n in ns for (w, h) in BUCKETS}
    assert PLANNER.num_shapes(batch_sizes, guidance) == len(ns) * len(BUCKETS)


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(buckets=[(100, 64)], step=64), ["(100, 64)", "step=64"]),
        (dict(buckets=[(0, 64)], step=64), ["bucket width", "0"]),
        (dict(buckets=[(64, -64)], step=64), ["bucket height", "-64"]),
        (dict(area=1024**2, step=60), ["step=60", "latent_factor=8"]),
        (dict(area=0), ["area", "0"]),
        (dict(area=1024**2, min_side=2048, max_side=1024), ["min_side=2048", "max_side=1024"]),
        (dict(area=1024**2, min_side=100), ["min_side=100", "step=64"]),
        (dict(area=64**2, min_side=128, max_side=128), ["area=4096", "min_side=128"]),
        (dict(buckets=[(512, 64)], step=64, max_aspect=4), ["(512, 64)", "max_aspect=4"]),
        (dict(area=1024**2, buckets=[(64, 64)]), ["area=1048576", "buckets="]),
        (dict(area=1024**2, max_aspect=0.5), ["max_aspect", "0.5"]),
    ],
)
def test_bad_planner_input_names_values(kwargs, words):
    """Bad bucket sets raise ValueError quoting the bad values."""
    with pytest.raises(ValueError) as e:
        BucketPlanner(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


# ---- assignment: shapes and inverses ------------------------------------------------------------
@pytest.mark.parametrize("kind", ["numpy", "torch", "pil"])
@given(w=SIDES, h=SIDES)
def test_pad_apply_size_restore_exact(kind, w, h):
    """pad: apply gives the bucket size, restore the request size; restore(apply(x)) == x bit for bit."""
    assume(any(bw >= w and bh >= h for bw, bh in BUCKETS))
    a = PLANNER.assign(w, h, "pad")
    x = rand_image(kind, w, h, seed=w * 1000 + h)
    y = a.apply(x)
    assert hw(y) == (a.bucket[1], a.bucket[0])
    r = a.restore(y)
    assert hw(r) == (h, w) and type(r) is type(x)
    np.testing.assert_array_equal(as_np(r), as_np(x))
    assert not a.cut_mask.any() and a.cut_fraction == 0


@given(w=SIDES, h=SIDES, offset=st.sampled_from(["center", "top-left"]))
def test_pad_masks_cover_exactly_the_padding(w, h, offset):
    """pixel_mask is True exactly where apply() wrote fill; the latent mask is its f x f block mean."""
    assume(any(bw >= w and bh >= h for bw, bh in BUCKETS))
    a = PLANNER.assign(w, h, "pad", offset=offset)
    y = a.apply(np.ones((h, w), dtype=np.float32))
    np.testing.assert_array_equal(a.pixel_mask, y == 0)
    assert a.pixel_mask.sum() == a.padded_pixels == a.bucket[0] * a.bucket[1] - w * h
    m = a.mask
    assert m.shape == (a.bucket[1] // F, a.bucket[0] // F)
    block = a.pixel_mask.reshape(m.shape[0], F, m.shape[1], F).mean(axis=(1, 3))
    np.testing.assert_allclose(m, block, atol=0)
    assert abs(m.sum() * F * F - a.padded_pixels) < 1e-3
    if (
        w % F == 0 and h % F == 0
    ):  # aligned content: the latent mask is binary and upsamples to the pixel mask
        assert set(np.unique(m)) <= {0.0, 1.0}
        np.testing.assert_array_equal(np.kron(m, np.ones((F, F))) == 1, a.pixel_mask)


@pytest.mark.parametrize("fit", ["cover", "inside"])
@given(w=st.integers(24, 160), h=st.integers(24, 160))
def test_resize_inverse_within_resampling_error(fit, w, h):
    """resize: exact sizes; restore(apply(x)) ~ x on the kept window (cover) or everywhere (inside)."""
    a = PLANNER.assign(w, h, "resize", fit=fit, max_aspect_error=10)
    x = smooth(w, h)
    y = a.apply(x)
    assert y.shape == (a.bucket[1], a.bucket[0], 3) and y.dtype == np.float32
    r = a.restore(y)
    assert r.shape == (h, w, 3)
    y0, y1, x0, x1 = a.window
    keep = ~a.cut_mask
    assert keep[y0:y1, x0:x1].all() and keep.sum() == (y1 - y0) * (x1 - x0)
    assert (r[a.cut_mask] == 0).all()
    inner = keep.copy()  # resampling error is largest on the outermost pixels of the window; skip 2 px
    inner[: y0 + 2], inner[y1 - 2 :], inner[:, : x0 + 2], inner[:, x1 - 2 :] = False, False, False, False
    err = np.abs(r - x)[inner]
    assert err.size == 0 or err.max() < 0.06, err.max()
    if fit == "inside":
        assert not a.cut_mask.any() and a.aspect_error <= 10
        assert a.resized[0] <= a.bucket[0] and a.resized[1] <= a.bucket[1]
    else:
        assert a.resized[0] >= a.bucket[0] and a.resized[1] >= a.bucket[1] and a.pad_fraction == 0
        assert a.resized[0] == a.bucket[0] or a.resized[1] == a.bucket[1]  # the binding side fits exactly


@given(w=st.integers(64, 400), h=st.integers(64, 400), dy=st.integers(0, 400), dx=st.integers(0, 400))
def test_crop_restores_kept_window_exactly(w, h, dy, dx):
    """crop: no resampling; restore puts the kept window back exactly and flags the rest in cut_mask."""
    a = PLANNER.assign(w, h, "crop")
    bw, bh = a.bucket
    assert bw <= w and bh <= h and a.resized == (w, h)
    top, left = dy % (h - bh + 1), dx % (w - bw + 1)
    a = PLANNER.assign(w, h, "crop", offset=(top, left), bucket=a.bucket)
    x = rand_image("torch", w, h, seed=dy)
    y = a.apply(x)
    np.testing.assert_array_equal(y.numpy(), x[..., top : top + bh, left : left + bw].numpy())
    r = a.restore(y)
    m = torch.from_numpy(a.cut_mask)
    assert torch.equal(r[..., ~m], x[..., ~m]) and (r[..., m] == 0).all()
    assert int((~m).sum()) == bw * bh
    assert a.micro_conditioning == {
        "original_size": (h, w),
        "crops_coords_top_left": (top, left),
        "target_size": (bh, bw),
    }


# ---- micro-conditioning and crop axes ------------------------------------------------------------
def test_kohya_1443_example_top16_left0():
    """800x1200 (w x h) -> resized 832x1248 -> centre crop 832x1216: trimmed 16 px at the top, left 0."""
    p = BucketPlanner(area=1024**2, step=64, min_side=256, max_side=2048)
    a = p.assign(800, 1200, "resize")
    assert a.bucket == (832, 1216) and a.resized == (832, 1248)
    assert a.micro_conditioning == {
        "original_size": (1200, 800),
        "crops_coords_top_left": (16, 0),
        "target_size": (1216, 832),
    }
    text = a.explain()
    assert "16 at the top" in text and "crops_coords_top_left=(16, 0)" in text and "1.0400" in text


def coord_image(w, h):
    """HWC float64 image whose channels are the normalised row and column centre coordinates."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    return np.stack([(y + 0.5) / h, (x + 0.5) / w], -1)


@given(w=st.integers(32, 300), h=st.integers(32, 300))
def test_crop_coordinates_on_the_right_axes(w, h):
    """Portrait and landscape: the cropped axis is the overflowing one; content starts at (top, left)."""
    a = PLANNER.assign(w, h, "resize", max_aspect_error=10, bucket=(128, 128) if w != h else None)
    (bw, bh), (rw, rh) = a.bucket, a.resized
    top, left = a.micro_conditioning["crops_coords_top_left"]
    assert (top > 0) <= (rh > bh) and (left > 0) <= (rw > bw)
    assert top == (rh - bh) // 2 and left == (rw - bw) // 2
    if a.bucket == (128, 128):  # square bucket: portrait crops rows only, landscape columns only
        assert (left == 0) if h > w else (top == 0)
    y = a.apply(coord_image(w, h).astype(np.float32))
    m = 2 + 3 * int(np.ceil(max(a.scale)))  # bicubic support, in output pixels, at the resized border
    r, c = (
        np.arange(max(0, m - top), min(bh, rh - m - top)),
        np.arange(max(0, m - left), min(bw, rw - m - left)),
    )
    rows_ok = np.abs(y[r, bw // 2, 0] - (r + top + 0.5) / rh).max(initial=0)
    cols_ok = np.abs(y[bh // 2, c, 1] - (c + left + 0.5) / rw).max(initial=0)
    assert rows_ok < 2e-3 and cols_ok < 2e-3, (rows_ok, cols_ok)


@given(w=SIDES, h=SIDES, policy=st.sampled_from(["pad", "resize"]), fit=st.sampled_from(["cover", "inside"]))
def test_micro_conditioning_matches_what_apply_did(w, h, policy, fit):
    """original = request (h, w); target = content size in the bucket; crop window inside the resized."""
    try:
        a = PLANNER.assign(w, h, policy, fit=fit, max_aspect_error=10)
    except ValueError:
        assert policy == "pad" and not any(bw >= w and bh >= h for bw, bh in BUCKETS)
        return
    mc = a.micro_conditioning
    y0, y1, x0, x1 = a.content_box
    assert mc["original_size"] == (h, w) and mc["target_size"] == (y1 - y0, x1 - x0)
    top, left = mc["crops_coords_top_left"]
    assert 0 <= top <= a.resized[1] - (y1 - y0) and 0 <= left <= a.resized[0] - (x1 - x0)
    assert "micro-conditioning" in a.explain()


# ---- auto and errors ----------------------------------------------------------------------------
def test_auto_picks_cheapest_admissible_policy():
    """auto: pad when its padding is within bounds and it is cheapest; resize when pad pads too much."""
    p = BucketPlanner(buckets=[(64, 64), (128, 128), (128, 64)], step=64)
    a = p.assign(60, 60, "auto")
    assert (a.policy, a.bucket) == ("pad", (64, 64))
    a = p.assign(100, 40, "auto", max_pad_fraction=0.25)  # pad into 128x64 pads 51%: resize into 128x64
    assert (a.policy, a.fit, a.bucket) == ("resize", "cover", (128, 64))
    cheap_big = BucketPlanner(buckets=[(64, 64), (128, 128)], step=64, costs={(64, 64): 5.0, (128, 128): 1.0})
    assert cheap_big.assign(60, 60, "auto", max_pad_fraction=0.9).bucket == (128, 128)  # measured cost rules
    with pytest.raises(ValueError, match="max_pad_fraction=0.01"):
        p.assign(100, 40, "auto", max_pad_fraction=0.01, max_aspect_error=0.01)


@given(w=SIDES, h=SIDES, max_pf=st.sampled_from([0.1, 0.3, 0.6]), max_ae=st.sampled_from([0.05, 0.3, 2.0]))
@example(w=128, h=84, max_pf=0.3, max_ae=0.05)  # (padded to 160x96: exactly 0.3 padded, admitted)
def test_auto_equals_enumeration(w, h, max_pf, max_ae):
    """auto's cost equals the minimum over every admissible (policy, bucket) option, enumerated here."""
    g = torch.Generator().manual_seed(w * 1000 + h)
    costs = {b: float(torch.rand((), generator=g)) for b in BUCKETS}
    p = BucketPlanner(buckets=BUCKETS, step=32, max_aspect=3, costs=costs)
    options = [  # (the padded fraction as the planner defines it: padded / bucket positions)
        (costs[b], 0) for b in BUCKETS
        if b[0] >= w and b[1] >= h and (b[0] * b[1] - w * h) / (b[0] * b[1]) <= max_pf
    ]
    ar = w / h
    nearest = min(
        BUCKETS, key=lambda b: (max(b[0] / b[1] / ar, ar * b[1] / b[0]), abs(np.log(b[0] * b[1] / (w * h))))
    )
    if max(nearest[0] / nearest[1] / ar, ar * nearest[1] / nearest[0]) - 1 <= max_ae:
        options.append((costs[nearest], 1))
    if not options:
        with pytest.raises(ValueError, match="policy='auto' found no assignment"):
            p.assign(w, h, "auto", max_pad_fraction=max_pf, max_aspect_error=max_ae)
        return
    a = p.assign(w, h, "auto", max_pad_fraction=max_pf, max_aspect_error=max_ae)
    best = min(options)
    assert (costs[a.bucket], {"pad": 0, "resize": 1}[a.policy]) == best
    assert a.pad_fraction <= max_pf if a.policy == "pad" else a.aspect_error <= max_ae


@pytest.mark.parametrize(
    "args,kwargs,words",
    [
        ((0, 64, "pad"), {}, ["width", "0"]),
        ((64, -3, "pad"), {}, ["height", "-3"]),
        ((300, 20, "pad"), {}, ["300x20", "15.00", "max_aspect=3"]),
        ((600, 20, "resize"), {}, ["600x20", "max_aspect_error=0.25", "aspects up to 3.0"]),
        ((30, 30, "crop"), {}, ["30x30", "crop"]),
        ((64, 64, "stretch"), {}, ["stretch", "pad"]),
        ((64, 64, "resize"), {"fit": "fill"}, ["fill", "cover"]),
        ((40, 40, "pad"), {"offset": (50, 0)}, ["(50, 0)", "[0, 24]"]),
        ((40, 40, "pad"), {"offset": "middle"}, ["middle"]),
        ((40, 40, "pad"), {"bucket": (32, 32)}, ["(32, 32)"]),
    ],
)
def test_bad_assign_input_names_values(args, kwargs, words):
    """Bad requests raise ValueError quoting the values and what would be valid."""
    with pytest.raises(ValueError) as e:
        PLANNER.assign(*args, **kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_bad_images_are_rejected():
    """apply/restore check the image size; unknown image types are named."""
    a = PLANNER.assign(40, 50, "pad")
    with pytest.raises(ValueError, match="40x50.*got 50x40"):
        a.apply(np.zeros((40, 50, 3)))
    with pytest.raises(ValueError, match=r"restore\(\) expects a 64x64"):
        a.restore(torch.zeros(3, 50, 40))
    with pytest.raises(ValueError, match="list"):
        a.apply([[0.0] * 40] * 50)


def test_dtypes_and_layouts_survive_resize():
    """Resize keeps the kind and dtype: uint8 numpy HWC, bf16 torch (..., C, H, W), PIL grayscale."""
    a = PLANNER.assign(50, 70, "resize", fit="inside")
    y = a.apply(np.full((70, 50, 3), 200, dtype=np.uint8))
    assert y.dtype == np.uint8 and y.shape == (a.bucket[1], a.bucket[0], 3)
    assert (a.restore(y) == 200).all()  # constant content survives both resamplings exactly
    t = a.apply(torch.ones(2, 4, 70, 50, dtype=torch.bfloat16))
    assert t.dtype == torch.bfloat16 and t.shape == (2, 4, a.bucket[1], a.bucket[0])
    g = a.apply(Image.new("L", (50, 70), 9))
    assert g.mode == "L" and g.size == a.bucket and a.restore(g).size == (50, 70)


# ---- batching -----------------------------------------------------------------------------------
@given(
    reqs=st.lists(st.tuples(st.integers(8, 160), st.integers(8, 128)), min_size=0, max_size=40),
    batch=st.integers(1, 5),
    guidance=st.sampled_from([1.0, 7.5]),
)
def test_batching_keeps_every_request_once(reqs, batch, guidance):
    """Each request exactly once, one bucket per batch, short batches kept and flagged, totals exact."""
    reqs = [(w, h) for w, h in reqs if any(bw >= w and bh >= h for bw, bh in BUCKETS)]
    plan = batch_by_bucket(reqs, PLANNER, batch, guidance=guidance)
    idx = [i for b in plan for i in b.indices]
    assert sorted(idx) == list(range(len(reqs)))
    per_bucket = {}
    for b in plan:
        assert 1 <= len(b) <= batch and b.short == (len(b) < batch)
        assert all(a.bucket == b.bucket for a in b.assignments)
        assert [a.request for a in b.assignments] == [tuple(reqs[i]) for i in b.indices]
        per_bucket.setdefault(b.bucket, []).append(len(b))
    for sizes in per_bucket.values():  # only the last batch of a bucket may be short
        assert all(s == batch for s in sizes[:-1])
    assert sum(s for sizes in per_bucket.values() for s in sizes) == len(reqs)
    assign = [PLANNER.assign(w, h, "pad") for w, h in reqs]
    total = sum(a.bucket[0] * a.bucket[1] for a in assign)
    pad = sum(a.bucket[0] * a.bucket[1] - a.request[0] * a.request[1] for a in assign)
    assert plan.padding_fraction == pytest.approx(pad / total if total else 0.0, abs=1e-12)
    cfg = 2 if guidance > 1 else 1
    assert plan.num_shapes == len({(len(b) * cfg, b.bucket[1] // F, b.bucket[0] // F) for b in plan})
    assert f"{len(reqs)} requests" in plan.summary()


def test_batching_reports_short_batches():
    """5 requests in one bucket at batch 2: batches of 2, 2, 1, the last flagged short and its own shape."""
    plan = batch_by_bucket([(60, 60)] * 5 + [(120, 120)], PLANNER, 2, guidance=7.5)
    assert [(b.bucket, b.indices, b.short) for b in plan] == [
        ((64, 64), (0, 1), False),
        ((64, 64), (2, 3), False),
        ((64, 64), (4,), True),
        ((128, 128), (5,), True),
    ]
    assert plan.shapes == [(2, 8, 8), (2, 16, 16), (4, 8, 8)]
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        batch_by_bucket([(60, 60)], PLANNER, 0)
    with pytest.raises(ValueError, match="request 1"):
        batch_by_bucket([(60, 60), 7], PLANNER, 2)
