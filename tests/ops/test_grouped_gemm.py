"""Grouped GEMMs (qmoe.ops.grouped_gemm): the reference against fp64 products of the dequantized
operands, validation, grouped_linear's grouped path == its split path; on sm90+ the kernels
against the reference, with no host sync and under CUDA-graph replay with new split sizes."""
import os
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qmoe.contracts.errors import UnsupportedError
from qmoe.contracts.enums import GroupedPath
from qmoe.ops.grouped_gemm import k_grouped_gemm, m_grouped_gemm, quantize_weights, select_grouped_path
from qmoe.ops.grouped_linear import grouped_linear
from qmoe.quant import GroupedTensor
from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                          NVFP4BlockScaling)
from tests.tolerances import assert_gemm_within_contract, assert_within_tolerance, recipe_tolerance

# Stochastic rounding off: grouped and split paths then quantize identically.
RECIPES = [pytest.param(DelayedScaling(), id="delayed"), pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(Float8BlockScaling(), id="block"), pytest.param(MXFP8BlockScaling(), id="mxfp8"),
           pytest.param(NVFP4BlockScaling(disable_stochastic_rounding=True), id="nvfp4")]
LAYOUTS = ["fprop", "dgrad", "wgrad"]


def _bounds(splits):
    out, s = [], 0
    for m in splits:
        out.append((s, s + m))
        s += m
    return out


def _data(splits, n, k, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = sum(splits)
    x = torch.randn(t, k, generator=g).to(device)
    w = (torch.randn(len(splits), n, k, generator=g) / k ** 0.5).to(device)
    dy = torch.randn(t, n, generator=g).to(device)
    return x, w, dy


def _quantize(recipe, layout, splits, x, w, dy):
    """The recipe's operands for one layout: (a, b) as the op takes them."""
    q = {role: recipe.quantizer(role) for role in ("input", "weight", "grad_output")}
    if layout == "fprop":
        return (GroupedTensor.quantize(x, splits, q["input"], rowwise=True, columnwise=False),
                quantize_weights(w, q["weight"], rowwise=True, columnwise=False))
    if layout == "dgrad":
        return (GroupedTensor.quantize(dy, splits, q["grad_output"], rowwise=True, columnwise=False),
                quantize_weights(w, q["weight"], rowwise=False, columnwise=True))
    return (GroupedTensor.quantize(dy, splits, q["grad_output"], rowwise=False, columnwise=True),
            GroupedTensor.quantize(x, splits, q["input"], rowwise=False, columnwise=True))


def _run(layout, a, b, **kw):
    if layout == "wgrad":
        return k_grouped_gemm(a, b, **kw)
    return m_grouped_gemm(a, b, b_columnwise=layout == "dgrad", **kw)


def _fp64_oracle(layout, a, b, splits):
    """fp64 products of the dequantized operands, group by group."""
    bounds = _bounds(splits)
    if layout == "wgrad":
        return torch.stack([ag.dequantize(columnwise=True).double() @ bg.dequantize(columnwise=True).double().t()
                            for ag, bg in zip(a.split(), b.split())])
    ad = a.dequantize().double()
    ws = [w.dequantize(columnwise=layout == "dgrad").double() for w in b.split()]
    return torch.cat([ad[s:e] @ wg.t() for (s, e), wg in zip(bounds, ws)])


def _hp(layout, x, w, dy, splits):
    """The same product in high precision (no quantization)."""
    bounds = _bounds(splits)
    x, w, dy = x.double(), w.double(), dy.double()
    if layout == "fprop":
        return torch.cat([x[s:e] @ w[g].t() for g, (s, e) in enumerate(bounds)])
    if layout == "dgrad":
        return torch.cat([dy[s:e] @ w[g] for g, (s, e) in enumerate(bounds)])
    return torch.stack([dy[s:e].t() @ x[s:e] for s, e in bounds])


def _rel(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


# ---------------------------------------------------------------- CPU: the reference path

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_reference_matches_fp64_of_dequantized(recipe, layout):
    splits, n, k = [48, 0, 16, 64, 32], 80, 96
    x, w, dy = _data(splits, n, k)
    a, b = _quantize(recipe, layout, splits, x, w, dy)
    out = _run(layout, a, b, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert _rel(out, _fp64_oracle(layout, a, b, splits)) < 1e-5
    assert_within_tolerance(out, _hp(layout, x, w, dy, splits), *recipe_tolerance(recipe), what=layout)
    if layout == "wgrad":
        assert torch.equal(out[1], torch.zeros_like(out[1])), "an expert without tokens gets exact zeros"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_plain_tensors(layout, dtype):
    splits, n, k = [5, 0, 27, 1], 24, 40
    x, w, dy = (t.to(dtype) for t in _data(splits, n, k))
    if layout == "wgrad":
        out = k_grouped_gemm(dy, x, splits, out_dtype=torch.float32)
    else:
        a = x if layout == "fprop" else dy
        out = m_grouped_gemm(a, w, splits, b_columnwise=layout == "dgrad", out_dtype=torch.float32)
    assert _rel(out, _hp(layout, x, w, dy, splits)) < 1e-6


def test_wgrad_accumulates_into_main_grad():
    splits, n, k = [16, 0, 32], 48, 64
    x, w, dy = _data(splits, n, k)
    a, b = _quantize(MXFP8BlockScaling(), "wgrad", splits, x, w, dy)
    main_grad = torch.randn(3, n, k)
    before = main_grad.clone()
    out = k_grouped_gemm(a, b, out=main_grad, accumulate=True)
    assert out is main_grad
    assert torch.equal(main_grad[1], before[1]), "an expert without tokens leaves main_grad as it was"
    assert _rel(main_grad - before, k_grouped_gemm(a, b, out_dtype=torch.float32)) < 1e-6


def test_padding_rows_beyond_the_groups_are_zero():
    r = Float8CurrentScaling()
    x = torch.randn(40, 32)
    x[36:] = 0  # rows no group owns (worst-case static buffers)
    xq = GroupedTensor.quantize(x, torch.tensor([20, 16]), r.quantizer("input"), columnwise=False, validate=False)
    wq = quantize_weights(torch.randn(2, 24, 32), r.quantizer("weight"))
    out = m_grouped_gemm(xq, wq)
    assert out.shape == (40, 24)
    assert torch.equal(out[36:], torch.zeros_like(out[36:]))


def _recipe_for(i):
    return [DelayedScaling(), Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling(),
            NVFP4BlockScaling(disable_stochastic_rounding=True)][i]


def draw_jagged_splits(data, runs_of_16: bool) -> list[int]:
    """1-5 groups of 0-28 tokens (empty groups, odd starts), sometimes one group holding every
    token, never all empty; runs_of_16: multiples of 16 (NVFP4's columnwise Hadamard copies)."""
    groups = data.draw(st.integers(1, 5))
    splits = data.draw(st.lists(st.integers(0, 4).map(lambda v: v * (16 if runs_of_16 else 7)),
                                min_size=groups, max_size=groups))
    if data.draw(st.booleans()):  # one group holds every token
        splits = [0] * groups
        splits[data.draw(st.integers(0, groups - 1))] = 48 if runs_of_16 else 37
    if sum(splits) == 0:
        splits[0] = 32 if runs_of_16 else 2
    return splits


# a recipe (index into _recipe_for), a layout and even N / K; with draw_jagged_case, the operands
JAGGED_CASES = dict(data=st.data(), recipe_i=st.integers(0, 4), layout=st.sampled_from(LAYOUTS),
                    n=st.integers(1, 40).map(lambda v: 2 * v), k=st.integers(1, 40).map(lambda v: 2 * v))


def draw_jagged_case(data, recipe_i, layout, n, k):
    """(recipe, splits, a, b): the layout's quantized operands on jagged splits from `data`."""
    recipe = _recipe_for(recipe_i)
    splits = draw_jagged_splits(data, runs_of_16=recipe_i == 4)
    x, w, dy = _data(splits, n, k, seed=data.draw(st.integers(0, 2 ** 16)))
    return (recipe, splits, *_quantize(recipe, layout, splits, x, w, dy))


@given(**JAGGED_CASES)
def test_jagged_splits(data, recipe_i, layout, n, k):
    """Any splits (zeros, one group holding everything), any even K/N: reference == fp64 oracle."""
    _, splits, a, b = draw_jagged_case(data, recipe_i, layout, n, k)
    out = _run(layout, a, b, out_dtype=torch.float32)
    assert _rel(out, _fp64_oracle(layout, a, b, splits)) < 1e-5


def _linear_both_paths(recipe, splits, x, w, dy):
    """{path: (y, dx, dW)} of grouped_linear on the grouped and the split path."""
    got = {}
    for path in ("grouped", "split"):
        # fresh quantizers per path: a delayed-scaling quantizer's scale moves after each use
        q = {role: recipe.quantizer(role) for role in ("input", "weight", "grad_output")}
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = grouped_linear(xi, torch.tensor(splits, device=x.device), wi, quantizers=q, path=path)
        y.backward(dy)
        got[path] = (y.detach(), xi.grad, wi.grad)
    return got


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_path_equals_split_path(recipe):
    """The grouped path (one GroupedTensor and one grouped GEMM per step) and the split path
    (every group quantized with its own for_group quantizer, multiplied on its own) agree bit for
    bit in fprop, dgrad and wgrad."""
    splits, n, k = [32, 0, 16, 48], 64, 96
    got = _linear_both_paths(recipe, splits, *_data(splits, n, k))
    for name, a, b in zip(("y", "dx", "dW"), got["grouped"], got["split"]):
        assert torch.equal(a, b), name


def test_select_grouped_path():
    assert select_grouped_path("auto", "cpu") is GroupedPath.GROUPED
    assert select_grouped_path("split", "cpu") is GroupedPath.SPLIT
    with pytest.raises(ValueError, match="grouped_path"):
        select_grouped_path("fastest", "cpu")


def _bad_inputs():
    r, m = Float8CurrentScaling(), MXFP8BlockScaling()
    x = torch.randn(32, 64)
    xq = GroupedTensor.quantize(x, [16, 16], r.quantizer("input"))
    wq = quantize_weights(torch.randn(2, 48, 64), r.quantizer("weight"), rowwise=True, columnwise=False)
    w_mx = quantize_weights(torch.randn(2, 48, 64), m.quantizer("weight"))
    w3 = quantize_weights(torch.randn(3, 48, 64), r.quantizer("weight"))
    w_k = quantize_weights(torch.randn(2, 48, 40), r.quantizer("weight"))
    xb = GroupedTensor.quantize(x, [16, 16], Float8BlockScaling().quantizer("weight"))
    row_only = GroupedTensor.quantize(x, [16, 16], r.quantizer("input"), columnwise=False)
    w = torch.randn(2, 48, 64)
    return [
        ("out dtype", lambda: m_grouped_gemm(xq, wq, out_dtype=torch.int32), TypeError, "out_dtype"),
        ("two recipes", lambda: m_grouped_gemm(xq, w_mx), ValueError, "different recipes"),
        ("group count", lambda: m_grouped_gemm(xq, w3), ValueError, "groups"),
        ("contraction", lambda: m_grouped_gemm(xq, w_k), ValueError, "features"),
        ("dgrad without columnwise W", lambda: m_grouped_gemm(xq, wq, b_columnwise=True), ValueError, "columnwise"),
        ("2-D blocks as tokens", lambda: m_grouped_gemm(xb, quantize_weights(w, Float8BlockScaling().quantizer(
            "weight"))), ValueError, "input or grad_output"),
        ("mixed kinds", lambda: m_grouped_gemm(x, wq), TypeError, "GroupedTensor"),
        ("no splits", lambda: m_grouped_gemm(x, w), ValueError, "split_sizes"),
        ("bad sum", lambda: m_grouped_gemm(x, w, [16, 17]), ValueError, "sum to 33"),
        ("negative", lambda: m_grouped_gemm(x, w, [40, -8]), ValueError, "non-negative"),
        ("split count", lambda: m_grouped_gemm(x, w, [32]), ValueError, "entries"),
        ("int tensor", lambda: m_grouped_gemm(x.long(), w, [16, 16]), TypeError, "bf16"),
        ("dtype mismatch", lambda: m_grouped_gemm(x, w.double(), [16, 16]), TypeError, "bf16"),
        ("wgrad without columnwise", lambda: k_grouped_gemm(row_only, row_only), ValueError, "columnwise"),
        ("accumulate without out", lambda: k_grouped_gemm(xq, xq, accumulate=True), ValueError, "out="),
        ("out shape", lambda: k_grouped_gemm(xq, xq, out=torch.zeros(2, 64, 63)), ValueError, "shape"),
        ("weights not a stack", lambda: quantize_weights(w[0], r.quantizer("weight")), ValueError, r"\[E, N, K\]"),
    ]


@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda c: c[0])
def test_bad_input_raises_before_any_kernel(case):
    _, fn, exc, match = case
    with pytest.raises(exc, match=match):
        fn()


# ---------------------------------------------------------------- GPU: kernels vs the reference

GPU_SPLITS = [0, 131, 1, 257, 66, 0, 99]  # jagged: empty experts, a one-token expert, odd starts
GPU_SPLITS_16 = [0, 128, 16, 256, 64, 0, 96]  # NVFP4 with RHT: runs of 16 tokens


def _gpu_case(recipe, layout, seed=0):
    splits = GPU_SPLITS_16 if isinstance(recipe, NVFP4BlockScaling) and not recipe.disable_rht else GPU_SPLITS
    x, w, dy = _data(splits, 328, 448, "cuda", seed)  # N, K: not multiples of the tiles
    return splits, _quantize(recipe, layout, splits, x, w, dy)


def _routes(recipe):
    return ["fused", "dequant"] if isinstance(recipe, (MXFP8BlockScaling, NVFP4BlockScaling)) else ["auto"]


GPU_RECIPES = RECIPES + [pytest.param(NVFP4BlockScaling(disable_stochastic_rounding=True, disable_rht=True),
                                      id="nvfp4-odd-groups")]


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_kernels_match_reference(recipe, layout, out_dtype):
    from qmoe.kernels import grouped_gemm as kernels
    from qmoe.reference import grouped_gemm as reference

    splits, (a, b) = _gpu_case(recipe, layout)
    if layout == "wgrad":
        ref = reference.k_grouped_gemm(a, b, out_dtype=torch.float32)
    else:
        ref = reference.m_grouped_gemm(a, b, b_columnwise=layout == "dgrad", out_dtype=torch.float32)
    for route in _routes(recipe):
        if layout == "wgrad":
            out = torch.full(ref.shape, float("nan"), dtype=out_dtype, device="cuda")  # every element written
            kernels.k_grouped_gemm_with(a, b, out=out, route=route)
        else:
            out = kernels.m_grouped_gemm_with(a, b, b_columnwise=layout == "dgrad", out_dtype=out_dtype, route=route)
        assert out.dtype == out_dtype and out.shape == ref.shape
        assert torch.isfinite(out).all(), route
        assert_gemm_within_contract(out, ref, route)
        if layout == "wgrad":
            assert (out[[0, 5]] == 0).all(), "experts without tokens get exact zeros"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["fprop", "dgrad"])
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_every_small_m_tile_matches_reference(recipe, layout):
    """Few rows per group: swapped tiles (token tiles of 16-64 rows) and the plain ones."""
    from qmoe.kernels import grouped_gemm as kernels
    from qmoe.reference import grouped_gemm as reference
    from qmoe.contracts.enums import scaling_of

    splits, (a, b) = _gpu_case(recipe, layout)
    ref = reference.m_grouped_gemm(a, b, b_columnwise=layout == "dgrad", out_dtype=torch.float32)
    for rows in (16, 64):
        for cfg in kernels.tile_configs(scaling_of(a), small_m=True, rows_per_group=rows):
            out = kernels.m_grouped_gemm_with(a, b, b_columnwise=layout == "dgrad", out_dtype=torch.float32,
                                              route="fused", config=cfg)
            assert torch.isfinite(out).all(), cfg
            assert _rel(out, ref) <= 1e-3, f"{cfg}: {_rel(out, ref)}"


def check_token_grouped_dequantize(a):
    """wgrad's exact dequantize pass over a token-grouped columnwise copy (MXFP8 / NVFP4): its
    group-aligned tiles (code pairs where a group starts on an even token, single codes
    elsewhere) give each group's columnwise values bit for bit, at the default tile and at one
    narrower than most groups, in either layout."""
    from qmoe.kernels import grouped_gemm as kernels
    from qmoe.contracts.enums import scaling_of
    from qmoe.reference.grouped_gemm import _columnwise_parts

    scaling = scaling_of(a)
    op = kernels.tokens_operand(a, scaling)
    want = torch.cat(_columnwise_parts(a), 1)
    for tile, token_major in ((None, False), ((16, 32, 4), False), (None, True), ((16, 32, 4), True)):
        out = kernels._dequantized_tokens(a, op, scaling, tile=tile, token_major=token_major).float()
        assert (out.stride(0) == 1) == token_major, "token_major: features contiguous"
        if op.factor is not None:  # NVFP4: the GEMM applies each group's tensor factor in its epilogue
            bounds = a.offsets.tolist()
            out = torch.cat([out[:, s:e] * f for s, e, f in zip(bounds[:-1], bounds[1:], op.factor)], 1)
        assert torch.equal(out[:, :want.shape[1]], want), (tile, token_major)


def check_mxfp8_dequantize_saturates(device):
    """MXFP8 codes whose value lies past bf16's range (an inf in x becomes its block's largest
    code) dequantize to bf16's largest finite value in the emulated GEMMs' passes, as
    GroupedTensor.dequantize does (NUMERICS.md: finite in, finite out), NaN kept: the rows' pass,
    wgrad's token-grouped pass, and a GEMM from codes by either route, which then equals the GEMM
    from the exact values."""
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import grouped_gemm as kernels

    splits, k, big = [32, 0, 64], 128, torch.finfo(torch.bfloat16).max
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(splits), k, generator=g)
    x[3, 5], x[40, 33], x[70, 100], x[71, 100] = float("inf"), -float("inf"), big, -big
    x[90, 64] = float("nan")
    x = x.to(torch.bfloat16).to(device)
    w = (torch.randn(len(splits), 48, k, generator=g) / k).to(device)
    recipe = MXFP8BlockScaling()

    def quantize(**copies):
        return GroupedTensor.quantize(x, splits, recipe.quantizer("input"), rowwise=True, **copies)
    a, held = quantize(columnwise=True), quantize(columnwise=False, values=("rowwise",))
    if held.exact_values(False) is None:  # kernels that write codes only (the interpreter's, whose fp8
        with mock.patch.dict(os.environ, {"QMOE_BACKEND": "reference"}):  # casts round their own way)
            a, held = quantize(columnwise=True), quantize(columnwise=False, values=("rowwise",))
    assert held.exact_values(False) is not None, "the rows are held as values"
    want = a.dequantize(torch.bfloat16).float()
    assert (want.abs() == big).sum() >= 2 and want.isnan().any(), "the case reaches past bf16's range"

    def same(got, want):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[~got.isnan()], want[~want.isnan()])

    rows = sum(splits)
    same(kernels._dequantized(kernels.activation_operand(a, Scaling.MX), Scaling.MX, rows, k, rows, k, (rows, k),
                              (k, 1)).float(), want)
    tokens = kernels._dequantized_tokens(a, kernels.tokens_operand(a, Scaling.MX), Scaling.MX, token_major=True)
    same(tokens.float().t()[:rows], a.dequantize(torch.bfloat16, columnwise=True).float().t())

    finite = ~x.float().isnan().any(1)  # the NaN's block is NaN: its row is too
    wq = quantize_weights(w, recipe.quantizer("weight"), rowwise=True, columnwise=False)
    from_values = kernels.m_grouped_gemm_with(held, wq, out_dtype=torch.float32, route="dequant")
    for route in ("dequant", "fused"):
        out = kernels.m_grouped_gemm_with(a, wq, out_dtype=torch.float32, route=route)
        assert torch.isfinite(out[finite]).all(), route
        if route == "dequant":
            assert torch.equal(out[finite], from_values[finite])
        else:  # the fused kernel sums in its own order
            assert _rel(out[finite], from_values[finite]) <= 1e-5


@pytest.mark.gpu
def test_mxfp8_dequantize_saturates():
    check_mxfp8_dequantize_saturates("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [r for r in GPU_RECIPES if r.id in ("mxfp8", "nvfp4", "nvfp4-odd-groups")])
def test_token_grouped_dequantize_is_exact(recipe):
    _, (a, _) = _gpu_case(recipe, "wgrad")
    check_token_grouped_dequantize(a)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["fprop", "dgrad"])
def test_every_block_tile_matches_reference(layout):
    """FP8 block: per-tile weight scales (BN within one 128-row block), the per-column outer
    product, at every candidate tile."""
    from dataclasses import replace

    from qmoe.kernels import grouped_gemm as kernels
    from qmoe.reference import grouped_gemm as reference
    from qmoe.contracts.enums import Scaling

    splits, (a, b) = _gpu_case(Float8BlockScaling(), layout)
    ref = reference.m_grouped_gemm(a, b, b_columnwise=layout == "dgrad", out_dtype=torch.float32)
    tiles = kernels.tile_configs(Scaling.BLOCK, small_m=False)
    for cfg in tiles + [replace(c, tile_scale=False) for c in tiles]:
        out = kernels.m_grouped_gemm_with(a, b, b_columnwise=layout == "dgrad", out_dtype=torch.float32, config=cfg)
        assert torch.isfinite(out).all(), cfg
        assert _rel(out, ref) <= 1e-3, f"{cfg}: {_rel(out, ref)}"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_plain_kernels_match(layout):
    for dtype in (torch.bfloat16, torch.float32):
        x, w, dy = (t.to(dtype) for t in _data(GPU_SPLITS, 328, 448, "cuda"))
        ref = _hp(layout, x, w, dy, GPU_SPLITS)
        if layout == "wgrad":
            out = k_grouped_gemm(dy, x, torch.tensor(GPU_SPLITS, device="cuda"), out_dtype=torch.float32)
        else:
            a = x if layout == "fprop" else dy
            out = m_grouped_gemm(a, w, torch.tensor(GPU_SPLITS, device="cuda"), b_columnwise=layout == "dgrad",
                                 out_dtype=torch.float32)
        assert _rel(out, ref) <= (1e-2 if dtype == torch.bfloat16 else 1e-4), dtype


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [None, MXFP8BlockScaling()], ids=["bf16", "mxfp8"])
def test_wgrad_runs_on_torch_grouped_mm_where_it_can(recipe, monkeypatch):
    """bf16-out wgrad (plain bf16, MXFP8's dequantize route) runs torch._grouped_mm, tokens as its
    grouped contraction, at any group sizes (jagged, odd: features contiguous, so CUTLASS asserts
    nothing per group); otherwise the Triton kernel: plain operands with tokens contiguous or
    unaligned feature strides, fp32 output. Every case within the GEMM contract, experts
    without tokens exactly zero."""
    from qmoe.kernels import grouped_gemm as kernels
    from qmoe.reference import grouped_gemm as reference

    calls = []
    real = torch._grouped_mm

    def spy(a, b, *args, **kw):
        calls.append((a.dim(), b.dim()))
        return real(a, b, *args, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    splits = torch.tensor(GPU_SPLITS, device="cuda")
    if recipe is None:
        def run(k, tokens_contiguous=False, out_dtype=torch.bfloat16):
            x, w, dy = (t.bfloat16() for t in _data(GPU_SPLITS, 328, k, "cuda"))
            if tokens_contiguous:
                dy, x = dy.t().contiguous().t(), x.t().contiguous().t()
            return kernels.k_grouped_gemm_with(dy, x, splits, out_dtype=out_dtype), _hp("wgrad", x, w, dy, GPU_SPLITS)
        cases = {"aligned": (lambda: run(448), True), "k=450": (lambda: run(450), False),
                 "tokens contiguous": (lambda: run(448, tokens_contiguous=True), False),
                 "fp32 out": (lambda: run(448, out_dtype=torch.float32), False)}
    else:
        a, b = _quantize(recipe, "wgrad", GPU_SPLITS, *_data(GPU_SPLITS, 328, 448, "cuda"))
        ref = reference.k_grouped_gemm(a, b, out_dtype=torch.float32)

        def run(out_dtype):
            return kernels.k_grouped_gemm_with(a, b, route="dequant", out_dtype=out_dtype), ref
        cases = {"bf16 out": (lambda: run(torch.bfloat16), True), "fp32 out": (lambda: run(torch.float32), False)}
    for name, (go, on_torch) in cases.items():
        calls.clear()
        out, ref = go()
        assert calls == ([(2, 2)] if on_torch else []), (name, calls)
        assert out.shape == ref.shape, name
        assert_gemm_within_contract(out, ref, name)
        assert (out[[0, 5]] == 0).all(), f"{name}: experts without tokens get exact zeros"


@pytest.mark.gpu
def test_gpu_wgrad_accumulate():
    r = MXFP8BlockScaling()
    splits, (a, b) = _gpu_case(r, "wgrad")
    main_grad = torch.randn(len(splits), 328, 448, device="cuda")
    before = main_grad.clone()
    k_grouped_gemm(a, b, out=main_grad, accumulate=True)
    assert torch.equal(main_grad[0], before[0])
    assert _rel(main_grad - before, k_grouped_gemm(a, b, out_dtype=torch.float32)) < 1e-5


@pytest.mark.gpu
def test_gpu_grouped_path_equals_split_path():
    """The kernels' grouped path against the split path: the same quantized operands (each group
    quantized alone equals its slice of the GroupedTensor), and the split path multiplies their
    dequantized values in fp32, which is NUMERICS.md's GEMM reference: fprop, dgrad and wgrad
    within the GEMM contract (fp32 outputs)."""
    r = MXFP8BlockScaling()
    got = _linear_both_paths(r, GPU_SPLITS, *_data(GPU_SPLITS, 328, 448, "cuda"))
    for name, a, b in zip(("y", "dx", "dW"), got["grouped"], got["split"]):
        assert_gemm_within_contract(a, b, name)


def _copy_into(static, fresh):
    for name in ("split_sizes", "offsets", "rowwise_data", "rowwise_scale_inv", "columnwise_data",
                 "columnwise_scale_inv", "amax", "columnwise_amax", "rowwise_scale_offsets",
                 "columnwise_scale_offsets"):
        s = getattr(static, name)
        if s is not None:
            s.copy_(getattr(fresh, name))


GRAPH_RECIPES = [None, Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling(),
                 NVFP4BlockScaling(disable_stochastic_rounding=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GRAPH_RECIPES, ids=["bf16", "current", "block", "mxfp8", "nvfp4"])
def test_no_host_sync_and_graph_replay_with_new_splits(recipe):
    dev = "cuda"
    old, new = [64, 0, 192, 128], [0, 256, 96, 32]  # same total, different experts
    x, w, dy = _data(old, 256, 384, dev)
    x2, _, dy2 = _data(new, 256, 384, dev, seed=1)
    if recipe is None:
        splits = torch.tensor(old, device=dev)
        xb, dyb, wb = x.bfloat16(), dy.bfloat16(), w.bfloat16()

        def step():  # wgrad both ways: bf16 out on torch._grouped_mm, fp32 out on the Triton kernel
            return (m_grouped_gemm(xb, wb, splits), m_grouped_gemm(dyb, wb, splits, b_columnwise=True),
                    k_grouped_gemm(dyb, xb, splits, out_dtype=torch.float32), k_grouped_gemm(dyb, xb, splits))

        def refill():
            splits.copy_(torch.tensor(new, device=dev))
            xb.copy_(x2.bfloat16())
            dyb.copy_(dy2.bfloat16())
    else:
        q = {role: recipe.quantizer(role) for role in ("input", "weight", "grad_output")}
        xq = GroupedTensor.quantize(x, torch.tensor(old, device=dev), q["input"], validate=False)
        dyq = GroupedTensor.quantize(dy, torch.tensor(old, device=dev), q["grad_output"], validate=False)
        wq = quantize_weights(w, q["weight"], columnwise=True)

        def step():
            return (m_grouped_gemm(xq, wq), m_grouped_gemm(dyq, wq, b_columnwise=True),
                    k_grouped_gemm(dyq, xq, out_dtype=torch.float32))

        def refill():
            _copy_into(xq, GroupedTensor.quantize(x2, torch.tensor(new, device=dev), q["input"], validate=False))
            _copy_into(dyq, GroupedTensor.quantize(dy2, torch.tensor(new, device=dev), q["grad_output"],
                                                   validate=False))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile and warm up off the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager_old = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    graph.replay()
    for got, want in zip(static_out, eager_old):
        assert torch.equal(got, want)
    refill()
    graph.replay()
    eager_new = step()
    for got, want in zip(static_out, eager_new):
        assert torch.equal(got, want)
    assert not torch.equal(static_out[2], eager_old[2])


@pytest.mark.gpu
def test_native_block_scaled_path_is_guarded_on_hopper():
    from qmoe.kernels.grouped_gemm import native_block_scaled_gemm
    from qmoe.contracts.enums import Scaling

    if torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("sm100 has native block-scaled tensor cores")
    with pytest.raises(UnsupportedError, match="sm100"):
        native_block_scaled_gemm(Scaling.MX, torch.device("cuda"))
