"""Memory accounting: byte parsing/formatting round trips, tensor sizes, measured peaks."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from tilewise.memory import (
    MemoryMeter,
    format_bytes,
    measure_peak,
    parse_bytes,
    peak_rss_subprocess,
    tensor_bytes,
)

MiB = 1024**2


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2GiB", 2 * 1024**3),
        ("512MB", 512 * 1000**2),
        ("1.5 GiB", 3 * 1024**3 // 2),
        ("1024", 1024),
        ("  7 b ", 7),
        ("3kib", 3072),
        ("1e3KB", 10**6),
        ("1TB", 10**12),
        (1024, 1024),
        (0, 0),
        (2.5, 2),  # rounds half to even, like Python's round
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["2 GiBs", "GiB", "-1MB", "1..5GB", "", "12 parsecs", -5, True, None, [1]])
def test_parse_bytes_rejects_with_message(bad):
    with pytest.raises(ValueError) as err:
        parse_bytes(bad)
    assert repr(bad) in str(err.value) or str(bad) in str(err.value)


def test_parse_bytes_error_lists_units():
    with pytest.raises(ValueError, match="GiB.*MiB|MiB.*GiB") as err:
        parse_bytes("12 parsecs")
    assert "parsecs" in str(err.value)


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"), (3 * 1024**3 // 2, "1.50 GiB"),
     (5 * 1024**4, "5.00 TiB"), (-2048, "-2.00 KiB")],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize("n", [0, 1, 999, 1024, 123_456, 7 * MiB + 5, 3 * 1024**3, 17 * 1024**4 + 12345])
def test_format_parse_round_trip(n):
    back = parse_bytes(format_bytes(n))
    # two decimals of the unit: relative error <= 0.005 / 1.00
    assert abs(back - n) <= 0.005 * n + 0.5


def test_format_bytes_rejects_nonnumbers():
    with pytest.raises(ValueError, match="nan"):
        format_bytes(float("nan"))


def test_tensor_bytes_closed_form():
    torch = pytest.importorskip("torch")
    assert tensor_bytes((1, 4, 128, 128), torch.float16) == 4 * 128 * 128 * 2
    assert tensor_bytes((2, 3, 5, 7), torch.float32) == 2 * 3 * 5 * 7 * 4
    assert tensor_bytes((2, 3), torch.bfloat16) == 12
    assert tensor_bytes((3, 7), np.uint16) == 42
    assert tensor_bytes((3, 7), np.dtype("float64")) == 168
    assert tensor_bytes([10], "bf16") == 20
    assert tensor_bytes((), "float32") == 4
    assert tensor_bytes((0, 5), "float32") == 0
    for shape in [(1,), (3, 17, 31), (2, 4, 9, 11)]:
        assert tensor_bytes(shape, torch.float32) == torch.zeros(shape).nbytes


@pytest.mark.parametrize("shape, dtype", [((2, -1), "float32"), ((2.0, 3), "float32"), ((2, 3), "float13")])
def test_tensor_bytes_rejects(shape, dtype):
    with pytest.raises(ValueError, match=r"float13|-1|2\.0"):
        tensor_bytes(shape, dtype)


def _allocate_touched(nbytes):
    a = np.ones(nbytes // 8, dtype=np.float64)  # np.ones writes every page, so it is resident
    return float(a[::4096].sum())


def test_measure_peak_sees_200mib_allocation():
    nbytes = 200 * MiB
    result, peak = measure_peak(_allocate_touched, nbytes)
    assert result == math.ceil(nbytes // 8 / 4096)
    # the array, plus little else; minus nothing (every page was written)
    assert nbytes * 0.98 <= peak <= nbytes + 40 * MiB, peak


def test_measure_peak_sampling_fallback_sees_allocation(monkeypatch):
    import tilewise.memory as memory

    monkeypatch.setattr(memory, "reset_peak_rss", lambda: False)  # force the statm sampler

    def hold(nbytes):
        a = np.ones(nbytes // 8)
        import time

        time.sleep(0.05)  # longer than the 1 ms sampling interval
        return a.size

    with MemoryMeter(interval=0.001) as meter:
        hold(200 * MiB)
    assert "statm" in meter.method
    assert 200 * MiB * 0.98 <= meter.peak_bytes <= 240 * MiB


def test_measure_peak_small_call_is_small():
    _, peak = measure_peak(lambda: sum(range(1000)))
    assert peak < 16 * MiB


def test_measure_peak_rejects_unknown_device():
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="meta"):
        measure_peak(lambda: None, device="meta")


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss units and /proc are Linux-specific")
def test_peak_rss_subprocess_code_and_baseline():
    peak = peak_rss_subprocess(code="a = np.ones(150 * 2**20 // 8); result = int(a.size)",
                               setup="import numpy as np; b = np.ones(50 * 2**20 // 8)")
    assert peak.result == 150 * 2**20 // 8
    assert peak.baseline_bytes >= 50 * MiB  # setup's array is part of the baseline
    assert 150 * MiB * 0.98 <= peak.growth_bytes <= 170 * MiB, peak.growth_bytes
    assert peak.peak_bytes >= peak.baseline_bytes + 150 * MiB * 0.98


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss units and /proc are Linux-specific")
def test_peak_rss_subprocess_target_and_command():
    peak = peak_rss_subprocess("numpy:ones", args=[[100 * 2**20 // 8]])
    assert 100 * MiB * 0.98 <= peak.growth_bytes <= 120 * MiB
    cmd = peak_rss_subprocess([sys.executable, "-c", "import numpy as np; a = np.ones(2**25 // 8 * 3)"])
    assert cmd.baseline_bytes is None and cmd.growth_bytes is None
    assert cmd.peak_bytes >= 96 * MiB
    with pytest.raises(RuntimeError, match="exit code 3"):
        peak_rss_subprocess([sys.executable, "-c", "raise SystemExit(3)"])


def test_peak_rss_subprocess_rejects_bad_targets():
    with pytest.raises(ValueError, match="exactly one"):
        peak_rss_subprocess()
    with pytest.raises(ValueError, match="not importable"):
        peak_rss_subprocess(lambda: 1)
    with pytest.raises(ValueError, match="module:function"):
        peak_rss_subprocess("not a spec")


def test_import_memory_does_not_import_torch():
    code = "import sys, tilewise.memory; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_measure_peak_cuda_sees_200mib_allocation():
    import torch

    def allocate():
        a = torch.empty(200 * MiB, dtype=torch.uint8, device="cuda")
        return int(a.numel())

    keep = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")  # in use before: not counted
    n, peak = measure_peak(allocate, device="cuda")
    assert n == 200 * MiB
    assert 200 * MiB <= peak <= 202 * MiB, peak
    del keep


def test_measure_live_peak_counts_storages_alive_at_once_backward_included():
    """Closed form: 4 KB + 4 KB alive, one freed, then 8 KB: peak 12 KB (views and in-place results add
    nothing, tensors from before the call are not counted); backward's own buffers are counted."""
    import torch

    from tilewise.memory import measure_live_peak

    before = torch.zeros(10_000)

    def f():
        a, b = torch.zeros(1000), torch.zeros(1000)
        del a
        c = torch.ones(2000)
        c.add_(1)
        before.add_(1)
        return c.view(-1), b[:10]

    (c, _), peak = measure_live_peak(f)
    assert peak == 4000 + 8000 and c.shape == (2000,)  # b and c; a was freed before c
    x = torch.randn(1000, requires_grad=True)

    def g():
        (x.exp() * 2).sum().backward()

    assert measure_live_peak(g)[1] >= 3 * 4000  # exp, its product, and the gradient of x
