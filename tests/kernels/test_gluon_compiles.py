"""qmoe's Gluon kernels compile for sm_90a with the Triton installed here, no GPU needed.

On an sm90 GPU a Gluon kernel that fails to compile falls back to the slower Triton kernel with a
warning (`_gluon_sm90.launch_once`), so a Gluon name that moved between Triton releases (the
shared-memory reinterpret and the thread barrier did from 3.6 to 3.9) would otherwise go
unnoticed until someone reads the warnings. Each kernel is compiled the way its launcher calls
it, through `warmup` with Triton's driver pointed at an sm90 target; nothing runs.
"""
import contextlib

import pytest
import torch

gluon_sm90 = pytest.importorskip("qmoe.kernels._gluon_sm90")
if gluon_sm90.gluon is None:
    pytest.skip("this Triton has no Gluon", allow_module_level=True)


@pytest.fixture
def compile_only():
    """compile_only(module, name): the module's kernel `name` compiles on launch instead of running,
    for an sm90 target (benchmarks.kernel_sass); returns the list the compiled kernels are appended to."""
    from benchmarks.kernel_sass import compiling, sm90_target

    compiled = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(sm90_target())

        def patch(module, name):
            stack.enter_context(compiling(module, name, compiled))
            return compiled

        yield patch


def _fits(kernels):
    assert kernels, "nothing was compiled"
    for k in kernels:
        assert k.asm.get("cubin"), "no sm_90a binary"
        assert k.metadata.shared <= gluon_sm90.SMEM_BYTES, k.metadata.shared


def test_block_gemm_compiles(compile_only):
    from benchmarks.kernel_sass import gemm_launch
    from qmoe.kernels import _block_gemm_ws as ws

    kernels = compile_only(ws, "block_gemm_ws_kernel")
    for cfg in (dict(ws.DISPATCH, scales_tma=True), ws.DISPATCH_WIDE):
        gemm_launch(**cfg)()
    _fits(kernels)


def test_block_wgrad_compiles(compile_only):
    from benchmarks.kernel_sass import wgrad_operands
    from qmoe.kernels import _block_wgrad_ws as wg

    kernels = compile_only(wg, "block_wgrad_ws_kernel")
    a, b, offsets = wgrad_operands(384, seed=2)
    named_turns = dict(wg.DISPATCH_WIDE, pipe=4)  # the ping-pong's turns through named barriers
    for cfg, dtype in ((wg.DISPATCH, torch.bfloat16), (wg.DISPATCH_WIDE, torch.bfloat16),
                       (wg.DISPATCH_WIDE, torch.float32), (named_turns, torch.bfloat16)):
        out = torch.empty(3, 256, 384, dtype=dtype)  # wide tiles hold 16-bit results in two slots, fp32 in one
        wg.launch_block_wgrad_ws(a, b, offsets, 256, 384, 3, out, programs=4, **cfg)
    _fits(kernels)
    assert len(kernels) == 4


@pytest.mark.parametrize("dtype,mx,activation,canonical", [
    (torch.bfloat16, False, None, False), (torch.bfloat16, True, None, False), (torch.float16, False, None, False),
    (torch.bfloat16, False, "swiglu", False), (torch.bfloat16, True, "clamped_qgeglu", False),
    (torch.bfloat16, False, None, True), (torch.bfloat16, True, None, True)],
    ids=["bf16-words", "mxfp8", "fp32-reads", "swiglu", "mxfp8-qgeglu", "bf16-canonical-scales",
         "mxfp8-canonical-scales"])
def test_block_cast_compiles(compile_only, dtype, mx, activation, canonical):
    """Scales in tile order (the dispatched path's) and in the canonical layout (direct launches)."""
    from benchmarks.kernel_sass import cast_launch
    from qmoe.kernels import _cast_transpose_gl as ct

    kernels = compile_only(ct, "fp8_block_cast_kernel")
    cast_launch(dtype, mx, activation, canonical)()
    _fits(kernels)
