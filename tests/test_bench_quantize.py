"""benchmarks/bench_quantize.py's "current-amax" row times the same quantization as "current",
with the amax handed over as the layer's producers hand it (a RowsWithAmax): same codes and
scales, grouped and dense; and it is measured apart from "current"."""
import pytest
import torch

from benchmarks import bench_quantize as bq


@pytest.mark.parametrize("splits", [None, [3, 0, 9, 4]], ids=["dense", "grouped"])
@pytest.mark.parametrize("both", [True, False], ids=["both", "rowwise"])
def test_current_amax_quantizes_like_current(splits, both):
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16) * 5
    x[5, 7] = float("inf")  # the amax skips non-finite values either way
    s = None if splits is None else torch.tensor(splits)
    q = bq.make_recipe("current-amax").quantizer("input")
    got = bq.qmoe_call(q, x, s, both, "current-amax")()
    ref = bq.qmoe_call(bq.make_recipe("current").quantizer("input"), x, s if s is not None else torch.tensor([16]),
                       both, "current")()
    assert got.rowwise_data is not None and (got.columnwise_data is not None) == both
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        a, b = getattr(got, name, None), getattr(ref, name, None)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                               b.view(torch.uint8) if b.dtype.itemsize == 1 else b), name
    assert bq.signature(q, "current-amax") != bq.signature(q, "current")  # timed as a row of its own
