"""The Gluon MXFP8 m-grouped GEMM (qmoe/kernels/_mx_gemm_gl.py) keeps the GEMM contract and the
exact emulation's values, and m_grouped_gemm dispatches it exactly where it applies.

On the GPU: fprop and dgrad with uneven splits, an empty expert, group ends inside 128-row tiles
and rows past the last group (zeros); against the fp32 product of the dequantized operands
(NUMERICS.md's GEMM contract) and the Triton "fused" route of the same exact emulation; NaN and
infinity where the Triton route has them; every tile variant the sweep times, and persistent
programs that run many tiles through every slot of the load ring. Gluon has no interpreter:
the dispatch decision and the fallback are checked on the CPU.
"""
from __future__ import annotations


import pytest
import torch

from tests.kernels.gluon import grouped_operands
from tests.kernels.interpret import INTERPRETING
from tests.tolerances import GEMM_RTOL

on_gpu = pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(), reason="needs a CUDA GPU")
SPLITS = [300, 0, 450, 77, 5]  # an empty expert; group ends inside 128-row tiles
PAD = 9  # rows past the last group
VARIANTS = [dict(bn=256, bk=64, stages=4), dict(bn=256, bk=64, stages=3), dict(bn=128, bk=64, stages=6),
            dict(bn=64, bk=64, stages=4), dict(bn=256, bk=64, stages=4, group_m=1), dict(f16=False),
            dict(ws_regs=(232, 40)), dict(bn=128, stages=6, ws_regs=(232, 40))]


def _special(x):
    """A NaN, an infinity and a tiny block: their rows only."""
    x[3, 5], x[301, 70], x[760:770] = float("nan"), float("inf"), 1e-30


def _operands(layout, k, n, device, splits=SPLITS, special=False):
    from qmoe.recipes import MXFP8BlockScaling

    return grouped_operands(MXFP8BlockScaling(), layout, k, n, device, splits, PAD, seed=11, scale=3.0,
                            edit=_special if special else None)


def _launch(a, b, layout, out_dtype, **kw):
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import _mx_gemm_gl as mx
    from qmoe.kernels import grouped_gemm as gg

    columnwise = layout == "dgrad"
    a_op = gg.activation_operand(a, Scaling.MX)
    b_op, n_out, k = gg.weight_operand(b, Scaling.MX, columnwise)
    return mx.launch_mx_gemm(a_op, b_op, a.offsets, a.shape[0], n_out, k, b.num_groups, out_dtype,
                             b_columnwise=columnwise, **kw)


def _triton_fused(a, b, layout, out_dtype):
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import grouped_gemm as gg

    return gg.m_grouped_gemm_with(a, b, b_columnwise=layout == "dgrad", out_dtype=out_dtype, route="fused",
                                  config=gg.tile_configs(Scaling.MX, small_m=False)[0])


def _rel(out, ref):
    return float((out.to(ref.dtype) - ref).norm() / ref.norm())


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 256), (384, 512), (1024, 384)], ids=["k256-n256", "k384-n512", "k1024-n384"])
@pytest.mark.parametrize("layout", ["fprop", "dgrad"])
def test_gluon_mx_gemm_keeps_the_contract(layout, shape):
    from qmoe.reference import grouped_gemm as reference

    k, n = shape
    a, b = _operands(layout, k, n, "cuda")
    oracle = reference.m_grouped_gemm(a, b, b_columnwise=layout == "dgrad", out_dtype=torch.float32)
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = _launch(a, b, layout, out_dtype, programs=3)
        assert out.dtype == out_dtype and out.shape == oracle.shape
        assert (out[sum(SPLITS):] == 0).all(), "rows past the last group are zeros"
        assert _rel(out, oracle) <= GEMM_RTOL[torch.float32 if out_dtype == torch.float32 else torch.bfloat16]
        fused = _triton_fused(a, b, layout, out_dtype)  # the same exact products: fp32 summation order only
        assert _rel(out, fused.float()) <= GEMM_RTOL[torch.float32]


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["fprop", "dgrad"])
def test_gluon_mx_gemm_non_finite_values_stay_in_their_rows(layout):
    a, b = _operands(layout, 256, 256, "cuda", special=True)
    out = _launch(a, b, layout, torch.float32, programs=5)
    fused = _triton_fused(a, b, layout, torch.float32)
    assert torch.equal(out.isnan(), fused.isnan()) and torch.equal(out.isinf(), fused.isinf())
    assert out[3].isnan().all() and not out[4].isnan().any()
    finite = fused.isfinite()
    assert _rel(out[finite], fused[finite]) <= GEMM_RTOL[torch.float32]


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_every_variant_and_few_programs_give_the_same_values(kw):
    """Tile variants and 1-2 persistent programs (every ring slot reused across tiles) all agree
    with the dispatched configuration up to fp32 summation order."""
    a, b = _operands("fprop", 512, 512, "cuda")
    want = _launch(a, b, "fprop", torch.float32)
    for programs in (1, 2):
        got = _launch(a, b, "fprop", torch.float32, programs=programs, **kw)
        assert _rel(got, want) <= GEMM_RTOL[torch.float32], (kw, programs)
        assert (got[sum(SPLITS):] == 0).all()


def _small_block(codes, scales, row, s_hi, span):
    """Row `row` of an operand (codes [R, K] uint8, E8M0 bytes [R, K/32]): every block at byte s_hi
    with zero codes except block 1, `span` binades lower, holding every non-zero E4M3 magnitude
    (subnormals included) with alternating signs: the row's products come from that block only."""
    codes[row] = 0
    scales[row] = s_hi
    mags = torch.arange(1, 127, 4, dtype=torch.uint8)[:32]
    codes[row, 32:32 + len(mags)] = mags | (torch.arange(len(mags), dtype=torch.uint8) % 2 << 7)
    codes[row, 32] = 1  # the smallest subnormal
    scales[row, 1] = s_hi - span


@on_gpu
@pytest.mark.gpu
def test_the_f16_route_is_exact_at_its_bounds_and_other_tiles_take_the_bf16_route():
    """Rows whose only products come from a block 22 binades below the row's largest (the f16
    route's bound, subnormal codes included), at both ends of the exponent range it takes, and a
    weight column the same way; a tile with a 23-binade row, one with a block byte 0 amid others,
    and an all-zero row: every output row matches the fp32 reference of its own (its products
    are exact, only the summation order may differ)."""
    from qmoe.reference import grouped_gemm as reference

    a, b = _operands("fprop", 256, 256, "cuda")
    codes, scales = a.rowwise_data.view(torch.uint8), a.rowwise_scale_inv.view(torch.uint8)
    for row, s_hi, span in [(10, 197, 22), (11, 71, 22), (12, 140, 22), (140, 150, 23), (330, 120, 0)]:
        _small_block(codes, scales, row, s_hi, span)
    codes[12, 0], codes[13] = 0x7E, 0  # the largest code at the top factor 2^7; an all-zero row
    scales[13] = 0
    scales[330, 3] = 0  # a zero block (byte 0) in a row with others: its tile takes the bf16 route
    _small_block(b.rowwise_data.view(torch.uint8), b.rowwise_scale_inv.view(torch.uint8), 7, 180, 22)
    oracle = reference.m_grouped_gemm(a, b, out_dtype=torch.float32)
    for kw in (dict(), dict(ws_regs=(232, 40))):
        out = _launch(a, b, "fprop", torch.float32, programs=2, **kw).double()  # float64: the norms of 2^100
        assert (out[13] == 0).all() and (oracle[13] == 0).all()
        for row in [10, 11, 12, 140, 330, 5, 200]:
            assert _rel(out[row], oracle[row].double()) <= GEMM_RTOL[torch.float32], (row, kw)
        assert _rel(out[:300, 7], oracle[:300, 7].double()) <= GEMM_RTOL[torch.float32]
        assert _rel(out, oracle.double()) <= GEMM_RTOL[torch.float32]


@pytest.mark.parametrize("kw, k, what", [(dict(bk=128), 256, "64-deep K-step"), (dict(bn=96), 256, "N in"),
                                         (dict(), 320, "multiple of twice the step"),
                                         (dict(bm=64), 256, "the warps stack along M"),
                                         (dict(stages=12), 256, "exceed shared memory")])
def test_launcher_refuses_tiles_it_cannot_run_before_touching_the_device(kw, k, what):
    """Bad tiles or a K the two-step loop cannot cover raise ValueError naming the problem (CPU operands:
    nothing is launched)."""
    from qmoe.kernels import _mx_gemm_gl as mx

    if mx.ws.gluon is None:
        pytest.skip("this triton has no Gluon")
    a, b = _operands("fprop", k, 256, "cpu", splits=[40, 24])
    with pytest.raises(ValueError, match=what):
        _launch(a, b, "fprop", torch.bfloat16, **kw)
