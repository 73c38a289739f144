"""Every deterministic quantizer, bit for bit against the independent oracle (tests/quant/oracle.py).

Codes are compared as raw bytes (`.view(torch.uint8)`), scales as raw bits in their canonical
layout (NUMERICS.md "Canonical scale layout"), for rowwise and columnwise copies, every recipe
and role, E4M3 and E5M2, with shapes whose K and M are not multiples of the block.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle as O
from qmoe import QuantizedTensor
from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling,
                          NVFP4BlockScaling, ScaleMode)

ROLES = ("input", "weight", "grad_output")


def raw(t: torch.Tensor) -> np.ndarray:
    """Raw bits of a tensor: int32 for float32, uint8 for 1-byte dtypes."""
    t = t.detach().cpu().contiguous()
    return (t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)).numpy()


def raw_np(a: np.ndarray) -> np.ndarray:
    return a.view(np.int32) if a.dtype == np.float32 else a


def assert_bits_equal(got: torch.Tensor, want: np.ndarray, what: str):
    g, w = raw(got), raw_np(np.array(want, order="C"))
    assert g.shape == w.shape, f"{what}: shape {g.shape} != expected {w.shape}"
    g, w = np.atleast_1d(g), np.atleast_1d(w)
    bad = np.argwhere(g != w)
    assert bad.size == 0, (f"{what}: {len(bad)} of {g.size} differ; first at {tuple(bad[0])}: "
                           f"got {g[tuple(bad[0])]:#x}, expected {w[tuple(bad[0])]:#x}")


def assert_quantized_as(qt: QuantizedTensor, spec: O.Spec, x: np.ndarray, rowwise=True, columnwise=True):
    if rowwise:
        e = O.expected(spec, x)
        assert_bits_equal(qt.rowwise_data, e["data"], "rowwise data")
        assert_bits_equal(qt.rowwise_scale_inv, e["scale"], "rowwise scale")
        if e["amax"] is not None:
            assert_bits_equal(qt.amax, e["amax"], "amax")
    if columnwise:
        xt = np.ascontiguousarray(x.T)
        if spec.rht:
            xt = O.rht_float64(xt).astype(np.float32)
        e = O.expected(spec, xt)
        assert_bits_equal(qt.columnwise_data, e["data"], "columnwise data")
        assert_bits_equal(qt.columnwise_scale_inv, e["scale"], "columnwise scale")
        if e["amax"] is not None:
            assert_bits_equal(qt.columnwise_amax, e["amax"], "columnwise amax")


# ---------------------------------------------------------------- cases

DETERMINISTIC = [
    pytest.param(Float8CurrentScaling(), id="current-hybrid"),
    pytest.param(Float8CurrentScaling(fp8_format=Format.E4M3, power_2_scale=True), id="current-e4m3-pow2"),
    pytest.param(Float8CurrentScaling(amax_epsilon=3.0), id="current-eps"),
    pytest.param(Float8BlockScaling(), id="block-pow2"),
    pytest.param(Float8BlockScaling(use_f32_scales=True), id="block-f32"),
    pytest.param(Float8BlockScaling(fp8_format=Format.HYBRID, amax_epsilon=0.5), id="block-hybrid-eps"),
    pytest.param(MXFP8BlockScaling(), id="mxfp8-roundup"),
    pytest.param(MXFP8BlockScaling(scale_mode=ScaleMode.FLOOR), id="mxfp8-floor"),
    pytest.param(MXFP8BlockScaling(fp8_format=Format.HYBRID), id="mxfp8-hybrid-roundup"),
    pytest.param(MXFP8BlockScaling(fp8_format=Format.HYBRID, scale_mode=ScaleMode.FLOOR), id="mxfp8-hybrid-floor"),
    pytest.param(NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True), id="nvfp4"),
    pytest.param(NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                   disable_2d_quantization=True), id="nvfp4-1d-weight"),
]

# (M, K): K and M not multiples of 16, 32 or 128 (partial trailing blocks); even for NVFP4 packing.
SHAPES = [pytest.param(130, 146, torch.float32, id="130x146-f32"),
          pytest.param(48, 36, torch.bfloat16, id="48x36-bf16"),
          pytest.param(2, 18, torch.float16, id="2x18-f16")]


def sample(m: int, k: int, dtype, seed: int = 0) -> torch.Tensor:
    """Heavy-tailed values spanning many binades, some zero rows and zero elements, in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(2.0 * torch.randn(m, k, generator=g))
    x = x * torch.exp2(torch.randint(-6, 7, (m, 1), generator=g).float())  # rows of different size
    x[torch.rand(m, k, generator=g) < 0.05] = 0.0
    if m > 3:
        x[m // 3] = 0.0
    limit = 6e4 if dtype == torch.float16 else 1e30  # keep fp16 finite
    return x.clamp(-limit, limit).to(dtype)


@pytest.mark.parametrize("m, k, dtype", SHAPES)
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("recipe", DETERMINISTIC)
def test_quantize_matches_oracle(recipe, role, m, k, dtype):
    spec = O.spec_for(recipe, role)
    x = sample(m, k, dtype, seed=m * 1000 + k)
    qt = recipe.quantizer(role).quantize(x, rowwise=True, columnwise=True)
    xn = x.float().numpy()
    assert_quantized_as(qt, spec, xn)
    want = O.expected_dequantized(spec, xn)
    got = qt.dequantize(torch.float32)
    assert_bits_equal(got, want, "dequantized")
    assert torch.equal(qt.dequantize(torch.bfloat16), got.to(torch.bfloat16))


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("recipe", DETERMINISTIC)
@settings(max_examples=6)
@given(m=st.integers(1, 70), k=st.integers(1, 150), seed=st.integers(0, 2**31 - 1),
       log2_size=st.integers(-100, 100))
def test_quantize_matches_oracle_random_shapes(recipe, role, m, k, seed, log2_size):
    spec = O.spec_for(recipe, role)
    if spec.kind == "nvfp4":
        m, k = m + m % 2, k + k % 2
    x = sample(m, k, torch.float32, seed) * 2.0 ** log2_size
    qt = recipe.quantizer(role).quantize(x)
    assert_quantized_as(qt, spec, x.numpy())


def tie_input(spec: O.Spec) -> np.ndarray:
    """Every value exactly halfway between two neighbouring codes (both signs), each block holding
    the format's maximum so that its scale is exactly 1 (NVFP4: S_enc = 1 and s_b = 1)."""
    grid = O.E2M1_GRID if spec.kind == "nvfp4" else O.FP8_GRID[spec.fmt]
    mids = (grid[:-1] + grid[1:]) / 2
    mids = np.concatenate([mids, -mids]).astype(np.float32)
    k = 16 if spec.kind == "nvfp4" else 32
    rows = -(-len(mids) // (k - 1))
    body = np.zeros(rows * (k - 1), dtype=np.float32)
    body[: len(mids)] = mids
    x = np.concatenate([np.full((rows, 1), grid[-1], dtype=np.float32), body.reshape(rows, k - 1)], axis=1)
    if spec.kind == "nvfp4":  # the tensor amax 448 * 6 sits in a block of its own (also for 16x16)
        x = np.concatenate([x, np.zeros((32 - rows, k), dtype=np.float32)])
        x[16, 0] = 448.0 * 6.0
    return x


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("recipe", DETERMINISTIC)
def test_ties_round_to_even(recipe, role):
    spec = O.spec_for(recipe, role)
    x = tie_input(spec)
    grid = O.E2M1_GRID if spec.kind == "nvfp4" else O.FP8_GRID[spec.fmt]
    ties = np.isin(np.abs(x), (grid[:-1] + grid[1:]) / 2)
    assert ties.sum() == 2 * (len(grid) - 1)
    qt = recipe.quantizer(role).quantize(torch.from_numpy(x), columnwise=False)
    assert_quantized_as(qt, spec, x, columnwise=False)
    codes = (O.e2m1_codes_of(qt.rowwise_data.numpy()) if spec.kind == "nvfp4"
             else qt.rowwise_data.view(torch.uint8).numpy())
    assert np.all(codes[ties] % 2 == 0), "a tie went to an odd code"


# ---------------------------------------------------------------- delayed scaling: the scale in force is the slot's

@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("recipe", [
    pytest.param(DelayedScaling(), id="hybrid"),
    pytest.param(DelayedScaling(fp8_format=Format.E4M3, margin=2, amax_history_len=3), id="e4m3-margin2"),
])
def test_delayed_quantize_matches_oracle(recipe, role):
    name = O.fp8_name(recipe.fp8_format, role)
    q = recipe.quantizer(role)
    x1, x2 = sample(40, 70, torch.float32, 1), sample(40, 70, torch.float32, 2) * 3.0
    qt1 = q.quantize(x1)  # fresh slot: scale 1
    assert_bits_equal(qt1.rowwise_data, O.fp8_quantize_with_scale(x1.numpy(), 1.0, name), "first call data")
    assert_bits_equal(qt1.rowwise_scale_inv, np.array(1.0, dtype=np.float32), "first call scale_inv")
    q.update_scale()
    scale = np.float32(np.float32(O.FP8_MAX[name]) / O.amax(x1.numpy())) / np.float32(2.0 ** recipe.margin)
    qt2 = q.quantize(x2)
    x2n = x2.numpy()
    assert_bits_equal(qt2.rowwise_data, O.fp8_quantize_with_scale(x2n, scale, name), "rowwise data")
    assert_bits_equal(qt2.columnwise_data, O.fp8_quantize_with_scale(np.ascontiguousarray(x2n.T), scale, name),
                      "columnwise data")
    for si in (qt2.rowwise_scale_inv, qt2.columnwise_scale_inv):
        assert_bits_equal(si, np.array(np.float32(1) / np.float32(scale)), "scale_inv")


# ---------------------------------------------------------------- NVFP4 random Hadamard transform (columnwise copy)

NVFP4_RHT = [pytest.param(NVFP4BlockScaling(disable_stochastic_rounding=True), "input", id="input"),
             pytest.param(NVFP4BlockScaling(disable_stochastic_rounding=True), "grad_output", id="grad_output")]


def rht_exact_inputs():
    g = np.random.default_rng(7)
    # constant over each 16-run along M (the columnwise copy's quantized dimension)
    const = np.repeat(g.standard_normal((3, 40)).astype(np.float32), 16, axis=0)
    # small integers times powers of two: every sum of 16 of them is exact in float32
    ints = (g.integers(-8, 9, (32, 22)) * np.exp2(g.integers(-3, 4, (1, 22)))).astype(np.float32)
    return [pytest.param(const, id="const-runs"), pytest.param(ints, id="dyadic")]


@pytest.mark.parametrize("x", rht_exact_inputs())
@pytest.mark.parametrize("recipe, role", NVFP4_RHT)
def test_nvfp4_rht_bit_exact_where_transform_is_exact(recipe, role, x):
    exact = O.rht_float64(np.ascontiguousarray(x.T))
    assert np.array_equal(exact.astype(np.float32).astype(np.float64), exact), "input must make the RHT exact"
    qt = recipe.quantizer(role).quantize(torch.from_numpy(x))
    assert_quantized_as(qt, O.spec_for(recipe, role), x)  # rowwise plain, columnwise transformed


@pytest.mark.parametrize("recipe, role", NVFP4_RHT)
def test_nvfp4_rht_within_half_step_of_float64_transform(recipe, role):
    """General inputs: the stored Hadamard-domain copy is within half an E2M1 step (of its block's
    scale) of the float64 transform, plus the fp32 rounding of the transform and dequantization.

    The steps come from the oracle (NVFP4 of the float64 transform rounded to fp32), not from the
    library's stored scales, so wrong scales cannot widen the bound; the stored ones must equal
    them (an fp32 transform moves a block amax by an ulp: no E4M3 scale of this input sits that
    close to a rounding boundary)."""
    x = sample(64, 40, torch.float32, 11)
    qt = recipe.quantizer(role).quantize(x)
    t = O.rht_float64(np.ascontiguousarray(x.numpy().T))  # [K, M], float64
    assert abs(float(qt.columnwise_amax) - np.abs(t).max()) <= 2.0 ** -23 * np.abs(t).max()
    _, scale_codes, amax_t = O.nvfp4(t.astype(np.float32))
    assert np.array_equal(qt.columnwise_scale_inv.view(torch.uint8).numpy(), scale_codes)
    deq = qt.dequantize(torch.float32, columnwise=True).double().numpy()
    s_dec = 1.0 / np.float64(O.nvfp4_tensor_scale(amax_t))
    d = O.expand(O.fp8_decode(scale_codes, "E4M3").astype(np.float64), 1, 16, t.shape) * s_dec
    u = np.abs(t) / d
    saturated = u > 6.0
    bound = O.half_step(u, O.E2M1_GRID) * d + 2.0 ** -21 * (np.abs(t) + np.abs(deq))
    err = np.abs(deq - t)
    assert np.all(err[~saturated] <= bound[~saturated]), float(np.max((err - bound)[~saturated]))
    assert np.all(np.abs(deq[saturated]) <= np.abs(t[saturated]) * (1 + 2.0 ** -21))


# ---------------------------------------------------------------- canonical shapes and dtypes

FP8_DTYPE = {"E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2}

ALL_RECIPES = DETERMINISTIC + [pytest.param(NVFP4BlockScaling(), id="nvfp4-default"),
                               pytest.param(DelayedScaling(), id="delayed")]


def ceil(a, b):
    return -(-a // b)


def expected_layout(spec: O.Spec, m: int, k: int):
    """(data dtype, data shape, scale dtype, scale shape) of the rowwise copy of an [m, k] tensor."""
    if spec.kind == "tensor":
        return FP8_DTYPE[spec.fmt], (m, k), torch.float32, ()
    if spec.kind == "block":
        return FP8_DTYPE[spec.fmt], (m, k), torch.float32, (ceil(m, spec.rows), ceil(k, 128))
    if spec.kind == "mx":
        return FP8_DTYPE[spec.fmt], (m, k), torch.float8_e8m0fnu, (m, ceil(k, 32))
    return torch.uint8, (m, k // 2), torch.float8_e4m3fn, (ceil(m, spec.rows), ceil(k, 16))


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_canonical_layouts_and_dtypes(recipe, role):
    spec = O.spec_for(recipe, role)
    lead, m2, k = (3, 16, 34)  # x [3, 16, 34] flattens to M = 48
    m = lead * m2
    x = sample(m, k, torch.float32, 5).reshape(lead, m2, k)
    qt = recipe.quantizer(role).quantize(x, rowwise=True, columnwise=True)
    for data, scale, (mm, kk) in ((qt.rowwise_data, qt.rowwise_scale_inv, (m, k)),
                                  (qt.columnwise_data, qt.columnwise_scale_inv, (k, m))):
        dd, ds, sd, ss = expected_layout(spec, mm, kk)
        assert (data.dtype, tuple(data.shape)) == (dd, ds)
        assert (scale.dtype, tuple(scale.shape)) == (sd, ss)
    if spec.kind == "nvfp4":
        assert qt.amax.dtype == torch.float32 and qt.amax.dim() == 0
        assert qt.columnwise_amax.dtype == torch.float32 and qt.columnwise_amax.dim() == 0
    else:
        assert qt.amax is None
    assert qt.dequantize().shape == x.shape and qt.dequantize().dtype == torch.float32
    assert qt.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert qt.dequantize(columnwise=True).shape == (k, m)

    only_row = recipe.quantizer(role).quantize(x, rowwise=True, columnwise=False)
    assert only_row.columnwise_data is None and only_row.columnwise_scale_inv is None
    with pytest.raises(ValueError):
        only_row.dequantize(columnwise=True)
    only_col = recipe.quantizer(role).quantize(x, rowwise=False, columnwise=True)
    assert only_col.rowwise_data is None and only_col.rowwise_scale_inv is None
    with pytest.raises(ValueError):
        only_col.dequantize()
