"""MoELayer under current scaling: the permute, the unpermute backward and the activation backward
hand their amaxes to the experts' quantizers, which then only cast; every quantized operand is
the one the quantizers make when they measure the amax themselves, bit for bit.

On the CPU this runs the reference twins; tests/kernels/test_amax_producers_interpret.py runs
the same layer on the Triton kernels under the interpreter, and the GPU tests at the end here.
"""
from __future__ import annotations

import pytest
import torch

import qmoe
from qmoe.contracts.carriers import AmaxSlot
from qmoe.ops.grouped_linear import observe_steps
from qmoe.quant import GroupedTensor
from qmoe.quant.quantizer import Float8CurrentQuantizer
from qmoe.recipes import DelayedScaling, Float8CurrentScaling
from tests.quant.test_rows_with_amax import counting_amax_passes
from tests.tolerances import assert_bit_identical

QUANTIZE_STEPS = ("quantize_input", "quantize_weight", "quantize_grad")
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _record():
    """(observer, list of (step, the operand's stored tensors)) in the order the steps ran."""
    steps = []

    def observer(plan, step, inputs, output):
        if step in QUANTIZE_STEPS:
            parts = output.split() if isinstance(output, GroupedTensor) else output
            steps.append((step, [None if t is None else {f: getattr(t, f) for f in FIELDS} for t in parts]))
    return observer, steps


def _run(layer, x, g, recipe):
    observer, steps = _record()
    for p in layer.parameters():
        p.grad = None
    xr = x.detach().clone().requires_grad_(True)
    with counting_amax_passes() as calls, observe_steps(observer):
        with qmoe.autocast(recipe=recipe):
            y = layer(xr)
        y.backward(g)
    grads = [xr.grad] + [p.grad for p in layer.parameters()]
    return y.detach(), grads, steps, len(calls)


CASES = [
    dict(),
    dict(bias=True, activation="geglu", glu_interleave_size=8),
    dict(recompute_activation=True, activation="relu2"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", CASES, ids=["swiglu", "geglu-bias-interleaved", "relu2-recompute"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_operands_are_those_of_measured_amaxes(monkeypatch, kw, dtype, device):
    torch.manual_seed(0)
    layer = qmoe.nn.MoELayer(64, 32, 4, 2, params_dtype=dtype, device=device, **kw)
    x = torch.randn(3, 8, 64, dtype=dtype, device=device)
    x[0, 1] = float("inf")  # a token with a non-finite value: its groups' amaxes skip it
    g = torch.randn(3, 8, 64, dtype=dtype, device=device)
    recipe = Float8CurrentScaling()
    y, grads, steps, passes = _run(layer, x, g, recipe)
    monkeypatch.setattr(Float8CurrentQuantizer, "takes_amax", False)
    want_y, want_grads, want_steps, want_passes = _run(layer, x, g, recipe)
    assert [s for s, _ in steps] == [s for s, _ in want_steps]
    for i, ((step, parts), (_, want)) in enumerate(zip(steps, want_steps)):
        for gi, (a, b) in enumerate(zip(parts, want)):
            for f in FIELDS:
                if b is not None and b[f] is not None:
                    assert_bit_identical(a[f], b[f], f"step {i} ({step}) group {gi} {f}")
    assert_bit_identical(y, want_y, "output")
    for i, (a, b) in enumerate(zip(grads, want_grads)):
        assert_bit_identical(a, b, f"gradient {i}")
    # measured, the amax passes are: the two weights, FC1's input, FC2's input (on the kernels,
    # fused with the activation), FC2's and FC1's grad_output (recompute: FC2's input twice)
    fc2_input = 2 if kw.get("recompute_activation") else 1
    assert want_passes == 5 + fc2_input
    # handed over: only the weights' and, where the kernels fuse the activation into FC2's input
    # quantization (the input's producer is then FC1's GEMM), FC2's input
    fused = device == "cuda"
    assert passes == 2 + (fc2_input if fused else 0), f"{passes} amax passes"


def test_delayed_scaling_takes_no_amax():
    layer = qmoe.nn.MoELayer(64, 32, 4, 2)
    x = torch.randn(16, 64)
    with qmoe.autocast(recipe=DelayedScaling()):
        assert not layer.experts.takes_amax("input", x)
        assert not layer.experts.takes_amax("grad_output", x)
    with qmoe.autocast(recipe=Float8CurrentScaling()):
        assert layer.experts.takes_amax("input", x)
        assert not layer.experts.takes_amax("input", x.double())
    assert not layer.experts.takes_amax("input", x)  # no recipe


def test_a_changed_gradient_is_measured_again():
    """A hook between the unpermute backward and FC2 changes dy: FC2's quantizer must not take the
    amax of the gradient the hook replaced, and measures its own (same result as without slots)."""
    torch.manual_seed(1)
    mlp = qmoe.nn.GroupedMLP(3, 32, 16)
    t, k = 10, 2
    routing_map = torch.zeros(t, 3, dtype=torch.bool)
    routing_map[torch.arange(t), torch.arange(t) % 3] = True
    routing_map[torch.arange(t), (torch.arange(t) + 1) % 3] = True
    x = torch.randn(t, 32)

    def step(slot, hook=True):
        xr = x.clone().requires_grad_(True)
        with counting_amax_passes() as calls:
            with qmoe.autocast(recipe=Float8CurrentScaling()):
                permuted, row_probs, row_id_map, splits = qmoe.ops.moe_permute(xr, routing_map, align_size=16,
                                                                               top_k=k)
                y = mlp(permuted, splits.long(), row_probs, grad_output_amax=slot)
                if hook:
                    y.register_hook(lambda grad: grad * 3)
                out = qmoe.ops.moe_unpermute(y, row_id_map, grad_amax=slot)
            out.backward(torch.randn(t, 32, generator=torch.Generator().manual_seed(2)))
        return xr.grad, [p.grad for p in mlp.parameters()], len(calls)

    got = step(AmaxSlot())
    want = step(None)
    assert got[2] == want[2]  # FC2's grad_output measured in both
    assert step(AmaxSlot(), hook=False)[2] == want[2] - 1  # without the hook the slot's amax is taken
    assert_bit_identical(got[0], want[0], "dx")
    for a, b in zip(got[1], want[1]):
        assert_bit_identical(a, b, "weight gradient")
