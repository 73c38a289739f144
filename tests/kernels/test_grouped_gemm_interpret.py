"""The grouped GEMM kernels == the reference on the CPU, through Triton's interpreter.

The GPU tests (tests/ops/test_grouped_gemm.py, marked gpu) are the real check; this one keeps
the kernel bodies honest on a CPU-only CI: tile scheduling over jagged groups from device
offsets, swapped small-M tiles, masked K tails, the per-group scale layouts of every recipe,
both MXFP8 / NVFP4 routes, the k-grouped wgrad, and hypothesis-drawn splits. As in test_routing_interpret.py the one
test of the normal session re-runs this file in a fresh interpreter (TRITON_INTERPRET=1 must
be set before Triton decorates the kernels). Under the interpreter tl.dot multiplies fp32
tiles (the kernels hand it bf16 tiles as the same fp32 values, see _grouped_gemm_jit.py)
and the NVFP4 decode takes its arithmetic path instead of the inline-PTX one, so both sides
are exact products summed in fp32 in different orders: rtol 1e-5 of the output's norm.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                          NVFP4BlockScaling)
from tests.kernels.interpret import inside, launcher, assert_passed_under_interpreter
from tests.ops.test_grouped_gemm import (JAGGED_CASES, _data, _quantize, _rel, check_mxfp8_dequantize_saturates,
                                        check_token_grouped_dequantize, draw_jagged_case)

SPLITS = [0, 19, 1, 40, 0, 8]  # empty experts, a one-token expert, odd group starts (even total: NVFP4 columnwise)
SPLITS_16 = [0, 32, 16, 48, 0, 16]  # NVFP4 with RHT: runs of 16 tokens
N, K = 88, 208  # neither a multiple of the 64/128-wide tiles
RECIPES = [pytest.param(DelayedScaling(), id="delayed"), pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(Float8BlockScaling(), id="block"), pytest.param(MXFP8BlockScaling(), id="mxfp8"),
           pytest.param(NVFP4BlockScaling(disable_stochastic_rounding=True), id="nvfp4"),
           pytest.param(NVFP4BlockScaling(disable_stochastic_rounding=True, disable_rht=True), id="nvfp4-odd-groups")]


@launcher
def test_grouped_gemm_kernels_under_the_interpreter():
    # everything passed there (the interpreter warns of the divisions its masked lanes do); the
    # one skip is this launcher test itself
    assert_passed_under_interpreter(__file__, r"\b\d+ passed, 1 skipped(, \d+ warnings)? in ")


def _case(recipe, layout):
    nvfp4_rht = isinstance(recipe, NVFP4BlockScaling) and not recipe.disable_rht
    splits = SPLITS_16 if nvfp4_rht else SPLITS
    x, w, dy = _data(splits, N, K, seed=3)
    return splits, _quantize(recipe, layout, splits, x, w, dy)


def _check_steps_major_activations(recipe, gt, columnwise):
    """The casts' 1-D block scales (FP8 1 x 128, MXFP8) reach the GEMM as they were stored
    (steps-major, rows padded to 16 bytes), while the attribute users read holds the same values
    row-major."""
    from qmoe.contracts.scales import gemm_scale

    if not isinstance(recipe, (Float8BlockScaling, MXFP8BlockScaling)):
        return
    stored = gemm_scale(gt, columnwise)
    per_16_bytes = 16 // stored.element_size()
    assert stored.stride(0) == 1 and stored.stride(1) % per_16_bytes == 0 and stored.stride(1) >= stored.shape[0]
    public = gt.columnwise_scale_inv if columnwise else gt.rowwise_scale_inv
    assert public.is_contiguous() and torch.equal(public, stored)


def _routes(recipe):
    return ["fused", "dequant"] if isinstance(recipe, (MXFP8BlockScaling, NVFP4BlockScaling)) else ["auto"]


@inside
@pytest.mark.parametrize("layout", ["fprop", "dgrad"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_m_grouped_kernel_matches_reference(recipe, layout):
    from qmoe.kernels import grouped_gemm as kernels
    from qmoe.reference import grouped_gemm as reference
    from qmoe.contracts.enums import scaling_of

    _, (a, b) = _case(recipe, layout)
    columnwise = layout == "dgrad"
    _check_steps_major_activations(recipe, a, False)
    ref = reference.m_grouped_gemm(a, b, b_columnwise=columnwise, out_dtype=torch.float32)
    small = kernels.tile_configs(scaling_of(a), small_m=True, rows_per_group=16)
    configs = [None, next(c for c in small if c.swap), next(c for c in small if not c.swap)]
    if isinstance(recipe, Float8BlockScaling):  # the per-column promotion beside the per-tile one
        configs += [kernels.TileConfig(128, 128, 128, 8, 2, tile_scale=False)]
    for route in _routes(recipe):
        for cfg in configs if route != "dequant" else [None]:
            out = kernels.m_grouped_gemm_with(a, b, b_columnwise=columnwise, out_dtype=torch.float32, route=route,
                                              config=cfg)
            assert out.shape == ref.shape and torch.isfinite(out).all(), (route, cfg)
            assert _rel(out, ref) <= 1e-5, (route, cfg, _rel(out, ref))
    out16 = kernels.m_grouped_gemm_with(a, b, b_columnwise=columnwise, out_dtype=torch.bfloat16,
                                        route=_routes(recipe)[0])
    assert _rel(out16, ref) <= 1e-2  # the fp32 result rounded to bf16


@inside
@pytest.mark.parametrize("recipe", RECIPES)
def test_k_grouped_kernel_matches_reference_and_zeros_empty_experts(recipe):
    from qmoe.kernels import grouped_gemm as kernels
    from qmoe.reference import grouped_gemm as reference

    splits, (a, b) = _case(recipe, "wgrad")
    _check_steps_major_activations(recipe, a, True)
    _check_steps_major_activations(recipe, b, True)
    ref = reference.k_grouped_gemm(a, b, out_dtype=torch.float32)
    for route in _routes(recipe):
        out = torch.full(ref.shape, float("nan"))  # every element must be written
        kernels.k_grouped_gemm_with(a, b, out=out, route=route)
        assert torch.isfinite(out).all(), route
        assert _rel(out, ref) <= 1e-5, (route, _rel(out, ref))
        empty = [g for g, m in enumerate(splits) if m == 0]
        assert (out[empty] == 0).all(), "experts without tokens get exact zeros"
        main_grad = torch.randn(ref.shape)
        before = main_grad.clone()
        kernels.k_grouped_gemm_with(a, b, out=main_grad, accumulate=True, route=route)
        assert _rel(main_grad - before, ref) <= 1e-5, route


@inside
@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.id in ("mxfp8", "nvfp4", "nvfp4-odd-groups")])
def test_token_grouped_dequantize_is_exact(recipe):
    _, (a, _) = _case(recipe, "wgrad")
    check_token_grouped_dequantize(a)


@inside
def test_mxfp8_dequantize_saturates():
    check_mxfp8_dequantize_saturates("cpu")


@inside
@settings(max_examples=25, deadline=None)
@given(**JAGGED_CASES)
def test_kernels_match_reference_on_jagged_splits(data, recipe_i, layout, n, k):
    """Hypothesis-drawn splits (zeros, one group holding everything), any even N/K, either route."""
    from qmoe.kernels import grouped_gemm as kernels
    from qmoe.reference import grouped_gemm as reference

    recipe, splits, a, b = draw_jagged_case(data, recipe_i, layout, n, k)
    route = data.draw(st.sampled_from(_routes(recipe)))
    if layout == "wgrad":
        ref = reference.k_grouped_gemm(a, b, out_dtype=torch.float32)
        out = kernels.k_grouped_gemm_with(a, b, out_dtype=torch.float32, route=route)
    else:
        ref = reference.m_grouped_gemm(a, b, b_columnwise=layout == "dgrad", out_dtype=torch.float32)
        out = kernels.m_grouped_gemm_with(a, b, b_columnwise=layout == "dgrad", out_dtype=torch.float32,
                                          route=route)
    assert out.shape == ref.shape
    assert _rel(out, ref) <= 1e-5, (splits, route, _rel(out, ref))
