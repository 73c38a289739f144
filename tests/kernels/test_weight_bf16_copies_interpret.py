"""Kept weights on the emulated MXFP8 / NVFP4 GEMMs' dequantize-first route: the same bits, one
dequantize pass per weight copy (GroupedTensor.bf16_copies, filled by qmoe.quant.weight_cache).

fprop and dgrad through weights that carry a `bf16_copies` dict give the bits of weights without
one, call after call, and the route dequantizes each weight copy once: MXFP8 and 1x16 NVFP4
weights keep a rowwise and a columnwise bf16 copy; 16x16 NVFP4 weights, whose two copies share
every scale, keep one that fprop and dgrad share. On the CPU through Triton's interpreter (see
test_grouped_gemm_interpret.py), and on the GPU at a size where the route is the default.
"""
import copy

import pytest
import torch

from qmoe.recipes import MXFP8BlockScaling, NVFP4BlockScaling
from tests.kernels.interpret import inside, launcher, assert_passed_under_interpreter

RECIPES = [pytest.param(MXFP8BlockScaling(), {"rowwise", "columnwise"}, id="mxfp8"),
           pytest.param(NVFP4BlockScaling(disable_stochastic_rounding=True), {"2d"}, id="nvfp4"),
           pytest.param(NVFP4BlockScaling(disable_stochastic_rounding=True, disable_2d_quantization=True),
                        {"rowwise", "columnwise"}, id="nvfp4-1d")]


@launcher
def test_kept_bf16_weights_under_the_interpreter():
    assert_passed_under_interpreter(__file__, r"\b\d+ passed, \d+ skipped(, \d+ warnings)? in ")


def check_kept_bf16_weights(recipe, slots, splits, n, k, device, monkeypatch):
    from qmoe.kernels import grouped_gemm as kernels
    from qmoe.ops.grouped_gemm import quantize_weights
    from qmoe.quant import GroupedTensor

    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(splits), k, generator=g).to(device)
    dy = torch.randn(sum(splits), n, generator=g).to(device)
    w = (torch.randn(len(splits), n, k, generator=g) / k ** 0.5).to(device)
    xq = GroupedTensor.quantize(x, splits, recipe.quantizer("input"), rowwise=True, columnwise=False)
    dyq = GroupedTensor.quantize(dy, splits, recipe.quantizer("grad_output"), rowwise=True, columnwise=False)
    wq = quantize_weights(w, recipe.quantizer("weight"), rowwise=True, columnwise=True)

    def run(b):
        return [kernels.m_grouped_gemm_with(a, b, b_columnwise=col, out_dtype=torch.float32, route="dequant")
                for a, col in ((xq, False), (dyq, True))]

    want = run(wq)
    weight_passes = []
    real = kernels._dequantized

    def counted(op, scaling, rows, cols, row_group, col_group, out_shape, *args, **kwargs):
        if len(out_shape) == 3:  # [E, N, K]: a weight copy (token operands are 2-D)
            weight_passes.append(out_shape)
        return real(op, scaling, rows, cols, row_group, col_group, out_shape, *args, **kwargs)
    monkeypatch.setattr(kernels, "_dequantized", counted)
    kept = copy.copy(wq)
    kept.bf16_copies = {}
    for _ in range(3):
        got = run(kept)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert set(kept.bf16_copies) == slots and len(weight_passes) == len(slots)
    for w16 in kept.bf16_copies.values():
        assert w16.dtype == torch.bfloat16 and w16.shape == (len(splits), n, k) and w16.is_contiguous()


@inside
@pytest.mark.parametrize("recipe, slots", RECIPES)
def test_kept_bf16_weights_give_the_same_bits(recipe, slots, monkeypatch):
    check_kept_bf16_weights(recipe, slots, [0, 19, 1, 40, 0, 8], 96, 208, "cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe, slots", RECIPES)
def test_kept_bf16_weights_give_the_same_bits_on_the_gpu(recipe, slots, monkeypatch):
    check_kept_bf16_weights(recipe, slots, [512, 0, 300, 1212], 1536, 2048, "cuda", monkeypatch)
