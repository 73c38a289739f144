"""GroupedTensor copies held as exact values (`GroupedTensor.quantize(values=...)`): what the
emulated MXFP8 and NVFP4 GEMMs multiply, bit for bit the dequantized codes (NVFP4: q * s_b, its
tensor factor kept apart), and the GEMMs' results with them are those with the codes.

NUMERICS.md: E4M3 * 2^k and E2M1 * E4M3 products are exact in bf16, so the values are the fp32
products rounded to bf16 with nothing lost. The GPU kernels' values are compared with these in
tests/kernels/test_grouped_values_gpu.py, the NVFP4 kernel's also under the interpreter
(tests/kernels/test_nvfp4_values_interpret.py).
"""
from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qmoe import GroupedTensor
from qmoe.ops import k_grouped_gemm, m_grouped_gemm, quantize_weights
from qmoe.contracts.formats import e2m1_decode, unpack_e2m1
from qmoe.contracts.scales import tensor_factor
from qmoe.recipes import Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling, ScaleMode
from qmoe.reference.quantize import expand_blocks

COPIES = ("rowwise", "columnwise")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _x(rows: int, k: int, seed: int, special: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-30, 30, (rows, 1), generator=g).float())  # blocks far apart in magnitude
    x = torch.randn(rows, k, generator=g) * scale
    if special and rows and k >= 64:
        x[0, 3], x[-1, 40] = float("inf"), float("nan")
        x[rows // 2, :32] = 0.0  # an all-zero block
        x[rows // 2, 33] = 1e-30  # a block of one tiny value (bf16 keeps it)
    return x.to(torch.bfloat16)


@settings(max_examples=30, deadline=None)
@given(splits=st.lists(st.integers(0, 70), min_size=1, max_size=5), k=st.sampled_from([32, 64, 96]),
       which=st.sampled_from([("rowwise",), ("columnwise",), COPIES]),
       recipe=st.sampled_from([MXFP8BlockScaling(), MXFP8BlockScaling(fp8_format=Format.HYBRID),
                               MXFP8BlockScaling(scale_mode=ScaleMode.FLOOR)]),
       role=st.sampled_from(["input", "grad_output"]), seed=st.integers(0, 2**16))
def test_values_are_the_codes_dequantized_exactly(splits, k, which, recipe, role, seed):
    x = _x(sum(splits), k, seed, special=True)
    q = recipe.quantizer(role)
    codes = GroupedTensor.quantize(x, splits, q)
    held = GroupedTensor.quantize(x, splits, q, values=which)
    assert sorted(held.values) == sorted(which)
    for copy in COPIES:
        columnwise = copy == "columnwise"
        deq = codes.dequantize(torch.float32, columnwise=columnwise)
        if columnwise:
            deq = deq.t()
        big = torch.finfo(torch.bfloat16).max
        inside = deq.abs() <= big  # the rest: a block's largest codes near the top of the range (an inf in x)
        assert torch.equal(deq[inside].to(torch.bfloat16).float(), deq[inside]), "not exact in bf16"
        if copy in which:
            got = held.exact_values(columnwise)
            assert got.dtype == torch.bfloat16 and got.shape == x.shape
            assert (held.columnwise_data if columnwise else held.rowwise_data) is None
            want = deq.clamp(-big, big).to(torch.bfloat16)  # dequantize's saturation (NUMERICS.md), NaN kept
            assert torch.equal(got.isnan(), deq.isnan())
            assert torch.equal(_bits(got[~deq.isnan()]), _bits(want[~deq.isnan()]))
            back = held.dequantize(torch.float32, columnwise=columnwise)
            torch.testing.assert_close(back.t() if columnwise else back, got.float(), rtol=0, atol=0, equal_nan=True)
        else:  # the other copy stays codes, as without values
            assert held.exact_values(columnwise) is None
            torch.testing.assert_close(held.dequantize(torch.float32, columnwise=columnwise),
                                       codes.dequantize(torch.float32, columnwise=columnwise), rtol=0, atol=0,
                                       equal_nan=True)


def _nvfp4_products(qt, columnwise: bool) -> torch.Tensor:
    """q * s_b of one group's copy in fp32 ([M, K] either way), from its codes and block scales."""
    data = qt.columnwise_data if columnwise else qt.rowwise_data
    scale = qt.columnwise_scale_inv if columnwise else qt.rowwise_scale_inv
    codes = e2m1_decode(unpack_e2m1(data))  # [K, M] columnwise: runs of 16 along M, as rowwise along K
    out = codes * expand_blocks(scale.float(), qt.quantizer.block, tuple(codes.shape))
    return out.t() if columnwise else out


@settings(max_examples=25, deadline=None)
@given(splits=st.lists(st.integers(0, 4).map(lambda n: 16 * n), min_size=1, max_size=4), k=st.sampled_from([32, 64]),
       which=st.sampled_from([("rowwise",), ("columnwise",), COPIES]),
       role=st.sampled_from(["input", "grad_output", "weight"]),
       recipe=st.sampled_from([NVFP4BlockScaling(), NVFP4BlockScaling(disable_rht=True, disable_2d_quantization=True)]),
       seed=st.integers(0, 2**16))
def test_nvfp4_values_are_the_codes_times_their_block_scales(splits, k, which, role, recipe, seed):
    """Values q * s_b (the columnwise copy's in the Hadamard domain, as its codes), exact in bf16;
    dequantized they give the codes' dequantization bit for bit: both multiply by the same tensor
    factor. Stochastic rounding draws the same stream for codes and values."""
    x = _x(sum(splits), k, seed, special=True)
    q = recipe.quantizer(role)
    torch.manual_seed(seed)
    codes = GroupedTensor.quantize(x, splits, q)
    torch.manual_seed(seed)
    held = GroupedTensor.quantize(x, splits, q, values=which)
    assert sorted(held.values) == sorted(which)
    for copy in COPIES:
        columnwise = copy == "columnwise"
        back = held.dequantize(torch.float32, columnwise=columnwise)
        torch.testing.assert_close(back, codes.dequantize(torch.float32, columnwise=columnwise), rtol=0, atol=0,
                                   equal_nan=True)
        if copy not in which:
            assert held.exact_values(columnwise) is None
            continue
        got = held.exact_values(columnwise)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        assert held.amax is not None and tensor_factor(held, columnwise) is not None  # kept for the GEMMs
        want = torch.cat([_nvfp4_products(qt, columnwise) for qt in codes.split()], 0)
        exact = dict(rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(want.to(torch.bfloat16).float(), want, **exact, msg="not exact in bf16")
        torch.testing.assert_close(got.float(), want, **exact)


def test_values_are_a_hint_other_formats_and_unrequested_copies_give_codes():
    x = _x(96, 256, 0)
    block = GroupedTensor.quantize(x, [32, 64], Float8BlockScaling().quantizer("input"), values=COPIES)
    assert block.values is None and block.rowwise_data is not None and block.columnwise_data is not None
    mx = GroupedTensor.quantize(x, [32, 64], MXFP8BlockScaling().quantizer("input"), columnwise=False,
                                values=COPIES)
    assert sorted(mx.values) == ["rowwise"] and not mx.has_copy(True)
    assert "values=['rowwise']" in repr(mx)


def test_a_bad_copy_name_is_an_error_before_anything_runs():
    with pytest.raises(ValueError, match="rowwise.*columnwise.*'cols'"):
        GroupedTensor.quantize(_x(32, 64, 0), [32], MXFP8BlockScaling().quantizer("input"), values=("cols",))


def test_a_copy_held_as_values_has_no_per_group_codes():
    gt = GroupedTensor.quantize(_x(64, 64, 1), [32, 32], MXFP8BlockScaling().quantizer("input"),
                                values=("rowwise",))
    with pytest.raises(ValueError, match="held as exact values.*dequantize"):
        gt.split()


RECIPES = [MXFP8BlockScaling(), NVFP4BlockScaling()]


@pytest.mark.parametrize("recipe", RECIPES, ids=["mxfp8", "nvfp4"])
@pytest.mark.parametrize("held", [(), ("rowwise",), ("columnwise",), COPIES])
def test_the_grouped_gemms_give_the_same_bits_from_values_as_from_codes(held, recipe):
    """fprop, dgrad and wgrad on the reference, each operand as codes or as values (NVFP4's with
    their tensor factors, and stochastic rounding's same random stream)."""
    splits = [48, 0, 80, 32]
    e, n, k, t = len(splits), 64, 96, sum(splits)
    x, dy, w = _x(t, k, 2), _x(t, n, 3), _x(e * n, k, 4).view(e, n, k)

    def quantized(values):
        torch.manual_seed(0)
        return (GroupedTensor.quantize(x, splits, recipe.quantizer("input"), values=values),
                GroupedTensor.quantize(dy, splits, recipe.quantizer("grad_output"), values=values),
                quantize_weights(w, recipe.quantizer("weight"), columnwise=True, values=values))

    (xq, dq, wq), (xc, dc, wc) = quantized(held), quantized(())
    assert (xq.values is not None) == bool(held)
    pairs = [(m_grouped_gemm(xq, wq), m_grouped_gemm(xc, wc)),
             (m_grouped_gemm(dq, wq, b_columnwise=True), m_grouped_gemm(dc, wc, b_columnwise=True)),
             (k_grouped_gemm(dq, xq, out_dtype=torch.float32), k_grouped_gemm(dc, xc, out_dtype=torch.float32))]
    for got, want in pairs:
        assert torch.equal(got, want)


def test_a_gemm_asks_for_the_copy_it_reads_whether_codes_or_values():
    r = MXFP8BlockScaling()
    x = GroupedTensor.quantize(_x(64, 64, 5), [32, 32], r.quantizer("input"), rowwise=False)
    w = quantize_weights(_x(64, 64, 6).view(2, 32, 64), r.quantizer("weight"), values=("rowwise",))
    with pytest.raises(ValueError, match="rowwise"):
        m_grouped_gemm(x, w)
    with pytest.raises(ValueError, match="columnwise"):
        m_grouped_gemm(GroupedTensor.quantize(_x(64, 32, 7), [32, 32], r.quantizer("grad_output")), w,
                       b_columnwise=True)


@pytest.mark.parametrize("recipe", RECIPES, ids=["mxfp8", "nvfp4"])
@pytest.mark.parametrize("recompute", [False, True], ids=["default", "recompute-weight-columnwise"])
def test_the_layer_gives_the_same_bits_when_its_copies_come_as_values(monkeypatch, recompute, recipe):
    """The reference GEMMs never ask for values (`reads_values`); made to, the MoE layer's output
    and gradients keep their bits, and every GEMM read a copy held as values (dgrad's weight copy
    too: made in the backward then, `weight_values_later`, so no copy is held in between)."""
    import qmoe
    gl = importlib.import_module("qmoe.ops.grouped_linear")

    def step():
        torch.manual_seed(0)
        layer = qmoe.nn.MoELayer(64, 64, 4, 2, params_dtype=torch.bfloat16, recompute_weight_columnwise=recompute)
        x = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
        with qmoe.autocast(recipe=recipe):
            y = layer(x)
        y.backward(torch.randn_like(y))
        return [y, x.grad] + [p.grad for p in layer.parameters()]

    codes = step()
    seen = []
    monkeypatch.setattr(gl, "_values_only", lambda quantizer, rows, groups, on, *copies: copies)
    def observe(plan, name, inputs, out):
        if name in ("fprop", "dgrad", "wgrad"):
            seen.append((name, [sorted(getattr(op, "values", None) or ()) for op in inputs]))

    with gl.observe_steps(observe):
        values = step()
    assert sorted({name for name, _ in seen}) == ["dgrad", "fprop", "wgrad"]
    for name, held in seen:  # wgrad's x copy is kept for the backward: codes, fewer bytes held
        assert held == {"fprop": [["rowwise"], ["rowwise"]], "dgrad": [["columnwise", "rowwise"], ["columnwise"]],
                        "wgrad": [["columnwise"], []]}[name], (name, held)
    for a, b in zip(codes, values):
        assert torch.equal(a, b)
