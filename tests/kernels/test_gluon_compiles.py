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
    for cfg, dtype in ((wg.DISPATCH, torch.bfloat16), (wg.DISPATCH_WIDE, torch.bfloat16),
                       (wg.DISPATCH_WIDE, torch.float32)):
        out = torch.empty(3, 256, 384, dtype=dtype)  # wide tiles hold 16-bit results in two slots, fp32 in one
        wg.launch_block_wgrad_ws(a, b, offsets, 256, 384, 3, out, programs=4, **cfg)
    _fits(kernels)
    assert len(kernels) == 3



def test_tensor_gemms_compile(compile_only):
    """The per-tensor m-grouped GEMM (both tile widths) and wgrad (16-bit results by TMA, and
    added into `out`) on current-scaling operands: E5M2 gradients times E4M3 weights and inputs."""
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import _tensor_gemm_ws as tw
    from qmoe.kernels import grouped_gemm as gg
    from qmoe.ops.grouped_gemm import quantize_weights
    from qmoe.quant import GroupedTensor
    from qmoe.recipes import Float8CurrentScaling

    recipe, g, sizes = Float8CurrentScaling(), torch.Generator().manual_seed(0), torch.tensor([150, 0, 106])
    dy, x = (GroupedTensor.quantize(torch.randn(256, 512, generator=g), sizes, recipe.quantizer(role),
                                    validate=False) for role in ("grad_output", "input"))
    w = quantize_weights(torch.randn(3, 512, 512, generator=g), recipe.quantizer("weight"), rowwise=True,
                         columnwise=True)
    kernels = compile_only(tw, "tensor_gemm_ws_kernel")
    compile_only(tw, "tensor_wgrad_ws_kernel")
    b, n_out, k = gg.weight_operand(w, Scaling.TENSOR, True)
    for bn in (256, 128):
        tw.launch_tensor_gemm_ws(gg.activation_operand(dy, Scaling.TENSOR), b, dy.offsets, 256, n_out, k, 3,
                                 programs=132, bn=bn, b_columnwise=True)
    a, b = gg.tokens_operand(dy, Scaling.TENSOR), gg.tokens_operand(x, Scaling.TENSOR)
    for accumulate in (False, True):
        tw.launch_tensor_wgrad_ws(a, b, dy.offsets, 512, 512, 3, torch.empty(3, 512, 512, dtype=torch.bfloat16),
                                  accumulate, programs=132, **tw.DISPATCH_K)
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


NO_VALUES = (False, False)


@pytest.mark.parametrize("dtype,mx,values", [(torch.bfloat16, False, NO_VALUES), (torch.float32, False, NO_VALUES),
                                             (torch.bfloat16, True, NO_VALUES), (torch.bfloat16, True, (True, False))],
                         ids=["1x128", "1x128-fp32", "mxfp8", "mxfp8-row-values"])
def test_gathered_cast_compiles(compile_only, dtype, mx, values):
    """The cast of gathered rows (a `GatheredRows`: cp.async into the ring) in its dispatched
    configuration, whose programs still fit an SM."""
    from benchmarks.kernel_sass import cast_launch
    from qmoe.kernels import _cast_transpose_gl as ct
    from qmoe.kernels.activation import GATHER

    config = ct.dispatch_config(mx, True, True, GATHER, values)
    kernels = compile_only(ct, "fp8_block_cast_kernel")
    cast_launch(dtype, mx, None, gather=True, values=values, **config)()
    _fits(kernels)
    assert kernels[-1].metadata.shared * config["per_sm"] <= gluon_sm90.SMEM_BYTES, config


@pytest.mark.parametrize("values", [(True, False), (False, True), (True, True)], ids=["rows", "columns", "both"])
@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_mxfp8_cast_with_exact_values_compiles(compile_only, values, activation):
    """The MXFP8 cast writing a copy's exact bf16 values in place of its codes (mxfp8_op's values)."""
    from benchmarks.kernel_sass import cast_launch
    from qmoe.kernels import _cast_transpose_gl as ct

    kernels = compile_only(ct, "fp8_block_cast_kernel")
    cast_launch(torch.bfloat16, True, activation, values=values)()
    _fits(kernels)


@pytest.mark.parametrize("mx,activation,values", [
    (False, None, (False, False)), (False, "swiglu", (False, False)), (True, "swiglu", (True, False)),
    (True, None, (True, False)), (True, None, (True, True)), (True, None, (False, False))],
    ids=["1x128", "1x128-swiglu", "mxfp8-swiglu-row-values", "mxfp8-row-values", "mxfp8-values", "mxfp8"])
def test_dispatched_cast_programs_fit_an_sm(compile_only, mx, activation, values):
    """The cast's dispatched configuration for these copies (`dispatch_config`) holds its programs
    per SM together: their shared memory fits one SM, and at its register cap nothing spills."""
    from benchmarks.kernel_sass import cast_launch, ptxas_spills
    from qmoe.kernels import _cast_transpose_gl as ct
    from qmoe.kernels.activation import NO_ACTIVATION, activation_code

    config = ct.dispatch_config(mx, True, True, activation_code(activation) if activation else NO_ACTIVATION, values)
    kernels = compile_only(ct, "fp8_block_cast_kernel")
    cast_launch(torch.bfloat16, mx, activation, values=values, **config)()
    _fits(kernels)
    assert kernels[-1].metadata.shared * config["per_sm"] <= gluon_sm90.SMEM_BYTES, config
    spills = ptxas_spills(kernels[-1].asm["ptx"])
    assert spills, "ptxas -v printed no spill counts"
    assert spills["spill_store_bytes"] == 0 and spills["spill_load_bytes"] == 0, (config, spills)
