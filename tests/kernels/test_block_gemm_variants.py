"""The FP8 block-GEMM variants (qmoe/kernels/_block_gemm_tl.py, _block_gemm_ws.py) give the
current Triton kernel's bits: uneven splits with an empty expert, group ends inside 128-row
tiles, rows past the last group (zeros), fprop and dgrad; and m_grouped_gemm dispatches the
Gluon kernel exactly where it applies.

The persistent Triton variants also run on the CPU under Triton's interpreter (the launcher
test re-runs this file with TRITON_INTERPRET=1, as tests/kernels/interpret.py describes); the
Gluon kernel has no interpreter, so it is checked on the GPU only (marked gpu, and never inside
the interpreter's subprocess). Triton's own Hopper warp specialisation (ws=True) deadlocked on
the GPU: it runs under the interpreter only.
"""
import warnings

import pytest
import torch

from tests.kernels.gluon import assert_a_compile_failure_falls_back_once, grouped_operands, pretend_sm90
from tests.kernels.interpret import INTERPRETING, inside, launcher, assert_passed_under_interpreter

SPLITS = [40, 0, 150, 7]  # an empty expert; no group boundary on a 128-row tile edge
BIG_SPLITS = [300, 0, 450, 77]  # enough rows per group for the dispatched Gluon kernel
PAD = 9  # rows past the last group
K, N = 256, 256
TL_GPU_VARIANTS = [dict(), dict(lag=True), dict(split=True)]
TL_VARIANTS = TL_GPU_VARIANTS + [dict(ws=True, warps=4)]  # interpreter only
WS_VARIANTS = ([dict(pipe=p, stages=s) for p, s in ((0, 5), (1, 5), (2, 5), (3, 5), (1, 4), (2, 6))]
               + [dict(pipe=2, stages=5, group_m=g) for g in (1, 4)]
               + [dict(bn=256, pipe=p, stages=s, c_bufs=c) for p, s, c in ((0, 4, 1), (3, 4, 1), (0, 3, 2), (3, 3, 2))]
               # the activation scales streamed by TMA with the codes
               + [dict(pipe=p, stages=5, scales_tma=True) for p in (0, 1, 2, 3)]
               + [dict(bn=256, pipe=p, stages=3, c_bufs=c, scales_tma=True) for p, c in ((0, 1), (3, 2))])
on_gpu = pytest.mark.skipif(INTERPRETING, reason="the GPU tests do not run under the interpreter")


def _operands(layout, device, splits=SPLITS, k=K, n=N, exact=False):
    from qmoe.recipes import Float8BlockScaling

    return grouped_operands(Float8BlockScaling(), layout, k, n, device, splits, PAD, seed=7, exact=exact)


def _current(a, b, layout, out_dtype):
    """The Triton kernel with its default tiles (a config bypasses the Gluon dispatch)."""
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import grouped_gemm as gg

    cfg = gg.tile_configs(Scaling.BLOCK, small_m=False)[0]
    return gg.m_grouped_gemm_with(a, b, b_columnwise=layout == "dgrad", out_dtype=out_dtype, config=cfg)


def _launch(launch, a, b, layout, out_dtype, **kw):
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import grouped_gemm as gg

    columnwise = layout == "dgrad"
    a_op = gg.activation_operand(a, Scaling.BLOCK)
    b_op, n_out, k = gg.weight_operand(b, Scaling.BLOCK, columnwise)
    return launch(a_op, b_op, a.offsets, a.shape[0], n_out, k, b.num_groups, out_dtype, b_columnwise=columnwise,
                  programs=3, **kw)


def _check_variants(launch, variants, device, fit=None):
    """Every variant's bits against the current kernel's. On the CPU the operands' dot products are
    exact (grouped_operands' `exact`): the interpreter's matmul sums in an order that depends on the
    tile's shape and the machine, which the GPU's tensor cores do not."""
    from qmoe.reference import grouped_gemm as reference

    for layout in ("fprop", "dgrad"):
        a, b = _operands(layout, device, exact=device == "cpu")
        columnwise = layout == "dgrad"
        oracle = reference.m_grouped_gemm(a, b, b_columnwise=columnwise, out_dtype=torch.float32)
        for out_dtype in (torch.float32, torch.bfloat16):
            current = _current(a, b, layout, out_dtype)
            for kw in variants:
                kw = fit(kw, out_dtype) if fit is not None else kw
                out = _launch(launch, a, b, layout, out_dtype, **kw)
                assert torch.equal(out, current), (layout, out_dtype, kw, (out.float() - current.float()).abs().max())
                assert (out[sum(SPLITS):] == 0).all()
        rel = (current.float().cpu() - oracle.cpu()).norm() / oracle.norm()
        assert rel <= 1e-2, rel  # the bf16 result against the fp32 reference (NUMERICS.md)


@launcher
def test_block_gemm_variants_under_the_interpreter():
    # the one `inside` test passed there; everything else skips in the subprocess
    assert_passed_under_interpreter(__file__, r"\b1 passed, \d+ skipped(, \d+ warnings?)? in ")


@inside
def test_triton_variants_give_the_current_kernels_bits_on_cpu():
    from qmoe.kernels._block_gemm_tl import launch_block_gemm_tl

    _check_variants(launch_block_gemm_tl, TL_VARIANTS, "cpu")


def _fit(kw, out_dtype):
    """Fewer stages where an fp32 result buffer would overflow shared memory."""
    from qmoe.kernels._block_gemm_ws import fit_stages

    kw = dict(kw)
    kw["stages"] = fit_stages(kw["stages"], 128, kw.get("bn", 128), out_dtype, kw.get("c_bufs", 1),
                              kw.get("scales_tma", False))
    return kw


@on_gpu
@pytest.mark.gpu
def test_block_gemm_variants_give_the_current_kernels_bits_on_gpu():
    from qmoe.kernels._block_gemm_tl import launch_block_gemm_tl
    from qmoe.kernels._block_gemm_ws import launch_block_gemm_ws

    _check_variants(launch_block_gemm_tl, TL_GPU_VARIANTS, "cuda")
    _check_variants(launch_block_gemm_ws, WS_VARIANTS, "cuda", fit=_fit)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 256), (384, 512), (1024, 328)], ids=["k256-n256", "k384-n512", "k1024-n328"])
@pytest.mark.parametrize("layout", ["fprop", "dgrad"])
def test_dispatched_block_gemm_gives_the_current_kernels_bits(layout, shape):
    """m_grouped_gemm on FP8 block operands runs the Gluon kernel (sm90) and gives the Triton
    kernel's bits, every output dtype; the shapes the Gluon kernel cannot take fall back."""
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import _block_gemm_ws as ws
    from qmoe.kernels import grouped_gemm as gg

    k, n = shape
    a, b = _operands(layout, "cuda", BIG_SPLITS, k, n)
    a_op = gg.activation_operand(a, Scaling.BLOCK)
    b_op, n_out, contraction = gg.weight_operand(b, Scaling.BLOCK, layout == "dgrad")
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        why = ws.unsupported(a_op, b_op, n_out, contraction, out_dtype, a.shape[0], b.num_groups)
        expect_ws = contraction % 128 == 0 and (n_out * torch.finfo(out_dtype).bits // 8) % 16 == 0
        assert (why is None) == expect_ws, why
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = gg.m_grouped_gemm_with(a, b, b_columnwise=layout == "dgrad", out_dtype=out_dtype)
        assert not [w for w in caught if "Gluon" in str(w.message)] and not ws.FAILED, ws.FAILED  # it compiled
        current = _current(a, b, layout, out_dtype)
        assert torch.equal(out, current), (layout, out_dtype, (out.float() - current.float()).abs().max())
        assert (out[sum(BIG_SPLITS):] == 0).all()


@on_gpu
@pytest.mark.gpu
def test_dispatched_block_gemm_is_sync_free_and_graph_capturable():
    """fprop and dgrad through the Gluon kernel: no host sync, and a captured graph replays
    new split sizes (the same total) with the eager bits."""
    from qmoe.ops.grouped_gemm import m_grouped_gemm, quantize_weights
    from qmoe.quant import GroupedTensor
    from qmoe.recipes import Float8BlockScaling

    r = Float8BlockScaling()
    old, new = [300, 0, 450, 77], [0, 520, 100, 207]
    g = torch.Generator(device="cuda").manual_seed(3)
    x, x2 = (torch.randn(sum(old) + PAD, 384, generator=g, device="cuda") for _ in range(2))
    dy = torch.randn(sum(old) + PAD, 256, generator=g, device="cuda")
    w = torch.randn(4, 256, 384, generator=g, device="cuda") / 384 ** 0.5
    xq = GroupedTensor.quantize(x, torch.tensor(old, device="cuda"), r.quantizer("input"), validate=False)
    dyq = GroupedTensor.quantize(dy, torch.tensor(old, device="cuda"), r.quantizer("grad_output"), validate=False)
    wq = quantize_weights(w, r.quantizer("weight"), columnwise=True)

    def step():
        return m_grouped_gemm(xq, wq), m_grouped_gemm(dyq, wq, b_columnwise=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    graph.replay()
    assert all(torch.equal(s_, e) for s_, e in zip(static, eager))
    fresh = GroupedTensor.quantize(x2, torch.tensor(new, device="cuda"), r.quantizer("input"), validate=False)
    for name in ("split_sizes", "offsets", "rowwise_data", "rowwise_scale_inv", "columnwise_data",
                 "columnwise_scale_inv", "rowwise_scale_offsets", "columnwise_scale_offsets"):
        if getattr(xq, name) is not None:
            getattr(xq, name).copy_(getattr(fresh, name))
    graph.replay()
    want = m_grouped_gemm(xq, wq)
    assert torch.equal(static[0], want) and not torch.equal(static[0], eager[0])


@launcher
def test_triton_auto_warp_specialisation_is_refused_on_a_gpu():
    """It deadlocked an H200: never launched on a GPU (the interpreter test runs it on the CPU)."""
    import types

    from qmoe.kernels._block_gemm_tl import launch_block_gemm_tl

    gpu_data = types.SimpleNamespace(is_cuda=True)
    op = types.SimpleNamespace(data=gpu_data, block=(1, 128), stride_k=1)
    with pytest.raises(ValueError, match="deadlocks"):
        launch_block_gemm_tl(op, op, None, 256, 256, 256, 1, ws=True)


@launcher
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


# ---------------------------------------------------------------- the dispatch decision, on the CPU

class _Data:
    """What the dispatch reads of a 2-D tensor (device, strides, pointer), on a pretend GPU."""

    def __init__(self, rows, cols, element_size=1, ptr=1 << 20, device="cuda:0"):
        self.device, self._strides, self._ptr, self._size = torch.device(device), (cols, 1), ptr, element_size

    def dim(self):
        return 2

    def stride(self, i):
        return self._strides[i]

    def data_ptr(self):
        return self._ptr

    def element_size(self):
        return self._size


def _ops(k=512, n=384, groups=4, a_block=(1, 128), b_block=(128, 128), a_ptr=1 << 20, device="cuda:0"):
    from qmoe.kernels.grouped_gemm import _Operand

    a = _Operand(_Data(4096, k, ptr=a_ptr, device=device), k, 1, block=a_block)
    b = _Operand(_Data(groups * n, k, device=device), k, 1, n * k, block=b_block)
    return a, b


@pytest.fixture
def sm90(monkeypatch):
    from qmoe.kernels import _block_gemm_ws as ws

    return pretend_sm90(monkeypatch, ws, "QMOE_BLOCK_GEMM")


@launcher
def test_dispatch_takes_the_gluon_kernel_only_where_it_applies(sm90, monkeypatch):
    from qmoe.kernels import _gluon_sm90

    ws = sm90
    if ws.gluon is None:
        pytest.skip("this triton has no Gluon: test_dispatch_without_gluon covers it")
    bf16 = torch.bfloat16

    def why(a, b, n=384, k=512, out_dtype=bf16, rows=4096, groups=4):
        return ws.unsupported(a, b, n, k, out_dtype, rows, groups)

    assert why(*_ops()) is None
    assert why(*_ops(), out_dtype=torch.float32) is None
    assert "K=200" in why(*_ops(k=200), k=200)  # K % 128
    assert "blocks (1, 32)" in why(*_ops(a_block=(1, 32)))  # not the 1x128 x 128x128 recipe
    assert "aligned" in why(*_ops(), n=388)  # output rows of 776 bytes: no TMA store
    assert "aligned" in why(*_ops(a_ptr=(1 << 20) + 8))
    assert "few rows" in why(*_ops(), rows=384)  # 96 rows per group: the current kernel's small-M tiles
    assert "float8" in why(*_ops(), out_dtype=torch.float8_e4m3fn)
    assert "not a CUDA device" in why(*_ops(device="cpu"))
    monkeypatch.setenv("QMOE_BLOCK_GEMM", "triton")
    assert why(*_ops()) == "QMOE_BLOCK_GEMM=triton"
    monkeypatch.delenv("QMOE_BLOCK_GEMM")
    monkeypatch.setattr(_gluon_sm90, "is_sm90", lambda index: False)  # sm100 and older GPUs
    assert "sm90" in why(*_ops())


@launcher
def test_dispatch_without_gluon(sm90, monkeypatch):
    """A Triton without Gluon (or without its Hopper API): the module imports and refuses."""
    import importlib
    import sys

    from qmoe.kernels import _gluon_sm90

    ws = sm90
    had_gluon = ws.gluon is not None
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon", None)  # `import` of it raises ImportError
    try:
        importlib.reload(_gluon_sm90)
        importlib.reload(ws)
        assert ws.gluon is None
        monkeypatch.setattr(_gluon_sm90, "is_sm90", lambda index: True)
        assert ws.unsupported(*_ops(), 384, 512, torch.bfloat16, 4096, 4) == _gluon_sm90.GLUON_ERROR
        with pytest.raises(RuntimeError, match="gluon"):
            ws.launch_block_gemm_ws(*_ops(), None, 4096, 384, 512, 4)
    finally:
        monkeypatch.undo()
        importlib.reload(_gluon_sm90)
        importlib.reload(ws)
    assert (ws.gluon is not None) == had_gluon


def _launch_m_tiles_on_cpu(monkeypatch, dispatched_result, scaling=None, cfg=None):
    """_launch_m_tiles with the Gluon route's launch replaced: which launches ran."""
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import _block_gemm_ws as ws
    from qmoe.kernels import grouped_gemm as gg

    ran = []
    monkeypatch.setattr(ws, "launch_dispatched",
                        lambda *args: ran.append("gluon") or (args[-1] if dispatched_result else None))

    class _Triton:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: ran.append("triton")

    monkeypatch.setattr(gg, "wrapped", lambda kernel: _Triton())
    a = gg._Operand(torch.zeros(600, 256, dtype=torch.float8_e4m3fn), 256, 1, block=(1, 128))
    b = gg._Operand(torch.zeros(4 * 256, 256, dtype=torch.float8_e4m3fn), 256, 1, 256 * 256, block=(128, 128))
    offsets = torch.tensor([0, 100, 300, 500, 600])
    out = gg._launch_m_tiles(a, b, offsets, 600, 256, 256, 4, scaling or Scaling.BLOCK, torch.bfloat16, cfg)
    assert out.shape == (600, 256)
    return ran


@launcher
def test_block_m_launch_falls_back_to_the_triton_kernel(monkeypatch):
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import grouped_gemm as gg

    assert _launch_m_tiles_on_cpu(monkeypatch, True) == ["gluon"]
    assert _launch_m_tiles_on_cpu(monkeypatch, False) == ["gluon", "triton"]  # unsupported, or its compile failed
    assert _launch_m_tiles_on_cpu(monkeypatch, True, scaling=Scaling.TENSOR) == ["triton"]
    cfg = gg.tile_configs(Scaling.BLOCK, small_m=False)[0]
    assert _launch_m_tiles_on_cpu(monkeypatch, True, cfg=cfg) == ["triton"]  # tile sweeps pick their kernel


@launcher
def test_unsupported_calls_launch_nothing(sm90, monkeypatch):
    ws = sm90
    calls = []
    monkeypatch.setattr(ws, "launch_block_gemm_ws", lambda *args, **kwargs: calls.append(kwargs) or "launched")
    a, b = _ops()
    assert ws.launch_dispatched(a, b, None, 4096, 384, 512, 4, torch.bfloat16, None) == "launched"
    a200, b200 = _ops(k=200)
    assert ws.launch_dispatched(a200, b200, None, 4096, 384, 200, 4, torch.bfloat16, None) is None
    assert ws.launch_dispatched(*_ops(device="cpu"), None, 4096, 384, 512, 4, torch.bfloat16, None) is None
    assert len(calls) == 1 and calls[0]["pipe"] == ws.DISPATCH["pipe"] and calls[0]["b_columnwise"] is False
    from qmoe.kernels.grouped_gemm import _Operand  # dgrad: the weights' columnwise copy [K, E*N]

    b_t = _Operand(_Data(384, 4 * 512), 4 * 512, 1, 512, block=(128, 128))
    assert ws.launch_dispatched(_ops(k=512)[0], b_t, None, 4096, 384, 512, 4, torch.bfloat16, None) == "launched"
    assert calls[1]["b_columnwise"] is True
    # an output of a multiple of 256 columns takes the wide tiles
    assert ws.launch_dispatched(a, b, None, 4096, 512, 512, 4, torch.bfloat16, None) == "launched"
    assert calls[2]["bn"] == 256 and calls[2]["pipe"] == ws.DISPATCH_WIDE["pipe"] == 3
    assert calls[0]["bn"] == 128
    # bf16 results: the ping-pong with two result buffers per consumer; fp32 ones keep one buffer,
    # as two fp32 buffers would leave room for two stages only
    assert (calls[2]["c_bufs"], calls[2]["stages"]) == (2, 3)
    assert ws.launch_dispatched(a, b, None, 4096, 512, 512, 4, torch.float32, None) == "launched"
    assert (calls[3]["bn"], calls[3]["pipe"], calls[3]["c_bufs"], calls[3]["stages"]) == (256, 3, 1, 3)
    assert ws.fit_stages(3, 128, 256, torch.float32, 2) == 2
    # the activation scales go by TMA where a row's scales span a cache line (K >= 4096)
    assert not any(c["scales_tma"] for c in calls)  # K = 512 above
    a4k, b4k = _ops(k=4096)
    for n_out, out_dtype, stages in ((512, torch.bfloat16, 3), (384, torch.bfloat16, 5), (512, torch.float32, 3)):
        assert ws.launch_dispatched(a4k, b4k, None, 4096, n_out, 4096, 4, out_dtype, None) == "launched"
        assert calls[-1]["scales_tma"] is True and calls[-1]["stages"] == stages, calls[-1]
    # and at any K where the cast stored them steps-major: a per-step load would wait on L2 each step
    from qmoe.kernels._layout import steps_major

    a.scale = steps_major(4096, 4, torch.float32, "cpu")
    assert ws.launch_dispatched(a, b, None, 4096, 512, 512, 4, torch.bfloat16, None) == "launched"
    assert calls[-1]["scales_tma"] is True and calls[-1]["stages"] == 3, calls[-1]
    a.scale = torch.empty(4096, 4)  # row-major: a row's scales share a line across the tile's steps
    assert ws.launch_dispatched(a, b, None, 4096, 512, 512, 4, torch.bfloat16, None) == "launched"
    assert calls[-1]["scales_tma"] is False


@launcher
def test_a_gluon_compile_failure_warns_once_and_falls_back(sm90, monkeypatch):
    a, b = _ops()
    assert_a_compile_failure_falls_back_once(
        monkeypatch, sm90, "launch_block_gemm_ws",
        lambda: sm90.launch_dispatched(a, b, None, 4096, 384, 512, 4, torch.bfloat16, None), None)


@launcher
def test_result_buffers_and_stages_fit_shared_memory():
    from qmoe.kernels._block_gemm_ws import fit_stages
    from qmoe.kernels._gluon_sm90 import SMEM_BYTES

    assert fit_stages(6, 128, 128, torch.bfloat16) == 6  # 6 x 32 KiB stages + 32 KiB of results
    assert fit_stages(6, 128, 128, torch.float32) == 5  # fp32 results take 64 KiB
    assert fit_stages(5, 128, 256, torch.bfloat16) == 4 and fit_stages(4, 128, 256, torch.bfloat16, 2) == 3
    assert fit_stages(6, 128, 128, torch.bfloat16, scales_tma=True) == 5  # a 512-byte scale row per stage
    assert fit_stages(3, 128, 256, torch.bfloat16, 2, scales_tma=True) == 3  # the dispatched wide tiles
    for bn in (128, 256):
        for scales_tma in (False, True):
            s = fit_stages(8, 128, bn, torch.float32, scales_tma=scales_tma)
            assert s * ((128 + bn) * 128 + 512 * scales_tma) + 2 * 64 * 128 * 4 <= SMEM_BYTES
