"""The FP8 block-GEMM variants (qmoe/kernels/_block_gemm_tl.py, _block_gemm_ws.py) give the
current kernel's bits: uneven splits with an empty expert, group ends inside 128-row tiles,
rows past the last group (zeros), fprop and dgrad.

The persistent Triton variants also run on the CPU under Triton's interpreter (the launcher
test re-runs this file with TRITON_INTERPRET=1, as tests/kernels/interpret.py describes); the
Gluon kernel has no interpreter, so it is checked on the GPU only (marked gpu).
"""
import re

import pytest
import torch

from tests.kernels.interpret import inside, launcher, run_under_interpreter

SPLITS = [40, 0, 150, 7]  # an empty expert; no group boundary on a 128-row tile edge
PAD = 9  # rows past the last group
K, N = 256, 256
TL_VARIANTS = [dict(), dict(lag=True), dict(split=True), dict(ws=True, warps=4)]


def _operands(layout, device):
    from qmoe.ops.grouped_gemm import quantize_weights
    from qmoe.quant import GroupedTensor
    from qmoe.recipes import Float8BlockScaling

    recipe = Float8BlockScaling()
    g = torch.Generator().manual_seed(7)
    rows = sum(SPLITS) + PAD
    x = torch.randn(rows, K if layout == "fprop" else N, generator=g)
    x[sum(SPLITS):] = 0
    w = torch.randn(len(SPLITS), N, K, generator=g) / K ** 0.5
    role = "input" if layout == "fprop" else "grad_output"
    a = GroupedTensor.quantize(x.to(device), torch.tensor(SPLITS), recipe.quantizer(role), columnwise=False,
                               validate=False)
    b = quantize_weights(w.to(device), recipe.quantizer("weight"), rowwise=True, columnwise=True)
    return a, b


def _launch(launch, a, b, layout, out_dtype, **kw):
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import grouped_gemm as gg

    columnwise = layout == "dgrad"
    a_op = gg.activation_operand(a, Scaling.BLOCK)
    b_op, n_out, k = gg.weight_operand(b, Scaling.BLOCK, columnwise)
    return launch(a_op, b_op, a.offsets, a.shape[0], n_out, k, b.num_groups, out_dtype, b_columnwise=columnwise,
                  programs=3, **kw)


def _check_variants(launch, variants, device):
    from qmoe.kernels import grouped_gemm as gg
    from qmoe.reference import grouped_gemm as reference

    for layout in ("fprop", "dgrad"):
        a, b = _operands(layout, device)
        columnwise = layout == "dgrad"
        oracle = reference.m_grouped_gemm(a, b, b_columnwise=columnwise, out_dtype=torch.float32)
        for out_dtype in (torch.float32, torch.bfloat16):
            current = gg.m_grouped_gemm_with(a, b, b_columnwise=columnwise, out_dtype=out_dtype)
            for kw in variants:
                out = _launch(launch, a, b, layout, out_dtype, **kw)
                assert torch.equal(out, current), (layout, out_dtype, kw, (out.float() - current.float()).abs().max())
                assert (out[sum(SPLITS):] == 0).all()
        rel = (current.float().cpu() - oracle.cpu()).norm() / oracle.norm()
        assert rel <= 1e-2, rel  # the bf16 result against the fp32 reference (NUMERICS.md)


@launcher
def test_block_gemm_variants_under_the_interpreter():
    proc = run_under_interpreter(__file__)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # everything passed there; this launcher and the GPU test are the two skips
    assert re.search(r"\b2 passed, 2 skipped(, \d+ warnings?)? in ", proc.stdout), proc.stdout[-2000:]


@inside
def test_triton_variants_give_the_current_kernels_bits_on_cpu():
    from qmoe.kernels._block_gemm_tl import launch_block_gemm_tl

    _check_variants(launch_block_gemm_tl, TL_VARIANTS, "cpu")


@pytest.mark.gpu
def test_block_gemm_variants_give_the_current_kernels_bits_on_gpu():
    from qmoe.kernels._block_gemm_tl import launch_block_gemm_tl
    from qmoe.kernels._block_gemm_ws import launch_block_gemm_ws

    _check_variants(launch_block_gemm_tl, TL_VARIANTS, "cuda")
    _check_variants(launch_block_gemm_ws, [dict(pipe=p, stages=s) for p, s in ((0, 5), (1, 5), (2, 5), (3, 5), (1, 4))],
                    "cuda")


def test_operands_the_tma_kernels_cannot_take_are_refused():
    from qmoe.kernels._block_gemm_tl import check_block_operands

    class Op:
        def __init__(self, block, stride_k=1):
            self.block, self.stride_k = block, stride_k

    check_block_operands(Op((1, 128)), Op((128, 128)), 256, 128)
    for a, b, k in ((Op((1, 128)), Op((128, 128)), 200), (Op((1, 32)), Op((128, 128)), 256),
                    (Op((1, 128)), Op((128, 128), stride_k=2), 256)):
        with pytest.raises(ValueError, match="K % 128"):
            check_block_operands(a, b, k, 128)
