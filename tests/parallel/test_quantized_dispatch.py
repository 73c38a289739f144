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
    # one per-tensor scale, the tensor's: the same bits as quantizing the tensor whole
    assert torch.equal(gt.dequantize(), q.quantize(x, rowwise=True, columnwise=False).dequantize())


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
    rows = recipe.quantizer("input").quantize_for_dispatch(x)
    x_rows = rows.dequantize()  # what dispatch carries beside the quantized rows

    def run(carrier, quantized_input):
        layer.zero_grad()
        xi = carrier.clone().requires_grad_(True)
        with qmoe.autocast(recipe=recipe):
            y = layer(xi, splits, quantized_input=quantized_input)
        y.backward(torch.ones_like(y))
        return y.detach(), xi.grad, layer.weight.grad.clone()

    inside, inside_of_rows, pre = run(x, None), run(x_rows, None), run(x_rows, rows)
    # fprop and dgrad use the same rowwise bits as quantizing x inside the layer
    assert torch.equal(pre[0], inside[0]) and torch.equal(pre[1], inside[1])
    # wgrad's columnwise copy is quantized from the carrier's values: the same bits as the normal
    # path given those values (requantizing the rows with power-of-two scales changes nothing)
    for got, want, what in zip(pre, inside_of_rows, ("y", "dx", "dw")):
        assert torch.equal(got, want), what


def test_quantized_input_needs_a_recipe():
    layer = qmoe.nn.GroupedLinear(1, 128, 64, bias=False)
    rows = MXFP8BlockScaling().quantizer("input").quantize_for_dispatch(_x())
    with pytest.raises(ValueError, match="quantized_input needs a recipe"):
        layer(_x(), torch.tensor([40]), quantized_input=rows)
