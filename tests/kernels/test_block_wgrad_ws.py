"""The FP8 block wgrad kernel in Gluon (qmoe/kernels/_block_wgrad_ws.py) gives the Triton
k-grouped kernel's bits: groups of uneven sizes with partial last 128-token steps (on and off a
16-token boundary), an empty group, a group shorter than one step, output sizes that are not
tile multiples, every output dtype, accumulation into `out`; and k_grouped_gemm dispatches it
exactly where it applies. Gluon has no interpreter: the kernel runs on the GPU only; the
dispatch decision is checked on the CPU.
"""
import types
import warnings

import pytest
import torch

from qmoe.contracts.scales import gemm_scale

from tests.kernels.gluon import assert_a_compile_failure_falls_back_once, pretend_sm90, wgrad_operands
from tests.kernels.interpret import INTERPRETING

on_gpu = pytest.mark.skipif(INTERPRETING, reason="the GPU tests do not run under the interpreter")
# token groups: an empty one, one shorter than a step, last steps ending mid-step, groups starting
# off a 16-token boundary (the kernel's scalar tail loads; aligned starts take vector loads)
SPLITS = [300, 0, 96, 517, 256, 45]


def _operands(splits, n, k, seed=5, nan_at=()):
    """Block-scaled wgrad operands (a NaN token: its block's codes and scale carry it into its own
    group only)."""
    from qmoe.recipes import Float8BlockScaling

    return wgrad_operands(Float8BlockScaling(), splits, n, k, seed, nan_at)


def _triton(dyq, xq, **kw):
    """The Triton kernel (a tile config bypasses the Gluon dispatch)."""
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import grouped_gemm as gg

    return gg.k_grouped_gemm_with(dyq, xq, config=gg.k_tile_config(Scaling.BLOCK), **kw)


def _wide(pipe=3):
    """The 128 x 256 tiles' configuration (the dispatched one where the output's columns allow)."""
    from qmoe.kernels import _block_wgrad_ws as wg

    return dict(wg.DISPATCH_WIDE, pipe=pipe)


def _gluon(dyq, xq, out, accumulate=False, **kw):
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import _block_wgrad_ws as wg
    from qmoe.kernels import grouped_gemm as gg

    a, b = gg.tokens_operand(dyq, Scaling.BLOCK), gg.tokens_operand(xq, Scaling.BLOCK)
    assert wg.unsupported(a, b, out) is None, wg.unsupported(a, b, out)
    kw.setdefault("stages", wg.fit_stages(4, out.dtype, wg._tma_out(out, out.shape[1], out.shape[2], accumulate),
                                          kw.get("bn", 128)))
    return wg.launch_block_wgrad_ws(a, b, dyq.offsets, out.shape[1], out.shape[2], dyq.num_groups, out, accumulate,
                                    **kw)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(256, 384), (202, 330), (128, 1024)], ids=["n256-k384", "n202-k330", "n128-k1024"])
@pytest.mark.parametrize("splits", [[320, 0, 96, 528, 256, 48], SPLITS, [128, 8, 0, 200]],
                         ids=["starts-on-16", "uneven", "off-16"])
def test_gluon_wgrad_gives_the_triton_kernels_bits(splits, n, k):
    from qmoe.reference import grouped_gemm as reference

    dyq, xq = _operands(splits, n, k)
    oracle = reference.k_grouped_gemm(dyq, xq, out_dtype=torch.float32)
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        want = _triton(dyq, xq, out_dtype=out_dtype)
        every = [dict(pipe=pipe, tail=tail, scales_tma=scales_tma) for pipe in (0, 1) for tail in ("loads", "desc")
                 for scales_tma in (0, 1)] + [_wide(3), _wide(0)]
        # each configuration is a compile per shape: the other output dtypes take the dispatched ones and another
        others = [dict(pipe=0, tail="desc", scales_tma=1), dict(pipe=0, tail="loads", scales_tma=0), _wide()]
        for cfg in every if out_dtype == torch.bfloat16 else others:
            out = torch.full((len(splits), n, k), float("nan"), dtype=out_dtype, device="cuda")
            got = _gluon(dyq, xq, out, programs=5, **cfg)
            assert torch.equal(got, want), (out_dtype, cfg, (got.float() - want.float()).abs().max())
        assert (want[1 if splits[1] == 0 else 2] == 0).all()  # the empty group writes zeros
    rel = (want.float() - oracle).norm() / oracle.norm()
    assert rel <= 1e-3, rel  # fp32 output against the reference (NUMERICS.md)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_group_descriptors_survive_a_new_group_every_tile(programs):
    """Many short groups, few programs: each program makes a new pair of group descriptors at
    almost every tile while loads through the older pairs may still be in flight. A NaN in a
    group's first token must stay in that group: the partial step before it reads zeros there."""
    g = torch.Generator().manual_seed(programs)
    splits = [int(v) * 16 for v in torch.randint(0, 24, (40,), generator=g)]
    splits[5] = 0
    splits[6:8] = [176, 208]  # NaN tokens open groups 7 and 20, after groups ending mid-step
    splits[19:21] = [80, 96]
    dyq, xq = _operands(splits, 256, 128, seed=programs, nan_at=[sum(splits[:i]) for i in (7, 20)])
    want = _triton(dyq, xq, out_dtype=torch.float32)
    for cfg in (dict(tail="desc", scales_tma=False), dict(tail="desc", scales_tma=True), _wide()):
        out = torch.full((len(splits), 256, 128), float("nan"), device="cuda")
        got = _gluon(dyq, xq, out, programs=programs, **cfg)
        assert torch.equal(got.isnan(), want.isnan()), cfg
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), cfg
    assert want[6].isfinite().all() and want[19].isfinite().all() and want[7].isnan().any() and want[20].isnan().any()


@on_gpu
@pytest.mark.gpu
def test_gluon_wgrad_accumulates_like_the_triton_kernel():
    dyq, xq = _operands(SPLITS, 256, 384, seed=9)
    start = torch.randn(len(SPLITS), 256, 384, device="cuda")
    want = _triton(dyq, xq, out=start.clone(), accumulate=True)
    configs = [dict(tail=tail, scales_tma=scales_tma) for tail in ("loads", "desc") for scales_tma in (False, True)]
    for cfg in configs + [_wide()]:
        got = _gluon(dyq, xq, start.clone(), accumulate=True, **cfg)
        assert torch.equal(got, want), cfg
    strided = torch.randn(len(SPLITS), 256, 512, device="cuda")[:, :, :384]  # rows not contiguous: masked stores
    want = _triton(dyq, xq, out=strided.clone(), accumulate=True)
    for cfg in ({}, _wide()):
        got = _gluon(dyq, xq, strided.clone(), accumulate=True, **cfg)
        assert torch.equal(got, want), cfg


@on_gpu
@pytest.mark.gpu
def test_k_grouped_gemm_dispatches_the_gluon_kernel_sync_free_and_capturable():
    """The public k_grouped_gemm runs the Gluon kernel (it compiles, no fallback warning), gives
    the Triton kernel's bits, syncs nothing with the host and replays new split sizes in a graph."""
    from qmoe.kernels import _block_wgrad_ws as wg
    from qmoe.ops.grouped_gemm import k_grouped_gemm

    dyq, xq = _operands(SPLITS, 256, 384)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = k_grouped_gemm(dyq, xq)
    assert not [w for w in caught if "Gluon" in str(w.message)] and not wg.FAILED, wg.FAILED
    assert torch.equal(eager, _triton(dyq, xq))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        k_grouped_gemm(dyq, xq)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        k_grouped_gemm(dyq, xq)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        static = k_grouped_gemm(dyq, xq)
    graph.replay()
    assert torch.equal(static, eager)
    new_splits = [0, 640, 100, 33, 300, 141]  # the same total
    fresh_dy, fresh_x = _operands(new_splits, 256, 384, seed=11)
    for old, new in ((dyq, fresh_dy), (xq, fresh_x)):
        for name in ("split_sizes", "offsets", "columnwise_data", "columnwise_scale_offsets"):
            getattr(old, name).copy_(getattr(new, name))
        gemm_scale(old, True).copy_(gemm_scale(new, True))  # the scales the GEMM reads, as stored
    graph.replay()
    assert torch.equal(static, _triton(fresh_dy, fresh_x))


# ---------------------------------------------------------------- the dispatch decision, on the CPU

def _op(rows=256, tokens=1024, block=(1, 128), soffs=True, stride_k=1, ptr=1 << 20, device="cuda:0"):
    data = types.SimpleNamespace(device=torch.device(device), dim=lambda: 2, stride=lambda i: (tokens, 1)[i],
                                 data_ptr=lambda: ptr, element_size=lambda: 1)
    return types.SimpleNamespace(data=data, block=block, soffs=object() if soffs else None, stride_k=stride_k,
                                 stride_r=tokens)


@pytest.fixture
def sm90(monkeypatch):
    from qmoe.kernels import _block_wgrad_ws as wg

    if wg.gluon is None:
        pytest.skip("this triton has no Gluon")
    return pretend_sm90(monkeypatch, wg, "QMOE_BLOCK_GEMM")


def test_wgrad_dispatch_takes_the_gluon_kernel_only_where_it_applies(sm90, monkeypatch):
    from qmoe.kernels import _gluon_sm90

    wg = sm90
    out = torch.empty(4, 256, 384, dtype=torch.bfloat16)
    assert wg.unsupported(_op(), _op(), out) is None
    assert wg.unsupported(_op(), _op(), out.float()) is None
    assert "blocks (1, 32)" in wg.unsupported(_op(block=(1, 32)), _op(), out)  # MXFP8 blocks
    assert "scale offsets" in wg.unsupported(_op(soffs=False), _op(), out)
    assert "aligned" in wg.unsupported(_op(), _op(tokens=1000), out)  # rows of 1000 bytes: no TMA
    assert "aligned" in wg.unsupported(_op(ptr=(1 << 20) + 8), _op(), out)
    assert "contiguous" in wg.unsupported(_op(stride_k=2), _op(), out)
    assert "float8" in wg.unsupported(_op(), _op(), out.to(torch.float8_e4m3fn))
    assert "strides" in wg.unsupported(_op(), _op(), out.transpose(1, 2))
    assert "not a CUDA device" in wg.unsupported(_op(device="cpu"), _op(device="cpu"), out)
    monkeypatch.setenv("QMOE_BLOCK_GEMM", "triton")
    assert wg.unsupported(_op(), _op(), out) == "QMOE_BLOCK_GEMM=triton"
    monkeypatch.delenv("QMOE_BLOCK_GEMM")
    monkeypatch.setattr(_gluon_sm90, "is_sm90", lambda index: False)
    assert "sm90" in wg.unsupported(_op(), _op(), out)


def test_wgrad_dispatch_takes_wide_tiles_where_the_columns_allow(sm90, monkeypatch):
    """128 x 256 tiles where the output's K is a multiple of 256, else 128 x 128; the stages fit in
    shared memory either way, for every output dtype."""
    wg = sm90
    taken = []
    monkeypatch.setattr(wg, "launch_block_wgrad_ws", lambda *args, **cfg: taken.append(cfg) or args[6])
    for k, bn in ((512, 256), (7168, 256), (384, 128), (2304, 256), (330, 128)):
        for dtype in (torch.bfloat16, torch.float32):
            out = torch.empty(2, 256, k, dtype=dtype)
            assert wg.launch_dispatched(_op(), _op(), None, 256, k, 2, out, False) is out
            cfg = taken.pop()
            assert cfg["bn"] == bn, (k, cfg)
            smem = wg._smem(cfg["stages"], dtype, wg._tma_out(out, 256, k, False), bn)
            assert smem <= wg.sm90.SMEM_BYTES - wg.sm90.SMEM_SPARE, (k, dtype, cfg)
            # wide tiles keep their 3 stages whatever the output dtype: the results share the tail buffers
            assert cfg["stages"] == 3 if bn == 256 else cfg["stages"] >= 3, (k, dtype, cfg)


def test_a_failed_compile_falls_back_to_the_triton_kernel_with_one_warning(sm90, monkeypatch):
    out = torch.empty(4, 256, 384, dtype=torch.bfloat16)
    assert_a_compile_failure_falls_back_once(
        monkeypatch, sm90, "launch_block_wgrad_ws",
        lambda: sm90.launch_dispatched(_op(), _op(), None, 256, 384, 4, out, False), None)


def test_the_triton_wgrad_runs_where_the_gluon_one_declines(monkeypatch):
    """_launch_k_into asks the Gluon route first for BLOCK scaling (no tile config) and launches
    the Triton kernel only when it declines; other scalings and explicit tiles never ask."""
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import _block_wgrad_ws as wg
    from qmoe.kernels import grouped_gemm as gg

    for gluon_result, scaling, cfg, expect in ((True, Scaling.BLOCK, None, ["gluon"]),
                                               (False, Scaling.BLOCK, None, ["gluon", "triton"]),
                                               (True, Scaling.BLOCK, gg.k_tile_config(Scaling.BLOCK), ["triton"]),
                                               (True, Scaling.TENSOR, None, ["triton"])):
        ran = []
        monkeypatch.setattr(wg, "launch_dispatched",
                            lambda *args, r=gluon_result: ran.append("gluon") or (args[6] if r else None))

        class _Triton:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: ran.append("triton")

        monkeypatch.setattr(gg, "wrapped", lambda kernel: _Triton())
        a = gg._Operand(torch.zeros(256, 512, dtype=torch.float8_e4m3fn), 512, 1, block=(1, 128))
        b = gg._Operand(torch.zeros(384, 512, dtype=torch.float8_e4m3fn), 512, 1, block=(1, 128))
        out = torch.empty(4, 256, 384)
        gg._launch_k_into(a, b, torch.tensor([0, 100, 300, 400, 512]), 256, 384, 4, scaling, out, False, cfg)
        assert ran == expect, (gluon_result, scaling, cfg, ran)


def test_the_scratch_allocator_serves_one_launch_and_leaves_the_callers_alone():
    """The group descriptors live in Triton's global scratch: with_scratch gives the launch an
    allocator of torch memory on the operands' device, and the caller's allocator (none here, or
    the user's own) is the same afterwards."""
    pytest.importorskip("triton.runtime._allocation")
    from triton.runtime import _allocation

    from qmoe.kernels import _gluon_sm90

    def launch():  # what Triton's launcher does for a kernel with global scratch
        return _allocation._allocator.get()(512 * 3, 128, None)

    before = _allocation._allocator.get()
    got = _gluon_sm90.with_scratch(torch.device("cpu"), launch)
    assert got.device.type == "cpu" and got.numel() * got.element_size() == 512 * 3
    assert _allocation._allocator.get() is before
    with pytest.raises(RuntimeError, match="no allocator was set"):
        launch()  # outside, Triton's own default stays
