"""The pieces of quantized dispatch, in one process: rows that stand alone, their bytes, FC1's hook.

`Quantizer.quantize_for_dispatch` rows regrouped by `GroupedTensor.from_rows` must multiply
exactly like rows quantized inside the GroupedTensor (1-row blocks: bit for bit), the byte
packing must round-trip, and `GroupedLinear(quantized_input=...)` must equal the normal path
where the math is the same.
"""
import pytest
import torch

import qmoe
from qmoe import GroupedTensor
from qmoe.parallel.payload import PackedRows
from qmoe.recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling

ROW_RECIPES = [pytest.param(Float8BlockScaling(), id="block"), pytest.param(MXFP8BlockScaling(), id="mxfp8")]


def _x(rows=40, k=128, seed=0):
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("recipe", [DelayedScaling(), NVFP4BlockScaling()], ids=["delayed", "nvfp4"])
def test_group_dependent_formats_are_not_dispatched_quantized(recipe):
    assert recipe.quantizer("input").quantize_for_dispatch(_x()) is None


@pytest.mark.parametrize("recipe", ROW_RECIPES)
def test_dispatch_rows_equal_grouped_rows_bit_for_bit(recipe):
    q = recipe.quantizer("input")
    x, splits = _x(), [8, 0, 32]
    rows = q.quantize_for_dispatch(x)
    regrouped = GroupedTensor.from_rows(rows, torch.tensor(splits))
    inside = GroupedTensor.quantize(x, splits, q, rowwise=True, columnwise=False)
    assert torch.equal(regrouped.rowwise_data.view(torch.uint8), inside.rowwise_data.view(torch.uint8))
    assert torch.equal(regrouped.rowwise_scale_inv.float(), inside.rowwise_scale_inv.float())


def test_current_scaling_rows_share_one_scale_in_every_group():
    q = Float8CurrentScaling().quantizer("input")
    x = _x()
    rows = q.quantize_for_dispatch(x)
    assert rows.rowwise_scale_inv.dim() == 0
    gt = GroupedTensor.from_rows(rows, torch.tensor([10, 30]))
    assert gt.rowwise_scale_inv.tolist() == [rows.rowwise_scale_inv.item()] * 2
    torch.testing.assert_close(gt.dequantize(), x, rtol=0.07, atol=0.0)


@pytest.mark.parametrize("recipe", ROW_RECIPES + [pytest.param(Float8CurrentScaling(), id="current")])
def test_packed_rows_round_trip_and_zero_padding(recipe):
    rows = recipe.quantizer("input").quantize_for_dispatch(_x())
    packed = PackedRows(rows)
    wire = packed.pack(rows)
    assert wire.dtype == torch.uint8 and wire.shape == (40, packed.row_bytes)
    back = packed.unpack(torch.cat((wire, torch.zeros(3, packed.row_bytes, dtype=torch.uint8))))
    assert torch.equal(back.dequantize()[:40], rows.dequantize())
    assert not back.dequantize()[40:].any()  # padding rows of zero bytes are zeros


@pytest.mark.parametrize("path", ["grouped", "split"])
@pytest.mark.parametrize("recipe", ROW_RECIPES)
def test_grouped_linear_with_quantized_input_equals_normal_path(recipe, path):
    torch.manual_seed(0)
    layer = qmoe.nn.GroupedLinear(3, 128, 64, bias=False, grouped_path=path)
    x, splits = _x(), torch.tensor([8, 0, 32])
    results = []
    for pre in (False, True):  # x quantized inside the layer, then rows quantized before it
        layer.zero_grad()
        with qmoe.autocast(recipe=recipe):
            rows = recipe.quantizer("input").quantize_for_dispatch(x) if pre else None
            xi = (rows.dequantize() if pre else x).clone().requires_grad_(True)  # dispatch's carrier
            y = layer(xi, splits, quantized_input=rows)
        y.backward(torch.ones_like(y))
        results.append((y.detach(), xi.grad, layer.weight.grad.clone()))
    (y0, dx0, dw0), (y1, dx1, dw1) = results
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    # wgrad's columnwise copy comes from the rows' values: power-of-two scales round them alike here
    torch.testing.assert_close(dw1, dw0, rtol=0.1, atol=0.1 * float(dw0.abs().max()))


def test_quantized_input_needs_a_recipe():
    layer = qmoe.nn.GroupedLinear(1, 128, 64, bias=False)
    rows = MXFP8BlockScaling().quantizer("input").quantize_for_dispatch(_x())
    with pytest.raises(ValueError, match="quantized_input needs a recipe"):
        layer(_x(), torch.tensor([40]), quantized_input=rows)
