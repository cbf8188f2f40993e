"""The kernel benchmark's pure parts (the rest needs a CUDA device: the GPU report runs it)."""
import pytest

from nanokv.tools import gpu_targets
from nanokv.tools.kernel_bench import decode_step_table, eviction_table, largest_kernels


def test_largest_kernels_per_call_longest_first_and_the_rest_in_one_row():
    events = [("rms_norm", 40, 80.0), ("gemm", 60, 600.0), ("cudaGraphLaunch", 20, 0.0), ("rope", 20, 20.0),
              ("decode", 20, 300.0)]
    rows = largest_kernels(events, runs=20, top=2)
    assert [r["kernel"] for r in rows] == ["gemm", "decode", "2 other kernels"]   # no row for what ran on no device
    assert [r["launches"] for r in rows] == [3, 1, 3] and [r["us"] for r in rows] == [30, 15, 5]
    assert sum(r["share"] for r in rows) == pytest.approx(1) and rows[0]["share"] == 0.6
    assert [r["kernel"] for r in largest_kernels(events, runs=20)] == ["gemm", "decode", "rms_norm", "rope"]
    assert largest_kernels([("cudaGraphLaunch", 20, 0.0)], runs=20) == []


def test_each_decode_step_its_table_and_figure():
    kernels = largest_kernels([("gemm", 10, 500.0), ("decode", 10, 400.0)], runs=10)
    records = [dict(kind="decode_step", shape=shape, batch=batch, ms=ms, roofline_ms=ms / 2, vs_roofline=2.0,
                    case=f"{shape} shape, batch {batch}", kernels=kernels)
               for shape, batch, ms in (("llama-3.1-8b", 64, 7.0), ("qwen3-0.6b", 128, 3.0))]
    table = "\n".join(decode_step_table(records))
    assert "qwen3-0.6b, batch 128: kernels busy 0.09 ms of the 3.00 ms step" in table
    assert "| gemm | 1 | 50.0 | 56% |" in table
    figures = [f for f in gpu_targets.kernels("", records) if f.name.startswith("decode step")]
    assert [f.name for f in figures] == ["decode step, llama-3.1-8b shape, batch 64: time / roofline",
                                         "decode step, qwen3-0.6b shape, batch 128: time / roofline"]
    assert [f.target for f in figures] == ["", "<= 1.25x"] and figures[1].met is False   # the workload's shape


def test_the_eviction_table_puts_the_kernel_beside_the_reference():
    records = [dict(kind="eviction", op=op, shape="2240 heads x 1152 slots", impl=impl, us=us)
               for op, impl, us in (("eviction order", "kernel", 30.0), ("eviction order", "torch", 90.5),
                                    ("lowest 64", "kernel", 20.0), ("lowest 64", "torch", 60.0))]
    assert eviction_table(records)[2:] == ["| eviction order | 2240 heads x 1152 slots | 30.0 | 90.5 |",
                                           "| lowest 64 | 2240 heads x 1152 slots | 20.0 | 60.0 |"]
