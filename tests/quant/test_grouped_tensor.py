"""GroupedTensor: each group quantized exactly as if its slice were quantized alone (NUMERICS.md).

Jagged splits come from hypothesis and include empty groups and one-row groups.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qmoe import GroupedTensor, QuantizedTensor
from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling,
                          NVFP4BlockScaling, ScaleMode)

ROLES = ("input", "weight", "grad_output")

# Deterministic recipes; a fresh DelayedScaling quantizer uses scale 1 for every group.
RECIPES = {
    "delayed": DelayedScaling(),
    "current": Float8CurrentScaling(),
    "current-pow2-eps": Float8CurrentScaling(power_2_scale=True, amax_epsilon=1e-3),
    "block": Float8BlockScaling(),
    "block-f32-hybrid": Float8BlockScaling(use_f32_scales=True, fp8_format=Format.HYBRID),
    "mxfp8": MXFP8BlockScaling(fp8_format=Format.HYBRID),
    "mxfp8-floor": MXFP8BlockScaling(scale_mode=ScaleMode.FLOOR),
    "nvfp4": NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True),
    "nvfp4-rht": NVFP4BlockScaling(disable_stochastic_rounding=True),
    "nvfp4-1d": NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True),
}
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv", "amax", "columnwise_amax")


def raw(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    return (t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)).numpy()


def assert_same_tensor(got: QuantizedTensor, want: QuantizedTensor, where: str):
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        if name == "columnwise_amax" and want.columnwise_data is None:
            continue  # without a columnwise copy its amax means nothing (the grouped path fills in amax)
        if b is None:
            assert a is None, f"{where}: {name} should be None"
            continue
        assert a is not None, f"{where}: {name} missing"
        assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), \
            f"{where}: {name} is {a.dtype}{tuple(a.shape)}, alone {b.dtype}{tuple(b.shape)}"
        assert np.array_equal(raw(a), raw(b)), f"{where}: {name} differs from quantizing the group alone"


def group_multiple(recipe, role, columnwise: bool) -> int:
    """Row multiple a group needs to be quantizable alone: NVFP4 packs column pairs, and the RHT runs over 16."""
    if not isinstance(recipe, NVFP4BlockScaling) or not columnwise:
        return 1
    return 16 if role != "weight" and not recipe.disable_rht else 2


@st.composite
def grouped_inputs(draw, multiple: int = 1, even_k: bool = False):
    """(x [sum M_g, K] float32, split sizes): zeros and single rows are likely."""
    units = draw(st.lists(st.one_of(st.just(0), st.just(1), st.integers(0, 40 // multiple + 1)),
                          min_size=1, max_size=6))
    splits = [u * multiple for u in units]
    k = draw(st.integers(1, 140))  # beyond one 128-column block
    k += k % 2 if even_k else 0
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rows = sum(splits)
    # groups of very different magnitude, so a shared scale would show
    mags = torch.cat([torch.full((s, 1), 10.0 ** draw(st.integers(-8, 8))) for s in splits]) if rows else \
        torch.ones(0, 1)
    x = torch.randn(rows, k, generator=g) * torch.exp(torch.randn(rows, k, generator=g)) * mags
    return x, splits


def bounds(splits):
    start = np.concatenate([[0], np.cumsum(splits)]).astype(int)
    return list(zip(start[:-1], start[1:]))


@pytest.mark.parametrize("recipe", [pytest.param(r, id=n) for n, r in RECIPES.items()])
@given(case=st.data())
def test_split_equals_quantizing_each_group_alone(recipe, case):
    role, columnwise = case.draw(st.sampled_from(ROLES)), case.draw(st.booleans())
    nvfp4 = isinstance(recipe, NVFP4BlockScaling)
    x, splits = case.draw(grouped_inputs(group_multiple(recipe, role, columnwise), even_k=nvfp4))
    gt = GroupedTensor.quantize(x, splits, recipe.quantizer(role), rowwise=True, columnwise=columnwise)
    parts = gt.split()
    assert len(parts) == len(splits)
    for g, ((a, b), part) in enumerate(zip(bounds(splits), parts)):
        alone = recipe.quantizer(role).quantize(x[a:b], rowwise=True, columnwise=columnwise)
        assert tuple(part.shape) == (b - a, x.shape[1])
        assert_same_tensor(part, alone, f"group {g} of {splits}")
        assert np.array_equal(raw(part.dequantize()), raw(alone.dequantize()))
    deq = gt.dequantize(torch.float32)
    assert deq.shape == x.shape and deq.dtype == torch.float32
    want = torch.cat([p.dequantize() for p in parts]) if parts else deq
    assert np.array_equal(raw(deq), raw(want))
    if columnwise:
        assert gt.dequantize(columnwise=True).shape == (x.shape[1], x.shape[0])


def test_groups_do_not_share_scales_or_blocks():
    """A deliberate case: group 1 is 1e6 times group 0 and has one row; a shared amax or a block
    across the boundary would flush group 0 or mix the rows."""
    x = torch.cat([torch.randn(5, 64), 1e6 * torch.randn(1, 64), torch.randn(3, 64)])
    for name, recipe in RECIPES.items():
        for role in ROLES:
            columnwise = not isinstance(recipe, NVFP4BlockScaling)
            gt = GroupedTensor.quantize(x, [5, 1, 0, 3], recipe.quantizer(role), columnwise=columnwise)
            for (a, b), part in zip(bounds([5, 1, 0, 3]), gt.split()):
                assert_same_tensor(part, recipe.quantizer(role).quantize(x[a:b], columnwise=columnwise),
                                   f"{name}/{role}")


@given(splits=st.lists(st.integers(0, 9), min_size=1, max_size=8), as_tensor=st.sampled_from([None, torch.int32,
                                                                                               torch.int64]))
def test_offsets_num_groups_and_split_sizes(splits, as_tensor):
    x = torch.randn(sum(splits), 32)
    arg = splits if as_tensor is None else torch.tensor(splits, dtype=as_tensor)
    gt = GroupedTensor.quantize(x, arg, MXFP8BlockScaling().quantizer("input"))
    assert gt.num_groups == len(splits)
    assert isinstance(gt.split_sizes, torch.Tensor) and gt.split_sizes.tolist() == splits
    assert isinstance(gt.offsets, torch.Tensor) and not gt.offsets.dtype.is_floating_point
    assert gt.offsets.tolist() == [0] + np.cumsum(splits).tolist()
    assert gt.offsets.device == x.device == gt.split_sizes.device
    assert [tuple(p.shape) for p in gt.split()] == [(s, 32) for s in splits]


def test_nvfp4_stochastic_grouped_shapes_and_reproducibility():
    splits = [32, 0, 16, 48]
    x = torch.randn(sum(splits), 40, generator=torch.Generator().manual_seed(0))

    def run(seed):
        q = NVFP4BlockScaling().quantizer("grad_output")
        q.generator = torch.Generator().manual_seed(seed)
        return GroupedTensor.quantize(x, splits, q, rowwise=True, columnwise=True)

    a, b, c = run(5), run(5), run(6)
    assert a.rowwise_data.shape == (96, 20) and a.rowwise_data.dtype == torch.uint8
    assert a.columnwise_data.shape == (40, 48) and a.columnwise_data.dtype == torch.uint8
    assert a.amax.shape == (4,) and a.columnwise_amax.shape == (4,)
    for name in FIELDS:
        assert np.array_equal(raw(getattr(a, name)), raw(getattr(b, name))), name
    assert not torch.equal(a.rowwise_data, c.rowwise_data)
    for part, s in zip(a.split(), splits):
        assert part.rowwise_data.shape == (s, 20) and part.rowwise_scale_inv.shape == (s, 3)
        assert part.columnwise_data.shape == (40, s // 2) and part.columnwise_scale_inv.shape == (40, -(-s // 16))
    assert a.dequantize().shape == x.shape


def test_nvfp4_rowwise_dequantize_beside_a_columnwise_copy_of_odd_groups():
    """Odd groups' NVFP4 columnwise copy cannot stand alone (two rows a byte); the rowwise copy
    beside it still dequantizes, to the values of the rows quantized without it. The columnwise
    copy says why it cannot."""
    splits = [0, 19, 1, 40, 0, 8]
    x = torch.randn(sum(splits), 64, generator=torch.Generator().manual_seed(3))
    q = RECIPES["nvfp4"].quantizer("input")
    both = GroupedTensor.quantize(x, splits, q, rowwise=True, columnwise=True)
    rows = GroupedTensor.quantize(x, splits, q, rowwise=True, columnwise=False)
    assert torch.equal(both.dequantize(), rows.dequantize())
    with pytest.raises(ValueError, match="group 1 has 19 rows"):
        both.dequantize(columnwise=True)


BAD_SPLITS = [
    pytest.param([4, -1, 5], ValueError, id="negative"),
    pytest.param([4, 3], ValueError, id="wrong-sum"),
    pytest.param([9, 1], ValueError, id="too-many-rows"),
    pytest.param([], ValueError, id="empty"),
    pytest.param(torch.tensor([4.0, 4.0]), TypeError, id="float-dtype"),
    pytest.param(torch.tensor([[4, 4]]), ValueError, id="2-d"),
    pytest.param([4.0, 4.0], TypeError, id="list-of-floats"),
    pytest.param([True, 7], TypeError, id="list-with-bool"),
    pytest.param(["4", "4"], TypeError, id="list-of-str"),
    pytest.param(8, TypeError, id="int"),
]


@pytest.mark.parametrize("splits, error", BAD_SPLITS)
def test_bad_split_sizes_raise(splits, error):
    with pytest.raises(error, match="split_sizes"):
        GroupedTensor.quantize(torch.randn(8, 32), splits, Float8CurrentScaling().quantizer("input"))


def test_bad_grouped_inputs_raise():
    q = Float8CurrentScaling().quantizer("input")
    with pytest.raises(TypeError):
        GroupedTensor.quantize(torch.ones(8, 32, dtype=torch.int32), [8], q)
    with pytest.raises(ValueError):
        GroupedTensor.quantize(torch.ones(8), [8], q)
    with pytest.raises(TypeError):
        GroupedTensor.quantize(torch.ones(8, 32), [8], Float8CurrentScaling())


@pytest.mark.parametrize("recipe", ["current", "block", "mxfp8", "nvfp4-1d"])
@pytest.mark.parametrize("activation, k", [("swiglu", None), ("swiglu", 16), ("gelu", None)])
def test_activated_rows_quantize_as_their_values(recipe, activation, k):
    """GroupedTensor.quantize(ActivatedRows(h, probs, ...)) == quantizing act(h) * probs, and the
    reference grouped quantizers take ActivatedRows directly (the kernels' fallback hands them one)."""
    from qmoe.contracts.formats import E4M3
    from qmoe.reference import grouped_quantize as RG
    from qmoe.contracts.carriers import ActivatedRows
    from qmoe.reference.activation import scaled_activation_forward
    gen = torch.Generator().manual_seed(3)
    width = 64 * (2 if activation == "swiglu" else 1)
    h = (torch.randn(96, width, generator=gen) * 3).bfloat16()
    probs = torch.rand(96, generator=gen)
    splits = [32, 0, 64]
    fused = ActivatedRows(h, probs, activation, k)
    assert fused.shape == (96, 64) and fused.dtype == torch.bfloat16
    values = scaled_activation_forward(h, probs, activation, k)
    q = RECIPES[recipe].quantizer("input")
    got = GroupedTensor.quantize(fused, splits, q)
    want = GroupedTensor.quantize(values, splits, q)
    for field in FIELDS:
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert np.array_equal(raw(a), raw(b)), field
    splits_t = torch.tensor(splits)
    for x, y in zip(RG.grouped_quantize_mxfp8(fused, splits_t, E4M3, rowwise=True, columnwise=True),
                    RG.grouped_quantize_mxfp8(values, splits_t, E4M3, rowwise=True, columnwise=True)):
        assert np.array_equal(raw(x), raw(y))
