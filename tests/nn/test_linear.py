"""qmoe.nn.Linear under every recipe: forward and gradients within NUMERICS.md tolerances of fp32."""
import pytest
import torch

import qmoe
from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                          NVFP4BlockScaling)
from tests.tolerances import assert_within_tolerance, recipe_tolerance

RECIPES = [
    pytest.param(DelayedScaling(), id="delayed"),
    pytest.param(Float8CurrentScaling(), id="current"),
    pytest.param(Float8BlockScaling(), id="block"),
    pytest.param(Float8BlockScaling(use_f32_scales=True), id="block-f32"),
    pytest.param(MXFP8BlockScaling(), id="mxfp8"),
    pytest.param(NVFP4BlockScaling(), id="nvfp4"),
    pytest.param(NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                   disable_2d_quantization=True), id="nvfp4-plain"),
]


def _run(layer, x, g, recipe):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad()
    if recipe is None:
        y = layer(x)
    else:
        with qmoe.autocast(recipe=recipe):
            y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", [(64, 256, 128), (2, 48, 160, 96)], ids=["2d", "3d-odd-blocks"])
def test_linear_matches_fp32(recipe, shape):
    torch.manual_seed(0)
    *lead, k, n = shape
    layer = qmoe.nn.Linear(k, n)
    x = torch.randn(*lead, k)
    g = torch.randn(*lead, n)
    ref = _run(layer, x, g, None)
    # delayed scaling starts from scale 1: one step records the amaxes, the second uses them
    out = _run(layer, x, g, recipe)
    if isinstance(recipe, DelayedScaling):
        out = _run(layer, x, g, recipe)
    rtol, atol = recipe_tolerance(recipe)
    for name, o, r in zip(("y", "dx", "dW", "db"), out, ref):
        assert o.shape == r.shape
        assert_within_tolerance(o, r, rtol, atol, name)


def test_outside_autocast_is_plain_linear():
    layer = qmoe.nn.Linear(32, 16)
    x = torch.randn(4, 32)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
    with qmoe.autocast(recipe=MXFP8BlockScaling(), enabled=False):
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=0, atol=0)


def test_quantized_forward_differs_and_follows_recipe_change():
    torch.manual_seed(1)
    layer = qmoe.nn.Linear(64, 32)
    x = torch.randn(32, 64)
    with qmoe.autocast(recipe=MXFP8BlockScaling()):
        y1 = layer(x)
    first = layer.recipe_state.quantizers["input"]
    with qmoe.autocast(recipe=NVFP4BlockScaling()):
        y2 = layer(x)
    assert layer.recipe_state.quantizers["input"] is not first
    assert not torch.equal(y1, y2)
    assert not torch.equal(y1, torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_backward_saves_quantized_copies_not_activations():
    layer = qmoe.nn.Linear(64, 32)
    x = torch.randn(16, 64, requires_grad=True)
    with qmoe.autocast(recipe=Float8BlockScaling()):
        y = layer(x)
    ctx = y.grad_fn
    while not hasattr(ctx, "saved"):  # through the reshape to the grouped linear's node
        ctx = ctx.next_functions[0][0]
    xq, wq = ctx.saved.x_operand, ctx.saved.w_operand
    assert xq.rowwise_data is None and xq.columnwise_data.dtype == torch.float8_e4m3fn
    assert wq.rowwise_data is None and wq.columnwise_data.dtype == torch.float8_e4m3fn
    assert not any(isinstance(t, torch.Tensor) and t.shape == x.shape for t in ctx.saved_tensors)


@pytest.mark.parametrize("bad, exc", [
    (torch.randn(4, 33), ValueError),
    (torch.randint(0, 3, (4, 32)), TypeError),
])
def test_bad_input_raises(bad, exc):
    layer = qmoe.nn.Linear(32, 16)
    with pytest.raises(exc):
        layer(bad)


def test_bad_constructor_args():
    with pytest.raises(ValueError, match="in_features"):
        qmoe.nn.Linear(0, 4)


def test_nvfp4_rht_needs_rows_multiple_of_16():
    layer = qmoe.nn.Linear(32, 16)
    x = torch.randn(10, 32)
    with qmoe.autocast(recipe=NVFP4BlockScaling()):
        with pytest.raises(ValueError, match="multiple of 16"):
            layer(x)
