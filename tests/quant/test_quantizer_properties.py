"""Hypothesis properties of every quantizer (NUMERICS.md), on random shapes and magnitudes.

The error bound reads the library's own scales and checks each element against them; the
independent oracle (tests/quant/oracle.py) supplies only the format tables. Comparisons of
dequantized values allow, besides the format's half step, the rounding of the few fp32
operations NUMERICS.md prescribes (a relative 2**-20 and the smallest subnormal), never more.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle as O
from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling,
                          NVFP4BlockScaling, ScaleMode)

ROLES = ("input", "weight", "grad_output")
FP32_SLACK = 2.0 ** -20  # a handful of fp32 roundings (scale, reciprocal, multiply, dequantize)
TINY = 2.0 ** -148

# Deterministic recipes. A fresh DelayedScaling slot quantizes with scale 1 (NUMERICS.md "Fresh state").
RECIPES = {
    "delayed": DelayedScaling(),
    "current": Float8CurrentScaling(),
    "current-pow2": Float8CurrentScaling(fp8_format=Format.E4M3, power_2_scale=True),
    "block": Float8BlockScaling(fp8_format=Format.HYBRID),
    "block-f32": Float8BlockScaling(use_f32_scales=True),
    "mxfp8": MXFP8BlockScaling(fp8_format=Format.HYBRID),
    "mxfp8-floor": MXFP8BlockScaling(scale_mode=ScaleMode.FLOOR, fp8_format=Format.HYBRID),
    "nvfp4": NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True),
}
RECIPE_PARAMS = [pytest.param(r, id=name) for name, r in RECIPES.items()]


def is_pow2_scaled(spec: O.Spec) -> bool:
    return spec.kind == "mx" or spec.pow2


# ---------------------------------------------------------------- inputs

@st.composite
def matrices(draw, even: bool = False, max_m: int = 40, max_k: int = 160) -> np.ndarray:
    """float32 [M, K]: shapes with partial blocks, magnitudes from 1e-30 to 1e30, some zeros."""
    m, k = draw(st.integers(1, max_m)), draw(st.integers(1, max_k))
    if even:  # NVFP4 packs pairs along K (rowwise) and along M (columnwise)
        m, k = m + m % 2, k + k % 2
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dist = draw(st.sampled_from(["normal", "heavy", "uniform", "integers"]))
    if dist == "normal":
        x = rng.standard_normal((m, k))
    elif dist == "heavy":  # outliers and many binades in one tensor
        x = rng.standard_normal((m, k)) * np.exp(3.0 * rng.standard_normal((m, k)))
    elif dist == "uniform":
        x = rng.uniform(-1, 1, (m, k))
    else:
        x = rng.integers(-64, 65, (m, k)).astype(np.float64)
    x[rng.random((m, k)) < draw(st.sampled_from([0.0, 0.3]))] = 0.0
    return (x * 10.0 ** draw(st.integers(-30, 30))).astype(np.float32)


def role_and_matrix(recipe):
    """(role, x) with shapes NVFP4 can hold."""
    return st.tuples(st.sampled_from(ROLES), matrices(even=isinstance(recipe, NVFP4BlockScaling)))


# ---------------------------------------------------------------- reading a QuantizedTensor with the oracle's tables

def grid_of(spec: O.Spec) -> np.ndarray:
    return O.E2M1_GRID if spec.kind == "nvfp4" else O.FP8_GRID[spec.fmt]


def code_values(spec: O.Spec, qt, columnwise: bool) -> np.ndarray:
    """Signed values of the stored codes (float64), in units of the block scale."""
    data = (qt.columnwise_data if columnwise else qt.rowwise_data).contiguous()
    if spec.kind == "nvfp4":
        return O.e2m1_decode(O.e2m1_codes_of(data.numpy()))
    return O.fp8_decode(data.view(torch.uint8).numpy(), spec.fmt)


def multiplier(spec: O.Spec, qt, columnwise: bool) -> np.ndarray:
    """Per element, what a code is multiplied by on dequantization (float64)."""
    scale = qt.columnwise_scale_inv if columnwise else qt.rowwise_scale_inv
    m, k = qt.shape_2d
    shape = (k, m) if columnwise else (m, k)
    if spec.kind == "tensor":
        return np.full(shape, float(scale))
    if spec.kind == "mx":
        per_block = np.ldexp(1.0, scale.view(torch.uint8).numpy().astype(np.int64) - 127)
    else:
        per_block = scale.float().double().numpy()
    d = O.expand(per_block, spec.rows, spec.cols, shape)
    if spec.kind == "nvfp4":
        amax = qt.columnwise_amax if columnwise else qt.amax
        d = d / np.float64(O.nvfp4_tensor_scale(np.float32(amax)))
    return d


def assert_error_bound(spec: O.Spec, qt, x: np.ndarray, columnwise: bool):
    """Zeros stay zero; an element beyond the format max (at its block's scale) gets the max code of its
    sign; every other element is within half a grid step (at its block's scale) of its input."""
    xr = (x.T if columnwise else x).astype(np.float64)
    q = code_values(spec, qt, columnwise)
    d = multiplier(spec, qt, columnwise)
    deq = qt.dequantize(torch.float32, columnwise=columnwise).reshape(xr.shape).double().numpy()
    grid = grid_of(spec)
    zero = xr == 0
    assert np.all(deq[zero] == 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.where(zero, 0.0, np.abs(xr) / d)
    saturated = u > grid[-1]
    assert np.all(q[saturated] == np.sign(xr[saturated]) * grid[-1]), "a saturated element is not +-max"
    bound = O.half_step(u, grid) * d + FP32_SLACK * (np.abs(xr) + np.abs(deq)) + TINY
    err = np.abs(deq - xr)
    bad = ~saturated & (err > bound)
    assert not bad.any(), (f"{bad.sum()} elements beyond half a step, e.g. x={xr[bad][0]!r} -> {deq[bad][0]!r} "
                           f"(scale {d[bad][0]!r})")


def raw(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    return (t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)).numpy()


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert np.array_equal(raw(a), raw(b)), what


# ---------------------------------------------------------------- error bound, at every magnitude

@pytest.mark.parametrize("recipe", RECIPE_PARAMS)
@given(case=st.data())
def test_error_within_half_step_of_block_scale(recipe, case):
    role, x = case.draw(role_and_matrix(recipe))
    spec = O.spec_for(recipe, role)
    qt = recipe.quantizer(role).quantize(torch.from_numpy(x))
    assert_error_bound(spec, qt, x, columnwise=False)
    assert_error_bound(spec, qt, x, columnwise=True)


@pytest.mark.parametrize("magnitude", [1e-30, 1e-15, 1.0, 1e15, 1e30])
@pytest.mark.parametrize("recipe", [p for p in RECIPE_PARAMS if p.id != "delayed"])  # delayed: no amax yet
def test_scale_follows_magnitude_from_1e_30_to_1e30(recipe, magnitude):
    """At any magnitude, every block's largest element lands in the top half of the format's range
    (nothing is flushed by a scale that ignores the data), and the error bound holds."""
    x = (np.random.default_rng(0).standard_normal((32, 160)) * magnitude).astype(np.float32)
    for role in ROLES:
        spec = O.spec_for(recipe, role)
        qt = recipe.quantizer(role).quantize(torch.from_numpy(x))
        assert_error_bound(spec, qt, x, columnwise=False)
        assert_error_bound(spec, qt, x, columnwise=True)
        q = np.abs(code_values(spec, qt, columnwise=False))
        rows, cols = (32, 160) if spec.kind == "tensor" else (spec.rows, spec.cols)
        for _, sl in O.block_slices(q.shape, rows, cols):
            assert q[sl].max() >= grid_of(spec)[-1] / 2, f"{role}: a block's max quantized to {q[sl].max()}"


# ---------------------------------------------------------------- idempotence

def representable(spec: O.Spec, x_shape, rng, delayed: bool):
    """(x, codes, scale bits) with x exactly representable: every block holds its format's maximum
    (so the scale rule gives back the block's power of two) and codes times scales are exact."""
    m, k = x_shape
    rows, cols = {"tensor": (m, k)}.get(spec.kind, (spec.rows, spec.cols))
    nb = O.num_blocks(x_shape, rows, cols)
    grid = grid_of(spec)
    exps = rng.integers(-60, 61, nb) if not delayed else np.zeros(nb, dtype=np.int64)
    if spec.kind == "nvfp4":
        mags = rng.integers(0, 8, x_shape)
        codes = np.where((rng.random(x_shape) < 0.5) & (mags > 0), mags | 8, mags)  # no -0: it becomes +0
        sb_codes = rng.integers(1, 0x7F, nb)  # positive finite E4M3 block scales, one of them 448
        sb_codes.reshape(-1)[rng.integers(sb_codes.size)] = 0x7E
    else:
        top = len(grid) - 1
        codes = rng.integers(0, top + 1, x_shape) | (rng.integers(0, 2, x_shape) << 7)
    top_code, sign_bit = (7, 8) if spec.kind == "nvfp4" else (len(grid) - 1, 0x80)
    for _, (rs, cs) in O.block_slices(x_shape, rows, cols):  # each block holds its max, with a random sign
        r = rng.integers(rs.start, min(rs.stop, m))
        c = rng.integers(cs.start, min(cs.stop, k))
        codes[r, c] = top_code | (sign_bit * rng.integers(0, 2))
    if spec.kind == "nvfp4":
        e = int(exps.reshape(-1)[0])  # one power of two for the tensor, E4M3 block scales below it
        sb = O.fp8_decode(sb_codes, "E4M3")
        x = O.e2m1_decode(codes) * O.expand(sb, rows, cols, x_shape) * 2.0 ** e
        return x.astype(np.float32), O.pack_nibbles(codes.astype(np.uint8)), sb_codes.astype(np.uint8)
    x = O.fp8_decode(codes, spec.fmt) * O.expand(np.ldexp(1.0, exps), rows, cols, x_shape)
    if spec.kind == "mx":
        scale = (exps + 127).astype(np.uint8)
    else:
        scale = np.ldexp(np.float32(1), exps).astype(np.float32).reshape(() if spec.kind == "tensor" else nb)
    return x.astype(np.float32), codes.astype(np.uint8), scale


@pytest.mark.parametrize("recipe", RECIPE_PARAMS)
@given(case=st.data())
def test_representable_input_is_a_fixed_point(recipe, case):
    """Codes times scales that the scale rule reproduces: quantize gives back exactly those codes
    and scales, and dequantize gives back the input (so quantizing that again changes nothing)."""
    role, x0 = case.draw(role_and_matrix(recipe))
    spec = O.spec_for(recipe, role)
    rng = np.random.default_rng(case.draw(st.integers(0, 2**32 - 1)))
    x, codes, scale = representable(spec, x0.shape, rng, delayed=isinstance(recipe, DelayedScaling))
    qt = recipe.quantizer(role).quantize(torch.from_numpy(x), columnwise=False)
    data = qt.rowwise_data.view(torch.uint8).numpy()
    assert np.array_equal(data, codes)
    assert np.array_equal(raw(qt.rowwise_scale_inv), scale.view(np.int32) if scale.dtype == np.float32 else scale)
    deq = qt.dequantize(torch.float32)
    assert np.array_equal(deq.numpy(), x)
    again = recipe.quantizer(role).quantize(deq, columnwise=False)
    assert np.array_equal(again.rowwise_data.view(torch.uint8).numpy(), codes)


@pytest.mark.parametrize("recipe", [p for p in RECIPE_PARAMS if p.id != "nvfp4"])
@given(case=st.data())
def test_requantizing_dequantized_values_is_idempotent(recipe, case):
    """FP8 and MXFP8: quantizing dequantize(quantize(x)) again keeps the codes (fp32 scales, whose block
    maximum always lands on the format max) or the dequantized values (power-of-two scales, which may
    step up by a power of two when the block maximum rounded down)."""
    role, x = case.draw(role_and_matrix(recipe))
    spec = O.spec_for(recipe, role)
    first = recipe.quantizer(role).quantize(torch.from_numpy(x), columnwise=False)
    deq = first.dequantize(torch.float32)
    second = recipe.quantizer(role).quantize(deq, columnwise=False)
    if is_pow2_scaled(spec):
        assert_same_bits(second.dequantize(torch.float32), deq, "dequantized values changed")
    else:
        assert_same_bits(second.rowwise_data, first.rowwise_data, "codes changed")


# ---------------------------------------------------------------- orientations

ONE_D = {**RECIPES, "nvfp4-1d": NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                                  disable_2d_quantization=True)}
TWO_D = [pytest.param(r, "weight", id=name) for name, r in RECIPES.items() if O.spec_for(r, "weight").rows > 1]


@pytest.mark.parametrize("recipe", [pytest.param(r, id=name) for name, r in ONE_D.items()])
@given(case=st.data())
def test_columnwise_is_rowwise_of_transpose(recipe, case):
    """For 1-D block formats (and per-tensor scales) the columnwise copy is exactly the rowwise copy of x.T."""
    role = case.draw(st.sampled_from([r for r in ROLES if O.spec_for(recipe, r).rows == 1]))
    x = case.draw(matrices(even=True))
    both = recipe.quantizer(role).quantize(torch.from_numpy(x), rowwise=True, columnwise=True)
    xt = torch.from_numpy(np.ascontiguousarray(x.T))
    rows_of_t = recipe.quantizer(role).quantize(xt, rowwise=True, columnwise=False)
    assert_same_bits(both.columnwise_data, rows_of_t.rowwise_data, "data")
    assert_same_bits(both.columnwise_scale_inv, rows_of_t.rowwise_scale_inv, "scales")
    if both.amax is not None:
        assert_same_bits(both.columnwise_amax, rows_of_t.amax, "amax")
    assert_same_bits(both.dequantize(columnwise=True), rows_of_t.dequantize(), "dequantized")


@pytest.mark.parametrize("recipe, role", TWO_D)
@given(x=matrices(even=True))
def test_2d_blocks_dequantize_identically_in_both_orientations(recipe, role, x):
    qt = recipe.quantizer(role).quantize(torch.from_numpy(x), rowwise=True, columnwise=True)
    assert_same_bits(qt.dequantize(columnwise=True), qt.dequantize().t().contiguous(), "orientations differ")
    assert_same_bits(qt.columnwise_scale_inv, qt.rowwise_scale_inv.t().contiguous(), "one scale per 2-D block")


# ---------------------------------------------------------------- special values

@pytest.mark.parametrize("recipe", RECIPE_PARAMS + [pytest.param(NVFP4BlockScaling(), id="nvfp4-default")])
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["+0", "-0"])
def test_zeros_quantize_to_zero_with_finite_scales(recipe, role, sign):
    spec = O.spec_for(recipe, role)
    x = torch.full((32, 48), sign * 0.0)
    qt = recipe.quantizer(role).quantize(x)
    for columnwise in (False, True):
        data = qt.columnwise_data if columnwise else qt.rowwise_data
        scale = qt.columnwise_scale_inv if columnwise else qt.rowwise_scale_inv
        deq = qt.dequantize(columnwise=columnwise)
        assert torch.equal(deq, torch.zeros_like(deq))
        # FP8 keeps the sign bit of -0; E2M1 stores -0 as the +0 code (NUMERICS.md)
        want_byte = 0x80 if sign < 0 and spec.kind != "nvfp4" else 0
        assert np.all(data.view(torch.uint8).numpy() == want_byte)
        expected_scale = {"tensor": 1.0, "block": 1.0, "mx": 2.0 ** -127, "nvfp4": 0.0}[spec.kind]
        assert torch.all(scale.float() == expected_scale)
    if spec.kind == "nvfp4":
        assert float(qt.amax) == 0.0


def block_mask(shape, rows, cols, hit: np.ndarray) -> np.ndarray:
    """Elements that share a (rows x cols) block with any element of `hit`."""
    touched = np.zeros(O.num_blocks(shape, rows, cols), dtype=bool)
    for (i, j), sl in O.block_slices(shape, rows, cols):
        touched[i, j] = hit[sl].any()
    return O.expand(touched, rows, cols, shape)


@pytest.mark.parametrize("recipe", RECIPE_PARAMS)
@given(case=st.data())
def test_nan_stays_in_its_block(recipe, case):
    """A NaN dequantizes to NaN; elements outside its block (per tensor: every other element, the
    per-tensor amax ignoring NaN) are bit-identical to quantizing the tensor with the NaN replaced by 0."""
    role, x = case.draw(role_and_matrix(recipe))
    spec = O.spec_for(recipe, role)
    nans = np.zeros(x.shape, dtype=bool)
    for _ in range(case.draw(st.integers(1, 3))):
        nans[case.draw(st.integers(0, x.shape[0] - 1)), case.draw(st.integers(0, x.shape[1] - 1))] = True
    with_nan = np.where(nans, np.float32(np.nan), x)
    clean = np.where(nans, np.float32(0), x)
    qn = recipe.quantizer(role).quantize(torch.from_numpy(with_nan))
    qc = recipe.quantizer(role).quantize(torch.from_numpy(clean))
    for columnwise in (False, True):
        hit = nans.T if columnwise else nans
        dn = qn.dequantize(columnwise=columnwise).reshape(hit.shape).numpy()
        dc = qc.dequantize(columnwise=columnwise).reshape(hit.shape).numpy()
        assert np.isnan(dn[hit]).all()
        inside = hit if spec.kind == "tensor" else block_mask(hit.shape, spec.rows, spec.cols, hit)
        assert np.array_equal(dn[~inside].view(np.int32), dc[~inside].view(np.int32))


@pytest.mark.parametrize("recipe", RECIPE_PARAMS)
@given(case=st.data())
def test_infinities_saturate_to_max_code(recipe, case):
    """+-inf becomes the max code of its sign, bit-exact against the oracle: a per-tensor amax (and
    NVFP4's tensor amax) is taken over the finite values, so the other values keep their scale; an
    infinite block amax gives block scale 1 and E8M0 exponent 127. Dequantized, everything is finite
    (the inf saturates)."""
    role, x = case.draw(role_and_matrix(recipe))
    spec = O.spec_for(recipe, role)
    inf = np.zeros(x.shape, dtype=bool)
    for _ in range(case.draw(st.integers(1, 3))):
        inf[case.draw(st.integers(0, x.shape[0] - 1)), case.draw(st.integers(0, x.shape[1] - 1))] = True
    signs = np.where(np.random.default_rng(x.size).random(x.shape) < 0.5, -1.0, 1.0).astype(np.float32)
    xi = np.where(inf, signs * np.float32(np.inf), x)
    qt = recipe.quantizer(role).quantize(torch.from_numpy(xi))
    for columnwise in (False, True):
        hit = inf.T if columnwise else inf
        s = (signs.T if columnwise else signs)[hit]
        assert np.array_equal(code_values(spec, qt, columnwise)[hit], s * grid_of(spec)[-1])
        xo = np.ascontiguousarray(xi.T if columnwise else xi)
        data = qt.columnwise_data if columnwise else qt.rowwise_data
        scale = qt.columnwise_scale_inv if columnwise else qt.rowwise_scale_inv
        if isinstance(recipe, DelayedScaling):  # a fresh slot: scale 1, whatever the amax
            want = dict(data=O.fp8_quantize_with_scale(xo, 1.0, spec.fmt), scale=np.array(1.0, dtype=np.float32))
        else:
            want = O.expected(spec, xo)
        assert np.array_equal(raw(data), want["data"])
        assert np.array_equal(raw(scale), want["scale"].view(np.int32) if want["scale"].dtype == np.float32
                              else want["scale"])
        assert np.isfinite(qt.dequantize(columnwise=columnwise).numpy()).all()


# ---------------------------------------------------------------- stochastic rounding (NVFP4 grad_output)

def e2m1_values(qt) -> np.ndarray:
    return O.e2m1_decode(O.e2m1_codes_of(qt.rowwise_data.numpy()))


@given(lo=st.lists(st.integers(0, 6), min_size=15, max_size=15),
       frac=st.lists(st.floats(0.1, 0.9), min_size=15, max_size=15),
       neg=st.lists(st.booleans(), min_size=15, max_size=15),
       log2_size=st.integers(-90, 90), seed=st.integers(0, 2**63 - 1))
@settings(max_examples=20)
def test_stochastic_rounding_is_unbiased(lo, frac, neg, log2_size, seed):
    """4096 identical rows are 4096 independent draws. Built so the block scale maps the row exactly onto
    the E2M1 grid (row max 6 * 2**e): each draw is one of the two neighbours of the value, and the mean
    of the draws is closer to the value than round-to-nearest, for every element."""
    grid = O.E2M1_GRID
    lo_v, hi_v = grid[np.array(lo)], grid[np.array(lo) + 1]
    y = np.where(neg, -1.0, 1.0) * (lo_v + np.array(frac) * (hi_v - lo_v))
    y = np.concatenate([[6.0], y]).astype(np.float32)  # in grid units; the row's max pins the scale
    x = torch.from_numpy(np.tile(y * np.float32(2.0 ** log2_size), (4096, 1)))
    y = y.astype(np.float64)

    q = NVFP4BlockScaling().quantizer("grad_output")
    q.generator = torch.Generator().manual_seed(seed)
    draws = e2m1_values(q.quantize(x, columnwise=False))
    nearest = e2m1_values(NVFP4BlockScaling(disable_stochastic_rounding=True).quantizer("grad_output")
                          .quantize(x[:2], columnwise=False))[0]
    down = np.sign(y) * np.concatenate([[6.0], lo_v])
    up = np.sign(y) * np.concatenate([[6.0], hi_v])
    assert np.all((draws == down) | (draws == up)), "a draw is not a neighbour of its value"
    bias = np.abs(draws.mean(0) - y)[1:]  # element 0 is the row max, exact either way
    assert np.all(bias < np.abs(nearest - y)[1:]), "stochastic mean not better than round-to-nearest"
    # and unbiased: P(up) = (y - lo) / (hi - lo), so the mean is within 6 standard errors of y
    p = np.abs(y[1:]) - lo_v
    p = p / (hi_v - lo_v)
    std_err = np.sqrt(p * (1 - p) / draws.shape[0]) * (hi_v - lo_v)
    assert np.all(bias <= 6 * std_err), "stochastic rounding is biased"


def test_stochastic_rounding_reproducible_with_seeded_generator():
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))

    def run(seed):
        q = NVFP4BlockScaling().quantizer("grad_output")
        q.generator = torch.Generator().manual_seed(seed)
        return q.quantize(x, rowwise=True, columnwise=True)

    a, b, c = run(1), run(1), run(2)
    for name in ("rowwise_data", "columnwise_data"):
        assert torch.equal(getattr(a, name), getattr(b, name))
        assert not torch.equal(getattr(a, name), getattr(c, name))
    # without a generator of its own the quantizer draws from torch's default one
    q = NVFP4BlockScaling().quantizer("grad_output")
    torch.manual_seed(3)
    d = q.quantize(x).rowwise_data
    torch.manual_seed(3)
    assert torch.equal(d, q.quantize(x).rowwise_data)


def test_a_stochastic_rounding_generator_on_another_device_is_an_error():
    """A generator must draw where the tensor is; "cuda" without an index is the current CUDA
    device (tests/kernels/test_nvfp4_values_interpret.py quantizes with one on the GPU)."""
    q = NVFP4BlockScaling().quantizer("grad_output")
    q.generator = types.SimpleNamespace(device=torch.device("cuda", 0))  # no CUDA needed to be refused
    with pytest.raises(ValueError, match=r"generator is on cuda:0 but the tensor is on cpu.*Generator\(device="):
        q.quantize(torch.randn(32, 32))


# ---------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("recipe", RECIPE_PARAMS + [pytest.param(NVFP4BlockScaling(), id="nvfp4-default")])
def test_bad_inputs_raise(recipe):
    q = recipe.quantizer("input")
    for bad in (torch.ones(4, 32, dtype=torch.int32), torch.ones(4, 32, dtype=torch.int64),
                torch.ones(4, 32, dtype=torch.bool), [[1.0] * 32] * 4):
        with pytest.raises(TypeError):
            q.quantize(bad)
    for bad in (torch.ones(32), torch.tensor(1.0)):
        with pytest.raises(ValueError):
            q.quantize(bad)
    with pytest.raises(ValueError):
        q.quantize(torch.ones(4, 32), rowwise=False, columnwise=False)
    for role in ("bias", "Input", "output", ""):
        with pytest.raises(ValueError, match="role"):
            recipe.quantizer(role)


def test_nvfp4_shape_errors():
    q = NVFP4BlockScaling().quantizer("input")
    with pytest.raises(ValueError, match="K=33"):
        q.quantize(torch.ones(32, 33), columnwise=False)
    with pytest.raises(ValueError, match="M=3"):
        NVFP4BlockScaling(disable_rht=True).quantizer("weight").quantize(torch.ones(3, 32), columnwise=True)
    with pytest.raises(ValueError, match="Hadamard"):
        q.quantize(torch.ones(18, 32), columnwise=True)  # RHT needs M a multiple of 16
    q.quantize(torch.ones(18, 32), columnwise=False)  # the rowwise copy alone is fine
