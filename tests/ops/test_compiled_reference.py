"""qmoe.reference.compiled, the reference ops torch.compile runs, against the reference itself.

Bit for bit: the device-side grouped dequantization against `GroupedTensor.dequantize` (per
group, host split sizes), the GEMM and quantize twins against the reference ops; and the custom
ops' fake implementations against their real outputs. Splits include empty and odd groups.
"""
import pytest
import torch

from qmoe.ops.grouped_gemm import quantize_weights
from qmoe.quant import GroupedTensor
from qmoe.recipes import (Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling,
                          ScaleMode)
from qmoe.reference import compiled
from qmoe.reference import grouped_gemm as reference_gemm
from qmoe.reference import grouped_quantize as reference_quantize

RECIPES = [
    pytest.param(Float8CurrentScaling(), id="current"),
    pytest.param(Float8BlockScaling(), id="block"),
    pytest.param(Float8BlockScaling(use_f32_scales=True, fp8_format=Format.HYBRID), id="block-f32-hybrid"),
    pytest.param(MXFP8BlockScaling(scale_mode=ScaleMode.FLOOR), id="mxfp8-floor"),
    pytest.param(NVFP4BlockScaling(disable_stochastic_rounding=True), id="nvfp4"),
    pytest.param(NVFP4BlockScaling(disable_stochastic_rounding=True, disable_2d_quantization=True), id="nvfp4-1d"),
]
N, K = 48, 160  # neither a multiple of 128: partial FP8 blocks along both


def _splits(recipe):
    """Jagged splits with an empty group; odd ones except where NVFP4's columnwise copy (packed
    two tokens a byte, RHT over 16) needs even / 16-row groups."""
    return [32, 0, 48, 16] if isinstance(recipe, NVFP4BlockScaling) else [37, 0, 129, 1]


def _operands(recipe, seed=0, values=()):
    gen = torch.Generator().manual_seed(seed)
    splits = _splits(recipe)
    x = torch.randn(sum(splits), K, generator=gen) * 3
    dy = torch.randn(sum(splits), N, generator=gen)
    w = torch.randn(len(splits), N, K, generator=gen) / K ** 0.5
    q = {role: recipe.quantizer(role) for role in ("input", "weight", "grad_output")}
    splits = torch.tensor(splits)
    xq = GroupedTensor.quantize(x, splits, q["input"], rowwise=True, columnwise=True, values=values)
    dyq = GroupedTensor.quantize(dy, splits, q["grad_output"], rowwise=True, columnwise=True, values=values)
    wq = quantize_weights(w, q["weight"], rowwise=True, columnwise=True, values=values)
    return xq, dyq, wq


def _assert_bits(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.view(torch.int32) if got.dtype == torch.float32 else got, want.view(torch.int32)
                       if want.dtype == torch.float32 else want), what


@pytest.mark.parametrize("recipe", RECIPES)
def test_device_side_dequantize_matches_per_group(recipe):
    for name, gt in zip(("x", "dy", "w"), _operands(recipe)):
        _assert_bits(compiled.dequantize_grouped(gt), gt.dequantize(torch.float32), f"{name} rowwise")
        _assert_bits(compiled.dequantize_grouped(gt, columnwise=True), gt.dequantize(torch.float32, columnwise=True),
                     f"{name} columnwise")


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.id in ("mxfp8-floor", "nvfp4", "nvfp4-1d")])
def test_twins_read_copies_held_as_values(recipe):
    """Copies held as exact values (GroupedTensor.quantize's values) dequantize, and multiply, to
    the bits of the same copies held as codes."""
    codes, held = _operands(recipe), _operands(recipe, values=("rowwise", "columnwise"))
    for name, c, h in zip(("x", "dy", "w"), codes, held):
        assert h.values and h.rowwise_data is None, f"{name}: no copy held as values"
        for columnwise in (False, True):
            _assert_bits(compiled.dequantize_grouped(h, columnwise), compiled.dequantize_grouped(c, columnwise),
                         f"{name} columnwise={columnwise}")
    (xc, dyc, wc), (xh, dyh, wh) = codes, held
    for b_columnwise, ac, ah in ((False, xc, xh), (True, dyc, dyh)):
        _assert_bits(compiled.m_grouped_gemm(ah, wh, b_columnwise=b_columnwise, out_dtype=torch.float32),
                     compiled.m_grouped_gemm(ac, wc, b_columnwise=b_columnwise, out_dtype=torch.float32),
                     f"m_grouped b_columnwise={b_columnwise}")
    _assert_bits(compiled.k_grouped_gemm(dyh, xh, out_dtype=torch.float32),
                 compiled.k_grouped_gemm(dyc, xc, out_dtype=torch.float32), "k_grouped")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gemm_twins_match_the_reference(recipe, out_dtype):
    xq, dyq, wq = _operands(recipe)
    for b_columnwise, a in ((False, xq), (True, dyq)):
        _assert_bits(compiled.m_grouped_gemm(a, wq, b_columnwise=b_columnwise, out_dtype=out_dtype),
                     reference_gemm.m_grouped_gemm(a, wq, b_columnwise=b_columnwise, out_dtype=out_dtype),
                     f"m_grouped b_columnwise={b_columnwise}")
    _assert_bits(compiled.k_grouped_gemm(dyq, xq, out_dtype=out_dtype),
                 reference_gemm.k_grouped_gemm(dyq, xq, out_dtype=out_dtype), "k_grouped")
    out = torch.ones(4, N, K, dtype=out_dtype)
    want = reference_gemm.k_grouped_gemm(dyq, xq, out=out.clone(), accumulate=True)
    _assert_bits(compiled.k_grouped_gemm(dyq, xq, out=out, accumulate=True), want, "k_grouped accumulate")


def test_plain_gemm_twins_match_the_reference():
    gen = torch.Generator().manual_seed(1)
    splits = torch.tensor([5, 0, 11])
    a, dy = torch.randn(16, K, generator=gen).bfloat16(), torch.randn(16, N, generator=gen).bfloat16()
    w = torch.randn(3, N, K, generator=gen).bfloat16()
    for b, b_columnwise, lhs in ((w, False, a), (w, True, dy)):
        _assert_bits(compiled.m_grouped_gemm(lhs, b, splits, b_columnwise=b_columnwise),
                     reference_gemm.m_grouped_gemm(lhs, b, splits, b_columnwise=b_columnwise), "m_grouped")
    _assert_bits(compiled.k_grouped_gemm(dy, a, splits, out_dtype=torch.float32),
                 reference_gemm.k_grouped_gemm(dy, a, splits, out_dtype=torch.float32), "k_grouped")


QUANTIZE_CASES = [
    pytest.param("grouped_tensor_amax", (), id="amax"),
    pytest.param("grouped_quantize_fp8_tensorwise", ("scales", Format.HYBRID.element_format("grad_output")),
                 id="fp8-tensorwise"),
    pytest.param("grouped_quantize_fp8_block", (1, 128, Format.E4M3.element_format("input"), True, 0.0),
                 id="fp8-block-1x128"),
    pytest.param("grouped_quantize_fp8_block", (128, 128, Format.E4M3.element_format("input"), False, 1e-3),
                 id="fp8-block-128x128"),
    pytest.param("grouped_quantize_mxfp8", (Format.E4M3.element_format("input"), ScaleMode.ROUND_UP),
                 id="mxfp8"),
    pytest.param("grouped_quantize_nvfp4", (False,), id="nvfp4-1d"),
    pytest.param("grouped_quantize_nvfp4", (True,), id="nvfp4-2d"),
]


@pytest.mark.parametrize("name, args", QUANTIZE_CASES)
@pytest.mark.parametrize("rowwise, columnwise", [(True, False), (False, True), (True, True)])
def test_quantize_twins_match_the_reference(name, args, rowwise, columnwise):
    splits = torch.tensor([32, 0, 64, 16])
    x = torch.randn(112, 96, generator=torch.Generator().manual_seed(2))
    args = tuple(torch.rand(4) + 0.5 if a == "scales" else a for a in args)
    flags = () if name == "grouped_tensor_amax" else (rowwise, columnwise)
    got = getattr(compiled, name)(x, splits, *args, *flags)
    want = getattr(reference_quantize, name)(x, splits, *args, *flags)
    for i, (g, w) in enumerate(zip(*(t if isinstance(t, tuple) else (t,) for t in (got, want)))):
        assert (g is None) == (w is None), i
        if w is not None:
            _assert_bits(g, w, f"output {i}")


def test_fake_implementations_match_the_real_ops():
    """The shapes, dtypes and strides torch.compile plans with are the ones the ops return."""
    x, splits = torch.randn(112, 96), torch.tensor([32, 0, 64, 16])
    e4m3 = torch.float8_e4m3fn
    cases = [
        (torch.ops.qmoe_ref.grouped_tensor_amax, (x, splits)),
        (torch.ops.qmoe_ref.grouped_quantize_fp8_tensorwise, (x, splits, torch.ones(4), e4m3, True, False)),
        (torch.ops.qmoe_ref.grouped_quantize_fp8_block, (x, splits, 128, 128, e4m3, True, 0.0, True, True)),
        (torch.ops.qmoe_ref.grouped_quantize_fp8_block, (x, splits, 1, 128, e4m3, True, 0.0, False, True)),
        (torch.ops.qmoe_ref.grouped_quantize_mxfp8, (x, splits, e4m3, "round_up", True, True, False, False)),
        (torch.ops.qmoe_ref.grouped_quantize_mxfp8, (x, splits, e4m3, "round_up", True, True, True, False)),
        (torch.ops.qmoe_ref.grouped_quantize_mxfp8, (x, splits, e4m3, "round_up", False, True, False, True)),
        (torch.ops.qmoe_ref.grouped_quantize_nvfp4, (x, splits, True, True, True, False, False, False, False)),
        (torch.ops.qmoe_ref.grouped_quantize_nvfp4, (x, splits, False, True, True, True, False, False, False)),
        (torch.ops.qmoe_ref.grouped_quantize_nvfp4, (x, splits, True, True, True, False, False, True, True)),
        (torch.ops.qmoe_ref.grouped_quantize_nvfp4, (x, splits, False, False, True, True, False, False, True)),
        (torch.ops.qmoe_ref.m_grouped_gemm, (x, torch.randn(4, 24, 96), splits, False, torch.bfloat16)),
        (torch.ops.qmoe_ref.m_grouped_gemm, (x[:, :24], torch.randn(4, 24, 96), splits, True, torch.float32)),
        (torch.ops.qmoe_ref.k_grouped_gemm, (x[:, :24], x, splits, torch.float32)),
        (torch.ops.qmoe_ref.e8m0_to_float, (torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu),)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils="test_faketensor")
