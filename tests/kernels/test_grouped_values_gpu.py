"""GPU: the MXFP8 cast's exact values (`GroupedTensor.quantize(values=...)`) are the reference's bit
for bit, and the MoE layer gives the same bits whether its GEMMs read values or codes (MXFP8 and
NVFP4; NVFP4's cast is checked in tests/kernels/test_nvfp4_values_interpret.py).

The reference (`qmoe.reference.grouped_quantize.grouped_quantize_mxfp8`) dequantizes its own codes
(tests/quant/test_grouped_values.py pins that to the codes); here the Gluon cast writes the values
in one pass over x and must match it, NaN, infinities and saturation included.
"""
from __future__ import annotations

import importlib

import pytest
import torch

import qmoe
from qmoe.contracts.carriers import ActivatedRows
from qmoe.contracts.formats import E4M3, E5M2, ScaleMode
from qmoe.kernels import grouped_quantize as KG
from qmoe.ops.activation import activation_forward
from qmoe.recipes import MXFP8BlockScaling, NVFP4BlockScaling
from qmoe.reference import grouped_quantize as RG
from tests.kernels.test_quantize_kernels import assert_same, make_input

pytestmark = pytest.mark.gpu
SPLITS = [0, 37, 1, 0, 130, 64, 0, 29, 300]  # empty groups, starts off 32 rows, partial tiles
NAMES = ("row", "row_s", "col", "col_s")


def _splits(splits):
    return torch.tensor(splits, device="cuda")


@pytest.mark.parametrize("copies", [dict(rowwise=True, columnwise=True, values=("rowwise",)),
                                    dict(rowwise=True, columnwise=True, values=("rowwise", "columnwise")),
                                    dict(rowwise=False, columnwise=True, values=("columnwise",)),
                                    dict(rowwise=True, columnwise=False, values=("rowwise",)),
                                    dict(rowwise=True, columnwise=True, values=("columnwise",))],
                         ids=["rows", "both", "cols-alone", "rows-alone", "cols"])
@pytest.mark.parametrize("fmt,mode", [(E4M3, ScaleMode.ROUND_UP), (E5M2, ScaleMode.FLOOR)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", ["normal", "mixed"])
def test_the_casts_values_are_the_references(copies, fmt, mode, kind):
    k = 384
    x = make_input(sum(SPLITS), k, torch.bfloat16, seed=3, kind=kind)
    splits = _splits(SPLITS)
    got = KG.grouped_quantize_mxfp8(x, splits, fmt, mode, **copies)
    want = RG.grouped_quantize_mxfp8(x, splits, fmt, mode, **copies)
    for name, g, w in zip(NAMES, got, want):
        held = (name == "row" and "rowwise" in copies["values"]) or (name == "col" and "columnwise" in copies["values"])
        if held:
            assert g.dtype == torch.bfloat16 and g.shape == x.shape, f"{name}: the Gluon cast did not write values"
        assert_same(g, w, name)


@pytest.mark.parametrize("values", [("rowwise",), ("rowwise", "columnwise")], ids=["rows", "both"])
def test_the_fused_activation_casts_values_too(values):
    """FC2's input act(h) * probs, quantized from h: the values are those of the activation's output."""
    splits, f = _splits([64, 0, 200, 33]), 256
    h = make_input(297, 2 * f, torch.bfloat16, seed=5, kind="normal")
    probs = torch.rand(297, device="cuda")
    fused = ActivatedRows(h, probs, "swiglu", None)
    got = KG.grouped_quantize_mxfp8(fused, splits, E4M3, ScaleMode.ROUND_UP, True, True, values)
    act = activation_forward(h, probs, "swiglu", None)  # the kernel path's activation, which the cast fuses
    want = RG.grouped_quantize_mxfp8(act, splits, E4M3, ScaleMode.ROUND_UP, True, True, values)
    assert got[0].dtype == torch.bfloat16
    for name, g, w in zip(NAMES, got, want):
        assert_same(g, w, name)


def _moe_step(layer, x, g, recipe):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # NVFP4's stochastic rounding: the same random stream in both runs
    with qmoe.autocast(recipe=recipe):
        y = layer(x)
    y.backward(g)
    return [y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]


@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), NVFP4BlockScaling()], ids=["mxfp8", "nvfp4"])
@pytest.mark.parametrize("recompute", [False, True], ids=["kept-weights", "recompute-weight-columnwise"])
def test_the_layer_gives_the_same_bits_from_values_as_from_codes(monkeypatch, recompute, recipe):
    """Every GEMM's operands as codes (values never asked) against the default, where the casts write
    the values of the copies the dequantize-first GEMMs read; the default did hold values."""
    gl = importlib.import_module("qmoe.ops.grouped_linear")

    torch.manual_seed(0)
    e, hidden, ffn, tokens, top_k = 4, 256, 256, 1024, 2  # 2048 rows: >= 256 per expert, the values route
    layer = qmoe.nn.MoELayer(hidden, ffn, e, top_k, params_dtype=torch.bfloat16, device="cuda",
                             recompute_weight_columnwise=recompute)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    seen = []

    def observe(plan, step, inputs, output):
        if step in ("fprop", "dgrad", "wgrad"):
            seen.append((step, sorted(k for op in inputs for k in (getattr(op, "values", None) or {}))))

    with gl.observe_steps(observe):
        default = _moe_step(layer, x, g, recipe)
    # NVFP4's columnwise copies stay codes (grouped_linear._values_only): its wgrad reads codes
    due = [step != "wgrad" or isinstance(recipe, MXFP8BlockScaling) for step, _ in seen]
    assert seen and all(bool(held) == d for (_, held), d in zip(seen, due)), f"values where due, else codes: {seen}"
    monkeypatch.setattr(gl, "_values_only", lambda *args: ())
    codes = _moe_step(layer, x, g, recipe)
    for i, (a, b) in enumerate(zip(default, codes)):
        assert torch.equal(a, b), f"output {i} differs"
