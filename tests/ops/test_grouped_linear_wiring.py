"""Every GEMM of a grouped linear is handed the operands NUMERICS.md's recipe table prescribes.

The plan's steps report to a test-only observer (`qmoe.ops.grouped_linear.observe_steps`): what
each quantize step made from which tensor, and which operands each GEMM step got and returned.
For every recipe, on both paths (grouped, split), for GroupedLinear and for MoELayer's two
expert GEMMs:
- each quantize step's output is, bit for bit, what a fresh quantizer of the role the table
  gives that tensor makes of it (x: input, W: weight, dy: grad_output), built here from the
  recipe: element format (E4M3 / E5M2 / E2M1), block scales, the RHT, stochastic rounding (the
  same seed, the draws replayed in the order backward made them);
- each GEMM step is handed those very objects and reads the copy its layout needs: its output
  is, within NUMERICS.md's GEMM contract, the product of the expected operands' dequantized
  values, fprop x_row @ W_row^T, dgrad dy_row @ W_col^T, wgrad dy_col @ x_col^T (columnwise
  copies are stored transposed).
So a role, orientation or format swapped anywhere in the plan fails here, on the CPU.
"""
import pytest
import torch

import qmoe
from qmoe.ops.grouped_linear import observe_steps
from qmoe.ops.grouped_linear_paths import Groups
from qmoe.quant import GroupedTensor
from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                          NVFP4BlockScaling)
from qmoe.contracts.carriers import GatheredRows, RowsWithAmax
from qmoe.contracts.scales import gemm_scale
from qmoe.ops.activation import activation_forward
from qmoe.reference.grouped_quantize import grouped_tensor_amax
from tests.tolerances import assert_bit_identical, assert_gemm_within_contract

RECIPES = [pytest.param(DelayedScaling(), id="delayed"), pytest.param(Float8CurrentScaling(), id="current"),
           pytest.param(Float8BlockScaling(), id="block"), pytest.param(MXFP8BlockScaling(), id="mxfp8"),
           pytest.param(NVFP4BlockScaling(), id="nvfp4")]  # NVFP4's defaults: 2-D weights, RHT, stochastic dy
PATHS = ["grouped", "split"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # the reference; the kernels
ROW = ("rowwise_data", "rowwise_scale_inv", "amax")
COL = ("columnwise_data", "columnwise_scale_inv", "columnwise_amax")
ROLE_OF_STEP = {"quantize_input": "input", "quantize_weight": "weight", "quantize_grad": "grad_output"}
SEED = 1234


class Recorder:
    """What every plan did, step by step: per plan, {step: record}; and the order of the plans'
    grad_output steps (backward's, whose stochastic-rounding draws the checks replay).

    A quantize step's record is (inputs, per-group parts, the operand object), the parts taken
    when reported (forward drops the rowwise copies backward does not read); a GEMM step's is
    (operands, output)."""

    def __init__(self):
        self.plans = {}  # id(plan) -> {step: record}, in the order the plans first reported
        self.grad_order = []

    def __call__(self, plan, step, inputs, output):
        record = self.plans.setdefault(id(plan), {})
        # the groups' split sizes as they were (backward's bookkeeping clears the Groups object)
        inputs = tuple(i.split_sizes.clone() if isinstance(i, Groups) else i for i in inputs)
        if step in ROLE_OF_STEP:
            record[step] = (inputs, _parts(output), output)
            if step == "quantize_grad":
                self.grad_order.append(record)
        else:
            record[step] = (inputs, output.detach().clone())

    def check(self, recipe, path, num_plans):
        assert len(self.plans) == num_plans, f"{len(self.plans)} plans ran"
        torch.manual_seed(SEED)  # backward's seed: replay its draws in its order
        want_grad = {id(steps): _expected(recipe, "quantize_grad", steps["quantize_grad"][0], path)
                     for steps in self.grad_order}
        for steps in self.plans.values():
            assert set(steps) == {"quantize_input", "quantize_weight", "fprop", "quantize_grad", "dgrad", "wgrad"}
            check_plan(recipe, path, steps, want_grad[id(steps)])


def _parts(operand) -> list:
    """Per group (expert), the stored tensors of a GroupedTensor or of a list of QuantizedTensors."""
    groups = operand.split() if isinstance(operand, GroupedTensor) else operand
    return [None if t is None else {p: getattr(t, p) for p in ROW + COL} for t in groups]


def _bounds(split_sizes) -> list[tuple[int, int]]:
    out, start = [], 0
    for m in split_sizes.tolist():
        out.append((start, start + m))
        start += m
    return out


def _values(x, split_sizes):
    """The values a quantize step received: a tensor, act(h) * probs (a fused activation: what the
    activation op computes on the same backend, which the fused quantizers match bit for bit; the
    kernel's activation and torch's differ in the last ulps), the rows a GatheredRows stands for
    (the permute fused into FC1's cast), or the rows of a RowsWithAmax, whose amax (reduced by the
    rows' producer) must be the groups' own."""
    if isinstance(x, RowsWithAmax):
        rows = _values(x.rows, split_sizes)
        assert_bit_identical(x.amax, grouped_tensor_amax(rows, split_sizes), "the producer's amax")
        return rows
    if isinstance(x, GatheredRows):  # the permuted rows, read from the tokens by the kernels
        return x.materialize()
    return x if isinstance(x, torch.Tensor) else activation_forward(*x)


def _expected(recipe, step, inputs, path):
    """Per group, a fresh quantizer's output (both copies) for the role NUMERICS.md gives `step`'s tensor.

    Fresh for every group: outside an autocast region a delayed-scaling quantizer moves its scale
    after each call (inside one, every group's slot starts at the fresh scale too)."""
    def fresh():
        return recipe.quantizer(ROLE_OF_STEP[step])

    if step == "quantize_weight":
        return [fresh().quantize(w, rowwise=True, columnwise=True) for w in inputs[0]]
    x, split_sizes = _values(inputs[0], inputs[1]), inputs[1]
    if path == "grouped":  # one call for all groups: stochastic rounding draws as the layer's did
        return GroupedTensor.quantize(x, split_sizes, fresh(), rowwise=True, columnwise=True).split()
    return [fresh().quantize(x[a:b], rowwise=True, columnwise=True) if b > a else None
            for a, b in _bounds(split_sizes)]


def _assert_quantized_as(got, want, what):
    assert len(got) == len(want), what
    for g, (parts, qt) in enumerate(zip(got, want)):
        if qt is None:
            assert parts is None, f"{what} group {g}: an empty group has no operand"
            continue
        for p in ROW + COL:
            if parts[p] is not None:  # the copies the step made (what each GEMM reads: below)
                assert getattr(qt, p) is not None, f"{what} group {g}: {p} should not exist"
                assert_bit_identical(parts[p], getattr(qt, p), f"{what} group {g} {p}")


def _same_objects(a, b) -> bool:
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same_object(x, y) for x, y in zip(a, b))
    return _same_object(a, b)


def _same_object(a, b) -> bool:
    """`a` is `b`, or (the gradient wgrad reads after dgrad) a shallow copy of `b` without its
    rowwise data, holding `b`'s own columnwise tensors."""
    if a is b:
        return True
    return (type(a) is type(b) and getattr(a, "rowwise_data", 0) is None and b.rowwise_data is not None
            and a.columnwise_data is b.columnwise_data and gemm_scale(a, True) is gemm_scale(b, True)
            and a.columnwise_data is not None)


def check_plan(recipe, path, steps, want_grad):
    """One grouped linear's forward and backward against the recipe table (module docstring)."""
    x = _expected(recipe, "quantize_input", steps["quantize_input"][0], path)
    w = _expected(recipe, "quantize_weight", steps["quantize_weight"][0], path)
    for step, want in (("quantize_input", x), ("quantize_weight", w), ("quantize_grad", want_grad)):
        _assert_quantized_as(steps[step][1], want, f"{path} {step}")
    # the GEMMs got the quantize steps' own objects (on the split path, lists of them) ...
    operand = {s: steps[s][2] for s in ROLE_OF_STEP}
    for step, (a, b) in {"fprop": ("quantize_input", "quantize_weight"), "dgrad": ("quantize_grad", "quantize_weight"),
                         "wgrad": ("quantize_grad", "quantize_input")}.items():
        got_a, got_b = steps[step][0][:2]
        assert _same_objects(got_a, operand[a]) and _same_objects(got_b, operand[b]), \
            f"{path} {step} was handed other operands"
    # ... and multiplied the copies their layouts need (a columnwise copy is stored transposed)
    bounds = _bounds(steps["quantize_input"][0][1])
    layouts = {"fprop": (x, w, False, False), "dgrad": (want_grad, w, False, True),
               "wgrad": (want_grad, x, True, True)}
    for step, (a, b, a_col, b_col) in layouts.items():
        out = steps[step][1]
        want = torch.zeros(out.shape, dtype=torch.float64, device=out.device)
        for g, ((lo, hi), qa, qb) in enumerate(zip(bounds, a, b)):
            if qa is None:
                continue
            prod = qa.dequantize(torch.float32, columnwise=a_col).double() @ \
                qb.dequantize(torch.float32, columnwise=b_col).double().t()
            if step == "wgrad":
                want[g] = prod
            else:
                want[lo:hi] = prod
        assert_gemm_within_contract(out, want, f"{path} {step}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_linear_gemm_operands(recipe, path, device):
    torch.manual_seed(0)
    layer = qmoe.nn.GroupedLinear(3, 128, 64, bias=False, grouped_path=path, device=device)
    x = torch.randn(96, 128, device=device, requires_grad=True)
    dy = torch.randn(96, 64, device=device)
    recorder = Recorder()
    with observe_steps(recorder):
        with qmoe.autocast(recipe=recipe):
            y = layer(x, torch.tensor([32, 0, 64], device=device))
        torch.manual_seed(SEED)
        y.backward(dy)
    recorder.check(recipe, path, num_plans=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_moe_layer_gemm_operands(recipe, path, device):
    """FC1 and FC2 of the experts (FC2's input the fused activation where the recipe fuses it)."""
    torch.manual_seed(0)
    layer = qmoe.nn.MoELayer(128, 64, 4, 2, grouped_path=path, device=device)
    x = torch.randn(48, 128, device=device, requires_grad=True)
    recorder = Recorder()
    with observe_steps(recorder):
        with qmoe.autocast(recipe=recipe):
            y = layer(x)
        g = torch.randn(y.shape, device=device)
        torch.manual_seed(SEED)
        y.backward(g)
    recorder.check(recipe, path, num_plans=2)
