"""Executor: exact tiled runs of lowered programs equal the untiled module."""

import pytest

torch = pytest.importorskip("torch")

from vae_support import kl_vae, structured_latent  # noqa: E402

from tilewise.locality import lower  # noqa: E402
from tilewise.locality.boxes import map_box  # noqa: E402
from tilewise.vae.run.executor import Executor, NonFiniteError, all_finite  # noqa: E402
from tilewise.vae.run.options import RunOptions  # noqa: E402
from tilewise.vae.run.stats import GroupStats  # noqa: E402


def test_chan_merge_equals_whole_tensor_statistics():
    x = torch.randn(2, 8, 13, 11, dtype=torch.float64) * 3 + 1
    acc = GroupStats(4)
    for y0, y1 in ((0, 5), (5, 6), (6, 13)):
        for x0, x1 in ((0, 7), (7, 11)):
            acc.add(x[..., y0:y1, x0:x1])
    mean, var = acc.result()
    g = x.view(2, 4, -1)
    assert torch.allclose(mean, g.mean(-1), atol=1e-12)
    assert torch.allclose(var, g.var(-1, unbiased=False), atol=1e-12)



@pytest.mark.parametrize("chunk", [0, 1 << 20])
def test_statistics_read_then_added_to_merge_like_the_whole(chunk):
    x = torch.randn(2, 16, 12, 9, dtype=torch.float64) * 2 + 3
    acc = GroupStats(4, chunk)
    acc.add(x[..., :5, :].float())
    first = acc.result()[0].clone()  # (merged once: the later parts join its float64 moments)
    acc.add(x[..., 5:, :4].float())
    acc.add(x[..., 5:, 4:].float())
    mean, var = acc.result()
    var64, mean64 = torch.var_mean(x.float().double().view(2, 4, -1), dim=-1, correction=0)
    assert acc.n == 4 * 12 * 9 and not torch.equal(first, mean)
    assert torch.allclose(mean, mean64, rtol=0, atol=1e-6) and torch.allclose(var, var64, rtol=1e-6, atol=0)
    assert torch.equal(acc.stacked, torch.stack((mean, var))) and torch.allclose(acc.m2, var * acc.n)


@pytest.mark.parametrize("dtype,layout", [(torch.float32, torch.contiguous_format), (torch.float16,
                                          torch.contiguous_format), (torch.float32, torch.channels_last)])
def test_float_tile_statistics_are_accurate_with_a_large_offset(dtype, layout):
    x = torch.randn(2, 64, 37, 41, generator=torch.Generator().manual_seed(3)) * 0.5 + 300
    x = x.to(dtype).contiguous(memory_format=layout)
    acc = GroupStats(8)
    for x0, x1 in ((0, 20), (20, 41)):
        acc.add(x[..., x0:x1])  # non-contiguous column slices
    mean, var = acc.result()
    var64, mean64 = torch.var_mean(x.double().reshape(2, 8, -1), dim=-1, correction=0)
    assert torch.allclose(mean, mean64, rtol=0, atol=1e-5)
    assert torch.allclose(var, var64, rtol=1e-5, atol=0)


def test_finite_check_uses_the_sum_and_survives_its_overflow():
    x = torch.full((1, 2, 4, 4), 3e38)  # finite values whose float32 sum overflows
    assert all_finite(x)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = torch.zeros(1, 2, 4, 4, dtype=torch.float16)
        y[0, 1, 2, 3] = bad
        assert not all_finite(y) and not all_finite(x.clone().index_fill_(3, torch.tensor([1]), bad))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 0.05)])
def test_group_norm_with_given_statistics_equals_torch(dtype, tol):
    from tilewise.locality.affine import apply_group_norm

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 12, 9, 7, generator=g) * 2 + 4).to(dtype)
    w, b = torch.randn(12, generator=g), torch.randn(12, generator=g)
    var, mean = torch.var_mean(x.double().view(2, 3, -1), dim=-1, correction=0)
    y = apply_group_norm(x[..., 1:5, 2:6], (mean, var), 3, 1e-6, w, b)  # a non-contiguous box
    ref = torch.nn.functional.group_norm(x.float(), 3, w, b, 1e-6)[..., 1:5, 2:6]
    assert y.dtype == dtype and (y.float() - ref).abs().max() <= tol


@pytest.mark.parametrize("params", ["none", "weight", "both"])
def test_group_norm_affine_without_weight_or_bias_equals_torch(params):
    from tilewise.locality.affine import apply_group_norm

    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 12, 9, 7, generator=g) * 2 + 4
    w = torch.randn(12, generator=g) if params != "none" else None
    b = torch.randn(12, generator=g) if params == "both" else None
    var, mean = torch.var_mean(x.double().view(2, 3, -1), dim=-1, correction=0)
    y = apply_group_norm(x, (mean, var), 3, 1e-6, w, b)
    assert (y - torch.nn.functional.group_norm(x, 3, w, b, 1e-6)).abs().max() <= 2e-5


def test_map_box_partitions():
    edges = [map_box((0, y, 0, 1), (13, 1), (104, 1))[1] for y in range(14)]
    assert edges == [8 * y for y in range(14)]


@pytest.mark.parametrize("shape,tile,staging", [((1, 4, 13, 17), 5, "device"), ((2, 4, 7, 11), 3, "host"),
                                                ((1, 4, 1, 9), 2, "disk"), ((1, 4, 5, 3), 8, "device")])
def test_exact_decoder_and_encoder_match_untiled(shape, tile, staging):
    vae = kl_vae("sd")
    with torch.no_grad():
        z = structured_latent(*shape)
        p = lower(vae.decoder)
        out = Executor(p, tile, p.input, RunOptions(staging=staging, progress=False)).run(z).output
        assert (out - vae.decoder(z)).abs().max() <= 1e-4
        x = torch.randn(shape[0], 3, 8 * shape[2], 8 * shape[3], generator=torch.Generator().manual_seed(1))
        p = lower(vae.encoder)
        out = Executor(p, tile, p.output, RunOptions(staging=staging, progress=False)).run(x).output
        assert (out - vae.encoder(x)).abs().max() <= 1e-4


@pytest.mark.parametrize("kind,channels,band,emits", [("sd3", 16, None, None), ("sd", 4, 1, 9 * 2)])
def test_streaming_emit_covers_output_exactly_once(kind, channels, band, emits):
    # band_bytes=1: one emit per latent row of each tile (9 rows, 2 tile columns)
    vae = kl_vae(kind)
    z = structured_latent(1, channels, 9, 7)
    p = lower(vae.decoder)
    f = p.shapes((9, 7))[p.output][0] // 9
    got = torch.full((1, 3, 9 * f, 7 * f), float("nan"))
    seen = torch.zeros(9 * f, 7 * f)
    boxes = []

    def emit(box, value):
        got[..., box[0]:box[1], box[2]:box[3]] = value
        seen[box[0]:box[1], box[2]:box[3]] += 1
        boxes.append(box)

    with torch.no_grad():
        ex = Executor(p, 4, p.input, RunOptions(band_bytes=band, progress=False))
        assert ex.run(z, emit=emit).output is None
        assert bool((seen == 1).all())
        assert emits is None or len(boxes) == emits
        assert (got - vae.decoder(z)).abs().max() <= 1e-4


def test_non_finite_output_names_the_stage():
    vae = kl_vae("sd3")
    p = lower(vae.decoder)
    z = torch.zeros(1, 16, 6, 6)
    z[0, 0, 2, 2] = float("inf")
    with torch.no_grad(), pytest.raises(NonFiniteError, match="conv_in.*float32"):
        Executor(p, 3, p.input, RunOptions(progress=False)).run(z)


def test_row_banded_convolutions_stay_exact():
    vae = kl_vae("sd3")
    z = structured_latent(1, 16, 7, 9)
    p = lower(vae.decoder)
    with torch.no_grad():
        out = Executor(p, 4, p.input, RunOptions(conv_workspace=1, progress=False)).run(z).output
        assert (out - vae.decoder(z)).abs().max() <= 1e-4


def _conv_rows(monkeypatch) -> list:
    """Record the output rows x columns every convolution computes."""
    from tilewise.locality.ops import Conv

    work, run = [], Conv.run

    def counted(self, ctx, inputs, have, box, shapes):
        work.append((box[1] - box[0]) * (box[3] - box[2]) * self.weight.shape[0])
        return run(self, ctx, inputs, have, box, shapes)

    monkeypatch.setattr(Conv, "run", counted)
    return work


@pytest.mark.parametrize("kind,staging", [("decode", "disk"), ("decode", "host"), ("encode", "device")])
def test_row_bands_carry_convolution_rows_and_stay_exact(monkeypatch, kind, staging):
    # band_bytes=1: every local segment runs each tile in bands of one reference row; the convolutions
    # compute each row of the tile once (rows the band before made are carried), other ops recompute
    vae = kl_vae("sd3")
    work = _conv_rows(monkeypatch)
    with torch.no_grad():
        if kind == "decode":
            x = structured_latent(1, 16, 9, 7)
            p, ref, untiled = lower(vae.decoder), "input", vae.decoder(x)
        else:
            x = torch.randn(1, 3, 56, 72, generator=torch.Generator().manual_seed(4)).clamp(-1, 1)
            p, ref, untiled = lower(vae.encoder), "output", vae.encoder(x)
        runs = {}
        for band in (None, 1):
            work.clear()
            ex = Executor(p, 4, getattr(p, ref), RunOptions(staging=staging, band_bytes=band, progress=False))
            runs[band] = (ex.run(x).output, sum(work), len(work))
    (whole, w_work, w_calls), (banded, b_work, b_calls) = runs[None], runs[1]
    assert b_calls > 2 * w_calls  # it did run in bands
    assert b_work == w_work  # and no convolution row twice
    assert (banded - whole).abs().max() <= 1e-5
    assert (banded - untiled).abs().max() <= 1e-4


def test_row_bands_leave_tile_attention_whole():
    # attention="tile" attends over the tile it is given: its segment runs whole, so the approximation
    # stays the same with bands
    vae = kl_vae("sd")
    z = structured_latent(1, 4, 9, 7)
    p = lower(vae.decoder)
    with torch.no_grad():
        outs = [Executor(p, 4, p.input, RunOptions(attention="tile", band_bytes=b, progress=False)).run(z)
                .output for b in (None, 1)]
        glob = Executor(p, 4, p.input, RunOptions(band_bytes=1, progress=False)).run(z).output
    assert (outs[1] - outs[0]).abs().max() <= 1e-5
    assert (outs[0] - glob).abs().max() > 1e-3  # (tile attention does differ from global here)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_disk_staging_round_trips_boxes_and_row_bands(tmp_path, dtype, monkeypatch):
    """Disk-staged values: boxes written (in chunks of rows) read back equal, unwritten parts read as
    zeros, a rank's band of rows is addressed in global rows, and the files are gone after close."""
    from tilewise.vae.run import staging
    from tilewise.vae.run.staging import Staging

    monkeypatch.setattr(staging, "WRITE_CHUNK", 3 * 5 * 4 * 2)  # a few rows per write chunk
    x = torch.randn(2, 5, 9, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    stage = Staging("disk", "cpu", str(tmp_path))
    stage.alloc("v", tuple(x.shape), dtype)
    stage.alloc("band", tuple(x.shape), dtype, rows=(4, 9))
    for box in ((0, 4, 0, 7), (4, 9, 0, 3), (4, 9, 3, 7)):
        y0, y1, x0, x1 = box
        stage.write("v", box, x[..., y0:y1, x0:x1])
    assert torch.equal(stage.read("v", (0, 9, 0, 7)), x)
    assert torch.equal(stage.read("v", (2, 7, 1, 6)), x[..., 2:7, 1:6])
    assert stage.info("v") == ((2, 5, 9, 7), dtype, torch.device("cpu"))
    stage.write("band", (5, 8, 2, 6), x[..., 5:8, 2:6].contiguous(memory_format=torch.channels_last))
    got = stage.read("band", (4, 9, 0, 7))
    assert torch.equal(got[..., 1:4, 2:6], x[..., 5:8, 2:6])
    assert not got[..., 0, :].any() and not got[..., 1:4, :2].any()  # never written: zeros
    assert stage.info("band")[0] == (2, 5, 5, 7)
    files = list(tmp_path.glob("tilewise-stage-*/*.bin"))
    assert len(files) == 2
    stage.close()
    assert not any(f.exists() for f in files)


def test_sampled_tile_statistics_staged_on_disk_equal_the_together_run_and_exact(tmp_path):
    # the decoder cut at a GroupNorm that reads the part's input (its statistics come from the staged
    # input, the later ones as the tiles write); with every tile sampled both runs are exact
    import tilewise as tw
    from tilewise.geometry import TileGrid
    from tilewise.locality.program import Program
    from tilewise.vae.fast.estimators import sample_tiles, sampled_tile_stats, staged_tile_stats
    from tilewise.vae.fast.split import crossing

    p = tw.TiledVAE(kl_vae("sd")).program("decode")
    after = max(i for i, op in enumerate(p.ops) if op.kind == "attention")
    j = next(i for i, op in enumerate(p.ops) if i > after and op.kind == "group_norm"
             and crossing(p, i) == {op.src[0]})
    cut = p.ops[j].src[0]
    head = Program(ops=p.ops[:j], input=p.input, output=cut, in_channels=p.in_channels, name="head")
    tail = Program(ops=p.ops[j:], input=cut, output=p.output, in_channels=p.channels()[cut], name="tail")
    with torch.no_grad():
        h = head.run(structured_latent(1, 4, 9, 11))
        ref = tail.run(h)
    tiles = sample_tiles(TileGrid(9, 11, (4, 4)), 1.0)
    fixed = {id(op) for op in tail.ops if op.kind == "group_norm"}
    together = sampled_tile_stats(tail, h, tail.input, tiles, fixed)
    disk = RunOptions(staging="disk", stage_dir=str(tmp_path))
    staged = staged_tile_stats(tail, h, tail.input, tiles, fixed, disk)
    banded = staged_tile_stats(tail, h, tail.input, tiles, fixed, disk.replace(band_bytes=1))
    assert set(together[0]) == set(staged[0]) == set(banded[0]) == fixed
    for i in fixed:
        for a, b, c in zip(together[0][i], staged[0][i], banded[0][i], strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()  # float32 sums
            assert torch.allclose(a, c, rtol=1e-5, atol=1e-6), (a - c).abs().max()
    shape = tuple(ref.shape[-2:])
    for t in tiles:
        y0, y1, x0, x1 = map_box(t.core, (9, 11), shape)
        for done in (together[1], staged[1], banded[1]):
            assert (done[t.index] - ref[..., y0:y1, x0:x1]).abs().max() <= 1e-4
    assert not list(tmp_path.iterdir())  # the staged files are gone


@pytest.mark.parametrize("kv_chunk,query_rows,query_chunk", [(64, 0, 4096), (37, 7, 50), (29, 3, 16),
                                                              (1000, 20, 4096)])
def test_streamed_attention_keys_values_equal_the_untiled_decoder_and_encoder(kv_chunk, query_rows,
                                                                              query_chunk):
    vae = kl_vae("sd")
    kw = dict(kv_chunk=kv_chunk, query_rows=query_rows, query_chunk=query_chunk, progress=False)
    with torch.no_grad():
        z = structured_latent(2, 4, 20, 17)
        p = lower(vae.decoder)
        assert (Executor(p, 8, p.input, RunOptions(**kw)).run(z).output - vae.decoder(z)).abs().max() <= 1e-4
        x = torch.randn(1, 3, 88, 72, generator=torch.Generator().manual_seed(2))
        p = lower(vae.encoder)
        out = Executor(p, 4, p.output, RunOptions(staging="host", **kw)).run(x).output
        assert (out - vae.encoder(x)).abs().max() <= 1e-4


@pytest.mark.parametrize("fused", [True, False])
def test_streamed_attention_is_the_online_softmax_of_sdpa_in_float32_and_bfloat16(fused, monkeypatch, caplog):
    from tilewise.locality import streamed_attention as sa
    from tilewise.locality.streamed_attention import streamed_attention

    if not fused:  # as after a fused kernel refused its inputs: float32 score blocks
        monkeypatch.setattr(sa, "_REFUSED", {"cpu"})
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) * 3 for n in (37, 101, 101))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    tokens = [t.transpose(1, 2).reshape(2, 101, 24) for t in (k, v)]
    for qc, kc in ((5, 7), (37, 101), (64, 1)):
        out = streamed_attention(q.clone(), *tokens, 3, qc, kc)
        assert out.dtype == q.dtype and (out - ref).abs().max() <= 1e-4
    half = [t.bfloat16() for t in (q, *tokens)]
    own = (torch.nn.functional.scaled_dot_product_attention(*(t.bfloat16() for t in (q, k, v))).float()
           - ref).abs().max()
    out = streamed_attention(*half, 3, 8, 16)
    assert out.dtype == torch.bfloat16 and (out.float() - ref).abs().max() <= 2 * own


def test_streamed_attention_says_once_when_no_fused_kernel_runs_and_stays_exact(monkeypatch, caplog):
    from tilewise.locality import streamed_attention as sa

    def refuse(*args):
        raise RuntimeError("no kernel for these inputs\nmore")

    monkeypatch.setattr(sa, "_REFUSED", set())
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", refuse)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (9, 40, 40))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    tokens = [t.transpose(1, 2).reshape(1, 40, 16) for t in (k, v)]
    with caplog.at_level("WARNING"):
        for _ in range(2):
            assert (sa.streamed_attention(q.clone(), *tokens, 2, 4, 16) - ref).abs().max() <= 1e-5
    assert [r.message for r in caplog.records].count(
        "streamed attention: no fused kernel on cpu (no kernel for these inputs); computing its scores in "
        "float32 blocks instead (exact, more kernels)") == 1
