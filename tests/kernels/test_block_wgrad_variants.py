"""The warp-specialised Gluon FP8 block wgrad (qmoe/kernels/_block_wgrad_ws.py, not dispatched)
gives k_grouped_gemm's bits: uneven token groups that start and end inside 128-token steps, an
expert without tokens, edge tiles, bf16 and fp32 results, accumulation into `out`, and a NaN
in the token right after a group's end that must not reach that group's dW."""
import pytest
import torch

SPLITS = [300, 0, 450, 77, 5]
PAD = 16  # tokens past the last group; the total stays a multiple of 16 (TMA row strides)


def _operands(n, k, nan_after_group=None):
    from qmoe.quant import GroupedTensor
    from qmoe.recipes import Float8BlockScaling

    r = Float8BlockScaling()
    g = torch.Generator().manual_seed(11)
    t = sum(SPLITS) + PAD
    dy, x = torch.randn(t, n, generator=g), torch.randn(t, k, generator=g)
    dy[sum(SPLITS):] = 0
    x[sum(SPLITS):] = 0
    if nan_after_group is not None:
        x[sum(SPLITS[:nan_after_group + 1]), 3] = float("nan")
    quantize = lambda v, role: GroupedTensor.quantize(v.cuda(), torch.tensor(SPLITS), r.quantizer(role),  # noqa: E731
                                                      rowwise=False, validate=False)
    return quantize(dy, "grad_output"), quantize(x, "input")


def _gluon(dy, x, out_dtype=torch.bfloat16, **kw):
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import grouped_gemm as gg
    from qmoe.kernels._block_wgrad_ws import launch_block_wgrad_ws

    a, b = gg.tokens_operand(dy, Scaling.BLOCK), gg.tokens_operand(x, Scaling.BLOCK)
    return launch_block_wgrad_ws(a, b, dy.offsets, dy.shape[1], x.shape[1], dy.num_groups, out_dtype, programs=5,
                                 **kw)


def _same(out, want):
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    assert torch.equal(out.nan_to_num(0.0), want.nan_to_num(0.0)), (out.float() - want.float()).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 384), (328, 200)], ids=["n256-k384", "n328-k200"])
@pytest.mark.parametrize("pipe, stages", [(0, 5), (3, 5), (0, 4)])
def test_gluon_wgrad_gives_the_current_kernels_bits(shape, pipe, stages):
    from qmoe.kernels.grouped_gemm import k_grouped_gemm_with

    dy, x = _operands(*shape, nan_after_group=2)
    for out_dtype in (torch.bfloat16, torch.float32):
        want = k_grouped_gemm_with(dy, x, out_dtype=out_dtype)
        got = _gluon(dy, x, out_dtype, pipe=pipe, stages=stages)
        _same(got, want)
        assert (got[1] == 0).all(), "an expert without tokens gets exact zeros"
        assert torch.isfinite(got[2]).all(), "the next group's NaN stays out of group 2's dW"
    base = torch.randn(len(SPLITS), *shape, device="cuda")
    want, got = base.clone(), base.clone()
    k_grouped_gemm_with(dy, x, out=want, accumulate=True)
    _gluon(dy, x, torch.float32, out=got, accumulate=True, pipe=pipe, stages=stages)
    _same(got, want)
    assert torch.equal(got[1], base[1])


def test_token_operands_the_gluon_wgrad_cannot_take_are_refused():
    from qmoe.kernels._block_wgrad_ws import check_wgrad_operands
    from qmoe.kernels.grouped_gemm import _Operand

    soffs = torch.zeros(3, dtype=torch.int64)

    def op(tokens, block=(1, 128)):
        d = torch.empty(64, tokens, dtype=torch.float8_e4m3fn)
        return _Operand(d, tokens, 1, block=block, soffs=soffs)

    check_wgrad_operands(op(256), op(256), 256)
    with pytest.raises(ValueError, match="aligned"):
        check_wgrad_operands(op(200), op(200), 200)  # rows of 200 bytes: no TMA
    with pytest.raises(ValueError, match="1x128 token blocks"):
        check_wgrad_operands(op(256, (1, 32)), op(256), 256)
