"""benchmarks.profile_linear's rows: kernels ranked by device time, the step's total in ms, shares of it."""
from benchmarks.profile_linear import row


def test_rows_rank_kernels_by_time_and_keep_the_total_of_all():
    times = {"quantize": (300.0, 2.0), "gemm": (1500.0, 3.0), "permute": (200.0, 1.0), "tiny": (0.5, 4.0)}
    r = row("qwen3-fc1", "qmoe", "mxfp8", times, top=2)
    assert r["kernel_ms"] == 2.0005  # every kernel counts in the total, not only the top ones
    assert [k["name"] for k in r["kernels"]] == ["gemm", "quantize"]
    assert [k["share"] for k in r["kernels"]] == [0.75, 0.15]
    assert r["kernels"][0]["launches"] == 3.0
