"""The row offsets of the Gluon MXFP8 GEMM's f16 route (`mx_row_offsets`, qmoe/kernels/_mx_gemm_gl.py)
== their rule, on CPU through Triton's interpreter (as in test_bias_interpret.py: the one test of the
normal session re-runs this file with TRITON_INTERPRET=1).

The rule, per row of E8M0 bytes e (one per 32-wide block along K): with hi = max(e), r = hi - 134
makes every block's f16 factor 2^(e - 127 - r) at most 2^7 (448 * 2^7 is f16's largest power-of-two
multiple of an E4M3 code) and at least 2^-15 (the smallest E4M3 subnormal stays an f16 subnormal)
when min(e) >= hi - 22; r must lie in [-63, 63] so that 2^(r_a + r_b) is a normal fp32. A row of
byte-0 blocks only takes r = 0; any other row sends its tile to the bf16 route (NOT_F16).
"""
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernels.interpret import inside, launcher, run_under_interpreter  # noqa: F401


@launcher
def test_mx_row_offsets_under_the_interpreter():
    proc = run_under_interpreter(__file__)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.search(r"\b\d+ passed, 1 skipped in ", proc.stdout), proc.stdout[-2000:]


def _rule(e: torch.Tensor) -> torch.Tensor:
    """The module docstring's rule on int64 bytes [rows, blocks]."""
    from qmoe.kernels._mx_gemm_gl import NOT_F16

    hi, lo = e.max(1).values, e.min(1).values
    r = hi - 134
    fits = (hi < 255) & (r >= -63) & (r <= 63) & (lo >= hi - 22)
    return torch.where(hi == 0, 0, torch.where(fits, r, NOT_F16.value))


def _offsets(scale, outer, inner, kb, so, si, sk):
    from qmoe.kernels._mx_gemm_gl import mx_row_offsets

    return mx_row_offsets(scale, outer, inner, kb, so, si, sk).long()


@inside
@pytest.mark.parametrize("row, want", [
    ([197, 175, 190], 63), ([198, 197], "not"), ([71, 49], -63), ([70, 70], "not"), ([150, 127], "not"),
    ([0, 0, 0], 0), ([255, 130], "not"), ([140, 0], "not"), ([134] * 40, 0), ([0] * 39 + [120], "not"),
], ids=["top", "above-top", "bottom", "below-bottom", "span-23", "all-zero", "nan-scale", "zero-amid-others",
        "two-chunks", "zero-then-one"])
def test_rows_at_the_bounds(row, want):
    from qmoe.kernels._mx_gemm_gl import NOT_F16

    scale = torch.tensor([row], dtype=torch.uint8)
    got = _offsets(scale, 1, 1, len(row), 0, scale.stride(0), 1)
    assert got.tolist() == [NOT_F16.value if want == "not" else want]


@inside
@settings(max_examples=25, deadline=None)
@given(outer=st.integers(1, 3), inner=st.integers(1, 70), kb=st.integers(1, 70), columnwise=st.booleans(),
       lo=st.integers(0, 255), width=st.integers(0, 40), seed=st.integers(0, 2**31))
def test_any_layout_matches_the_rule(outer, inner, kb, columnwise, lo, width, seed):
    """Weights' layouts: `outer` groups of `inner` rows, the blocks along K contiguous (rowwise) or
    strided (columnwise copy: [K/32, groups * rows]); bytes drawn in a window so that every branch of
    the rule is taken."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(lo, min(lo + width, 255) + 1, (outer, inner, kb), generator=g)
    e[e < lo + width // 4] = 0  # some byte-0 blocks
    if columnwise:
        scale = e.permute(2, 0, 1).reshape(kb, outer * inner).to(torch.uint8).contiguous()
        got = _offsets(scale, outer, inner, kb, inner, 1, scale.stride(0))
    else:
        scale = e.reshape(outer * inner, kb).to(torch.uint8).contiguous()
        got = _offsets(scale, outer, inner, kb, inner * kb, kb, 1)
    assert torch.equal(got, _rule(e.reshape(outer * inner, kb)))
