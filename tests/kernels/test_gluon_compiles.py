"""qmoe's Gluon kernels compile for sm_90a with the Triton installed here, no GPU needed.

On an sm90 GPU a Gluon kernel that fails to compile falls back to the slower Triton kernel with a
warning (`_gluon_sm90.launch_once`), so a Gluon name that moved between Triton releases (the
shared-memory reinterpret and the thread barrier did from 3.6 to 3.9) would otherwise go
unnoticed until someone reads the warnings. Each kernel is compiled the way its launcher calls
it, through `warmup` with Triton's driver pointed at an sm90 target; nothing runs.
"""
import pytest
import torch

from tests.kernels.gluon import grouped_operands

gluon_sm90 = pytest.importorskip("qmoe.kernels._gluon_sm90")
if gluon_sm90.gluon is None:
    pytest.skip("this Triton has no Gluon", allow_module_level=True)


class _Sm90Target:
    """The parts of Triton's active driver that compiling needs: an sm90 target."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@pytest.fixture
def compile_only(monkeypatch):
    """compile_only(module, name): the module's kernel `name` compiles on launch instead of running;
    returns the list the compiled kernels are appended to."""
    from triton.runtime import driver

    monkeypatch.setattr(driver, "_active", _Sm90Target())  # put back after the test (no GPU driver here)
    compiled = []

    def patch(module, name):
        kernel = getattr(module, name)

        class Compile:
            def __getitem__(self, grid):
                def warm(*args, **kwargs):
                    compiled.append(kernel.warmup(*args, grid=grid, **kwargs))
                    return compiled[-1]
                return warm

        monkeypatch.setattr(module, name, Compile())
        return compiled

    return patch


def _fits(kernels):
    assert kernels, "nothing was compiled"
    for k in kernels:
        assert k.asm.get("cubin"), "no sm_90a binary"
        assert k.metadata.shared <= gluon_sm90.SMEM_BYTES, k.metadata.shared


def _block_operands(layout):
    from qmoe.recipes import Float8BlockScaling

    return grouped_operands(Float8BlockScaling(), layout, 256, 256, "cpu", [150, 0, 106], 0, seed=1)


def test_block_gemm_compiles(compile_only):
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import _block_gemm_ws as ws
    from qmoe.kernels import grouped_gemm as gg

    kernels = compile_only(ws, "block_gemm_ws_kernel")
    a, b = _block_operands("fprop")
    a_op = gg.activation_operand(a, Scaling.BLOCK)
    b_op, n_out, k = gg.weight_operand(b, Scaling.BLOCK, False)
    for cfg in (dict(ws.DISPATCH, scales_tma=True), ws.DISPATCH_WIDE):
        ws.launch_block_gemm_ws(a_op, b_op, a.offsets, a.shape[0], n_out, k, b.num_groups, programs=4, **cfg)
    _fits(kernels)


def test_block_wgrad_compiles(compile_only):
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import _block_wgrad_ws as wg
    from qmoe.kernels import grouped_gemm as gg
    from qmoe.quant import GroupedTensor
    from qmoe.recipes import Float8BlockScaling

    kernels = compile_only(wg, "block_wgrad_ws_kernel")
    recipe = Float8BlockScaling()
    sizes = torch.tensor([160, 0, 96])
    g = torch.Generator().manual_seed(2)
    dyq, xq = (GroupedTensor.quantize(torch.randn(256, c, generator=g), sizes, recipe.quantizer(role), rowwise=False,
                                      validate=False) for c, role in ((256, "grad_output"), (384, "input")))
    a, b = gg.tokens_operand(dyq, Scaling.BLOCK), gg.tokens_operand(xq, Scaling.BLOCK)
    for cfg, dtype in ((wg.DISPATCH, torch.bfloat16), (wg.DISPATCH_WIDE, torch.bfloat16),
                       (wg.DISPATCH_WIDE, torch.float32)):  # wide tiles hold 16-bit results in two slots, fp32 in one
        out = torch.empty(3, 256, 384, dtype=dtype)
        wg.launch_block_wgrad_ws(a, b, dyq.offsets, 256, 384, 3, out, programs=4, **cfg)
    _fits(kernels)
    assert len(kernels) == 3


@pytest.mark.parametrize("dtype,mx", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False)],
                         ids=["bf16-words", "mxfp8", "fp32-reads"])
def test_block_cast_compiles(compile_only, dtype, mx):
    from qmoe.contracts.formats import E4M3
    from qmoe.kernels import _cast_transpose_gl as ct
    from qmoe.kernels import quantize as K

    kernels = compile_only(ct, "fp8_block_cast_kernel")
    m, k = 256, 384
    x = torch.randn(m, k).to(dtype)
    row, col = torch.empty(m, k, dtype=torch.float8_e4m3fn), torch.empty(k, m, dtype=torch.float8_e4m3fn)
    block, scale_dtype = (32, torch.uint8) if mx else (128, torch.float32)
    row_s, col_s = torch.empty(m, k // block, dtype=scale_dtype), torch.empty(k, m // block, dtype=scale_dtype)
    cfg = {key: v for key, v in ct.DISPATCH.items() if key != "per_sm"}
    ct.launch(x, None, 1, False, K.fp8_meta(E4M3), E4M3.max, True, 0.0, True, True, row, row_s, col, col_s,
              programs=4, mx=(E4M3.emax, True) if mx else None, **cfg)
    _fits(kernels)
