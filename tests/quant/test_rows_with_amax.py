"""A producer's per-group amax (`RowsWithAmax`) replaces the current-scaling quantizer's amax pass.

The reference twins of the producers (permute, unpermute backward, activation forward and
backward) reduce `group_amax` of what they write; it must be, bit for bit, the amax the
quantizer would measure (`grouped_tensor_amax`: finite values only, 0 for an empty group), and a
quantize handed it must give the bytes of a quantize that measured it, without measuring.
The Triton producers are checked the same way under the interpreter
(tests/kernels/test_amax_producers_interpret.py).
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qmoe import GroupedTensor
from qmoe.contracts.carriers import AmaxSlot, RowsWithAmax
from qmoe.dispatch import GROUPED_QUANTIZE
from qmoe.ops.grouped_linear_paths import absorb_tail
from qmoe.recipes import Float8CurrentScaling, NVFP4BlockScaling
from qmoe.reference import activation as r_activation
from qmoe.reference import permute as r_permute
from qmoe.reference.grouped_quantize import grouped_tensor_amax
from qmoe.reference.quantize import group_amax
from tests.quant.test_grouped_tensor import RECIPES, ROLES, assert_same_tensor, group_multiple, grouped_inputs
from tests.tolerances import assert_bit_identical

SPECIALS = (float("nan"), float("inf"), float("-inf"))


def assert_same_amax(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """fp32 amaxes equal bit for bit (their int32 patterns)."""
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape, (what, got, want)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{what}: {got} != {want}"


def _offsets(splits) -> torch.Tensor:
    s = torch.as_tensor(splits, dtype=torch.int64)
    return torch.cat((s.new_zeros(1), s.cumsum(0)))


def _sprinkle(x: torch.Tensor, gen: torch.Generator, every: int = 7) -> torch.Tensor:
    """x with some entries inf / -inf / NaN, and one row entirely NaN (a non-finite value must not
    flush its group's scale)."""
    x = x.clone()
    flat = x.view(-1)
    for i, pos in enumerate(range(0, flat.numel(), every)):
        flat[pos] = SPECIALS[(i + int(torch.randint(0, 3, (), generator=gen))) % 3]
    if x.shape[0]:
        x[int(torch.randint(0, x.shape[0], (), generator=gen))] = float("nan")
    return x


@contextlib.contextmanager
def counting_amax_passes():
    """Inside: a list of the inputs the grouped amax pass ran on (the dispatch table's entries,
    kernel and reference, are wrapped for the duration)."""
    calls = []
    saved = GROUPED_QUANTIZE.table["grouped_tensor_amax"]

    def counted(fn):
        def run(*args, **kwargs):
            calls.append(args[0])
            return fn(*args, **kwargs)
        return run
    GROUPED_QUANTIZE.table["grouped_tensor_amax"] = (saved[0] and counted(saved[0]), counted(saved[1]))
    try:
        yield calls
    finally:
        GROUPED_QUANTIZE.table["grouped_tensor_amax"] = saved


@given(case=grouped_inputs(), tail=st.integers(0, 5), special=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_group_amax_is_each_groups_tensor_amax(case, tail, special, dtype):
    x, splits = case
    gen = torch.Generator().manual_seed(len(splits) + tail)
    x = torch.cat((x, torch.randn(tail, x.shape[1], generator=gen) * 1e30))  # rows past the groups: ignored
    x = (_sprinkle(x, gen) if special else x).to(dtype)
    got = group_amax(x, _offsets(splits))
    want = grouped_tensor_amax(x[:sum(splits)], torch.tensor(splits))
    assert got.dtype == torch.float32 and got.shape == (len(splits),)
    assert_same_amax(got, want, f"group_amax of {splits}")


@pytest.mark.parametrize("recipe", [pytest.param(r, id=n) for n, r in RECIPES.items()])
@given(case=st.data())
def test_quantize_with_the_producers_amax_is_quantize_alone(recipe, case):
    """Every quantizer gives the same bytes for RowsWithAmax(x, amax) as for x; current scaling
    (the one that takes the amax) runs no amax pass for it."""
    role, columnwise = case.draw(st.sampled_from(ROLES)), case.draw(st.booleans())
    x, splits = case.draw(grouped_inputs(group_multiple(recipe, role, columnwise),
                                         even_k=isinstance(recipe, NVFP4BlockScaling)))
    if case.draw(st.booleans()):
        x = _sprinkle(x, torch.Generator().manual_seed(len(splits)))
    amax = group_amax(x, _offsets(splits))
    want = GroupedTensor.quantize(x, splits, recipe.quantizer(role), columnwise=columnwise).split()
    q = recipe.quantizer(role)
    with counting_amax_passes() as calls:
        got = GroupedTensor.quantize(RowsWithAmax(x, amax), splits, q, columnwise=columnwise)
    if q.takes_amax:
        assert not calls, "the quantizer measured an amax it was given"
    got = got.split()
    for g, (a, b) in enumerate(zip(got, want)):
        assert_same_tensor(a, b, f"group {g} of {splits}")


def test_current_scaling_takes_the_given_amax():
    """The amax handed over is the one used: a different amax gives other scales."""
    x = torch.randn(40, 64)
    splits = [16, 0, 24]
    q = Float8CurrentScaling().quantizer("input")
    amax = group_amax(x, _offsets(splits))
    doubled = GroupedTensor.quantize(RowsWithAmax(x, amax * 2), splits, q)
    plain = GroupedTensor.quantize(x, splits, q)
    used = torch.tensor([0, 2])  # the empty group's amax is 0 either way (scale 1)
    assert_bit_identical(doubled.rowwise_scale_inv[used], plain.rowwise_scale_inv[used] * 2,
                         "scale_inv of twice the amax")


@pytest.mark.parametrize("amax,match", [
    (torch.zeros(4), "float32 tensor \\[3\\]"),
    (torch.zeros(3, dtype=torch.bfloat16), "float32 tensor \\[3\\]"),
    (torch.zeros(1, 3), "float32 tensor \\[3\\]"),
], ids=["groups", "dtype", "shape"])
def test_a_wrong_amax_is_refused(amax, match):
    with pytest.raises(ValueError, match=match):
        GroupedTensor.quantize(RowsWithAmax(torch.randn(8, 16), amax), [4, 0, 4],
                               Float8CurrentScaling().quantizer("input"))


# ---------------------------------------------------------------- the reference producers

def _routing(t, e, k, gen):
    """Up to k experts a token (some tokens none: dropped), expert 0 always empty."""
    m = torch.zeros(t, e, dtype=torch.bool)
    for i in range(t):
        m[i, 1 + torch.randperm(e - 1, generator=gen)[: int(torch.randint(0, k + 1, (), generator=gen))]] = True
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nonfinite"])
def test_reference_permute_and_unpermute_backward_amax(dtype, special):
    gen = torch.Generator().manual_seed(3)
    t, e, k, align, h = 11, 5, 3, 4, 24
    routing_map = _routing(t, e, k, gen)
    row_id_map, split_sizes = r_permute.permute_index(routing_map, k, align)
    row_id_map = r_permute.with_num_rows(row_id_map, row_id_map.num_rows + 8)  # a longer zero tail
    x = torch.randn(t, h, generator=gen) * 10.0 ** torch.randint(-3, 4, (t, 1), generator=gen)
    x = (_sprinkle(x, gen) if special else x).to(dtype)
    groups = absorb_tail(split_sizes.long(), row_id_map.num_rows)  # the consumer's groups
    out = r_permute.permute_rows(x, row_id_map, with_amax=True)
    assert isinstance(out, RowsWithAmax)
    assert_bit_identical(out.rows, r_permute.permute_rows(x, row_id_map), "permuted rows")
    assert_same_amax(out.amax, grouped_tensor_amax(out.rows, groups), "permute's amax")
    assert float(out.amax[0]) == 0.0  # the empty expert

    g = (_sprinkle(torch.randn(t, h, generator=gen), gen) if special else torch.randn(t, h, generator=gen)).to(dtype)
    probs = torch.rand(t, e, generator=gen) * routing_map
    for merging in (None, probs):
        (grad_y, amax), grad_p = r_permute.unpermute_rows_backward(g, out.rows, row_id_map, merging, with_amax=True)
        want_y, want_p = r_permute.unpermute_rows_backward(g, out.rows, row_id_map, merging)
        assert_bit_identical(grad_y, want_y, "grad_y")
        assert (grad_p is None) == (want_p is None)
        assert_same_amax(amax, grouped_tensor_amax(grad_y, groups), "unpermute backward's amax")


@pytest.mark.parametrize("activation,k", [("swiglu", None), ("geglu", 4), ("relu2", None)])
def test_reference_activation_amax(activation, k):
    gen = torch.Generator().manual_seed(5)
    splits = [3, 0, 9, 1]
    rows, f = sum(splits) + 2, 8  # two tail rows past the groups
    width = 2 * f if activation != "relu2" else f
    h = _sprinkle(torch.randn(rows, width, generator=gen) * 4, gen, every=11).to(torch.bfloat16)
    probs = torch.rand(rows, generator=gen)
    offsets = _offsets(splits)
    a = r_activation.scaled_activation_forward(h, probs, activation, k, amax_offsets=offsets)
    assert_bit_identical(a.rows, r_activation.scaled_activation_forward(h, probs, activation, k), "a")
    assert_same_amax(a.amax, grouped_tensor_amax(a.rows[:sum(splits)], torch.tensor(splits)), "a's amax")
    da = torch.randn(rows, f, generator=gen).to(torch.bfloat16)
    (dh, amax), dprobs = r_activation.scaled_activation_backward(h, probs, da, activation, k, amax_offsets=offsets)
    want_dh, want_dprobs = r_activation.scaled_activation_backward(h, probs, da, activation, k)
    assert_bit_identical(dh, want_dh, "dh")
    assert_bit_identical(dprobs, want_dprobs, "dprobs")
    assert_same_amax(amax, grouped_tensor_amax(dh[:sum(splits)], torch.tensor(splits)), "dh's amax")


def test_amax_slot_hands_over_only_the_very_tensor():
    rows, amax = torch.randn(4, 3), torch.ones(2)
    slot = AmaxSlot()
    slot.put(rows, amax)
    assert slot.take(rows.clone()) is None  # equal values, another tensor: measure again
    assert slot.take(rows) is None  # emptied by the first take
    slot.put(rows, amax)
    assert slot.take(rows) is amax
    assert slot.rows is None and slot.amax is None
