"""The FP8 tensor-scaled Gluon GEMMs (qmoe/kernels/_tensor_gemm_ws.py) give the Triton kernels'
bits: m-grouped fprop and dgrad (E5M2 gradients times E4M3 weights) over uneven groups with an
empty one, group ends inside 128-row tiles and rows past the last group; k-grouped wgrad over
groups with partial last steps, starting on and off 16 tokens, an empty group, outputs whose rows
are not a tile multiple, accumulation into `out`. The public GEMMs dispatch them, sync-free and
graph-capturable. Gluon has no interpreter: the kernels run on the GPU only; the dispatch
decisions are checked on the CPU.
"""
import types
import warnings

import pytest
import torch

from tests.kernels.gluon import assert_a_compile_failure_falls_back_once, grouped_operands, pretend_sm90, wgrad_operands
from tests.kernels.interpret import INTERPRETING

on_gpu = pytest.mark.skipif(INTERPRETING, reason="the GPU tests do not run under the interpreter")
M_SPLITS = [300, 0, 450, 77]  # an empty expert, group ends inside 128-row tiles
PAD = 9  # rows past the last group: zeros
K_SPLITS = {"starts-on-16": [320, 0, 96, 528, 256, 48], "uneven": [300, 0, 96, 517, 256, 45],
            "off-16": [128, 8, 0, 200]}


def _recipes():
    from qmoe.recipes import DelayedScaling, Float8CurrentScaling

    return {"current": Float8CurrentScaling(), "delayed": DelayedScaling()}


def _m_triton(a, b, layout, out_dtype):
    """The Triton kernel with its default tiles (a config bypasses the Gluon dispatch)."""
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import grouped_gemm as gg

    cfg = gg.tile_configs(Scaling.TENSOR, small_m=False)[0]
    return gg.m_grouped_gemm_with(a, b, b_columnwise=layout == "dgrad", out_dtype=out_dtype, config=cfg)


def _m_gluon(a, b, layout, out_dtype, **kw):
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import _tensor_gemm_ws as tw
    from qmoe.kernels import grouped_gemm as gg

    columnwise = layout == "dgrad"
    a_op = gg.activation_operand(a, Scaling.TENSOR)
    b_op, n_out, k = gg.weight_operand(b, Scaling.TENSOR, columnwise)
    out = torch.full((a.shape[0], n_out), float("nan"), dtype=out_dtype, device="cuda")
    return tw.launch_tensor_gemm_ws(a_op, b_op, a.offsets, a.shape[0], n_out, k, b.num_groups, out_dtype, out=out,
                                    b_columnwise=columnwise, **kw)


def _same_bits(got, want):
    return torch.equal(got.view(torch.int16), want.view(torch.int16))


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["current", "delayed"])
@pytest.mark.parametrize("layout", ["fprop", "dgrad"])
def test_gluon_m_grouped_gives_the_triton_kernels_bits(recipe, layout):
    from qmoe.reference import grouped_gemm as reference

    a, b = grouped_operands(_recipes()[recipe], layout, 512, 768, "cuda", M_SPLITS, PAD, seed=3)
    for out_dtype in (torch.bfloat16, torch.float16):
        want = _m_triton(a, b, layout, out_dtype)
        for cfg in (dict(bn=256, stages=3), dict(bn=128, stages=4), dict(bn=256, stages=2, group_m=1),
                    dict(bn=256, stages=4, tma_store=False)):
            for programs in (3, 132):
                got = _m_gluon(a, b, layout, out_dtype, programs=programs, **cfg)
                assert _same_bits(got, want), (out_dtype, cfg, programs, (got.float() - want.float()).abs().max())
        assert (want[sum(M_SPLITS):] == 0).all()  # rows past the last group
    oracle = reference.m_grouped_gemm(a, b, b_columnwise=layout == "dgrad", out_dtype=torch.float32)
    rel = (want.float() - oracle).norm() / oracle.norm()
    assert rel <= 1e-2, rel  # 16-bit output against the reference (NUMERICS.md)



@on_gpu
@pytest.mark.gpu
def test_gluon_m_grouped_reads_zeros_past_a_contraction_off_the_step():
    """K = 400: the last 128-deep step runs past K, where TMA reads zeros as the Triton kernel's masks do."""
    a, b = grouped_operands(_recipes()["current"], "fprop", 400, 512, "cuda", M_SPLITS, PAD, seed=6)
    want = _m_triton(a, b, "fprop", torch.bfloat16)
    assert _same_bits(_m_gluon(a, b, "fprop", torch.bfloat16, programs=11), want)

def _k_triton(dyq, xq, **kw):
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import grouped_gemm as gg

    return gg.k_grouped_gemm_with(dyq, xq, config=gg.k_tile_config(Scaling.TENSOR), **kw)


def _k_gluon(dyq, xq, out, accumulate=False, **kw):
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import _tensor_gemm_ws as tw
    from qmoe.kernels import grouped_gemm as gg

    a, b = gg.tokens_operand(dyq, Scaling.TENSOR), gg.tokens_operand(xq, Scaling.TENSOR)
    assert tw.unsupported_k(a, b, out, accumulate) is None, tw.unsupported_k(a, b, out, accumulate)
    return tw.launch_tensor_wgrad_ws(a, b, dyq.offsets, out.shape[1], out.shape[2], dyq.num_groups, out, accumulate,
                                     **kw)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["current", "delayed"])
@pytest.mark.parametrize("n,k", [(256, 512), (202, 768)], ids=["n256-k512", "n202-k768"])
@pytest.mark.parametrize("splits", list(K_SPLITS.values()), ids=list(K_SPLITS))
def test_gluon_wgrad_gives_the_triton_kernels_bits(recipe, splits, n, k):
    from qmoe.reference import grouped_gemm as reference

    dyq, xq = wgrad_operands(_recipes()[recipe], splits, n, k)
    for out_dtype in (torch.bfloat16, torch.float16):
        want = _k_triton(dyq, xq, out_dtype=out_dtype)
        for cfg in (dict(programs=5), dict(programs=132), dict(programs=1, stages=2, group_m=1)):
            out = torch.full((len(splits), n, k), float("nan"), dtype=out_dtype, device="cuda")
            got = _k_gluon(dyq, xq, out, **cfg)
            assert _same_bits(got, want), (out_dtype, cfg, (got.float() - want.float()).abs().max())
        assert (want[splits.index(0)] == 0).all()  # the empty group writes zeros
    oracle = reference.k_grouped_gemm(dyq, xq, out_dtype=torch.float32)
    rel = (want.float() - oracle).norm() / oracle.norm()
    assert rel <= 1e-2, rel  # 16-bit output against the reference (NUMERICS.md)


def _with_leads(op, offsets, lead):
    """The operand's tokens laid out again as the wgrad with `lead` reads them: each group on 16
    tokens gets its zeros before its first token (up to the lead boundary) and after its last (up to
    a multiple of 16), so the Triton kernel's steps from the group's new start fall where the Gluon
    kernel's do. Returns the operand and the new group offsets."""
    from dataclasses import replace

    codes, parts, starts = op.data.view(torch.uint8), [], [0]
    for start, end in zip(offsets[:-1], offsets[1:]):
        zeros = start % lead if start % 16 == 0 and end > start else 0  # an empty group has no steps
        after = -(zeros + end - start) % 16
        parts += [codes.new_zeros(codes.shape[0], zeros), codes[:, start:end], codes.new_zeros(codes.shape[0], after)]
        starts.append(starts[-1] + zeros + end - start + after)
    data = torch.cat(parts, dim=1).view(op.data.dtype)
    return replace(op, data=data, stride_r=data.stride(0)), torch.tensor(starts, device=data.device)


def _k_triton_with_leads(dyq, xq, lead):
    """The Triton kernel's wgrad over the steps the Gluon kernel takes with `lead` (bf16)."""
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import grouped_gemm as gg

    offsets = dyq.offsets.tolist()
    a, offsets2 = _with_leads(gg.tokens_operand(dyq, Scaling.TENSOR), offsets, lead)
    b, _ = _with_leads(gg.tokens_operand(xq, Scaling.TENSOR), offsets, lead)
    n, k, groups = dyq.shape[1], xq.shape[1], dyq.num_groups
    out = torch.empty(groups, n, k, dtype=torch.bfloat16, device="cuda")
    return gg._launch_k_into(a, b, offsets2, n, k, groups, Scaling.TENSOR, out, False, gg.k_tile_config(Scaling.TENSOR))


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("lead", [32, 64, 128])
@pytest.mark.parametrize("splits", list(K_SPLITS.values()), ids=list(K_SPLITS))
def test_gluon_wgrad_with_a_lead_sums_the_steps_where_they_fall(splits, lead):
    """With `lead`, a group's steps start at the lead boundary before its first token: the Triton
    kernel's bits over the same steps (the tokens laid out with those zeros), and within NUMERICS.md
    of the reference. starts-on-16's empty group lies 64 tokens past a 128-token boundary."""
    from qmoe.reference import grouped_gemm as reference

    n, k = 202, 768
    dyq, xq = wgrad_operands(_recipes()["current"], splits, n, k, seed=3)
    want = _k_triton_with_leads(dyq, xq, lead)
    for cfg in (dict(programs=7), dict(programs=132), dict(programs=1, stages=2, group_m=1)):
        out = torch.full((len(splits), n, k), float("nan"), dtype=torch.bfloat16, device="cuda")
        got = _k_gluon(dyq, xq, out, lead=lead, **cfg)
        assert _same_bits(got, want), (cfg, (got.float() - want.float()).abs().max())
    assert (got[splits.index(0)] == 0).all()  # the empty group writes zeros
    oracle = reference.k_grouped_gemm(dyq, xq, out_dtype=torch.float32)
    rel = (got.float() - oracle).norm() / oracle.norm()
    assert rel <= 1e-2, rel  # 16-bit output against the reference (NUMERICS.md)


@on_gpu
@pytest.mark.gpu
def test_gluon_wgrad_lead_reads_zeros_not_the_previous_group():
    """The tokens a lead reaches back over belong to the previous group: a NaN in its last token
    stays in that group's weight gradient."""
    splits = K_SPLITS["starts-on-16"]  # group 4 starts at token 944, 16 past a 32-boundary
    dyq, xq = wgrad_operands(_recipes()["current"], splits, 256, 512, nan_at=(943,))
    for lead in (32, 128):
        out = torch.full((len(splits), 256, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        got = _k_gluon(dyq, xq, out, lead=lead)
        assert got[3, 0].isnan().all() and not got[3, 1:].isnan().any()
        assert torch.isfinite(got[[0, 1, 2, 4, 5]]).all(), lead


@on_gpu
@pytest.mark.gpu
def test_gluon_wgrad_accumulates_like_the_triton_kernel():
    dyq, xq = wgrad_operands(_recipes()["current"], K_SPLITS["uneven"], 256, 512, seed=9)
    start = torch.randn(len(K_SPLITS["uneven"]), 256, 512, device="cuda").bfloat16()
    want = _k_triton(dyq, xq, out=start.clone(), accumulate=True)
    assert _same_bits(_k_gluon(dyq, xq, start.clone(), accumulate=True), want)
    strided = torch.randn(len(K_SPLITS["uneven"]), 256, 768, device="cuda").bfloat16()[:, :, :512]  # masked stores
    want = _k_triton(dyq, xq, out=strided.clone(), accumulate=True)
    assert _same_bits(_k_gluon(dyq, xq, strided.clone(), accumulate=True), want)


def _capture(fn):
    """fn() replayed in a CUDA graph (after a warm-up on a side stream): (graph, its output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    graph.replay()
    return graph, static


@on_gpu
@pytest.mark.gpu
def test_public_gemms_dispatch_the_gluon_kernels_sync_free_and_capturable(monkeypatch):
    """m_grouped_gemm and k_grouped_gemm under current scaling run the Gluon kernels (each
    launched once, no fallback warning), give the Triton kernels' bits (the wgrad's over the steps
    its dispatched lead takes), sync nothing with the host, and replay in a CUDA graph."""
    from qmoe.kernels import _tensor_gemm_ws as tw
    from qmoe.ops.grouped_gemm import k_grouped_gemm, m_grouped_gemm

    launched = []
    for name in ("launch_tensor_gemm_ws", "launch_tensor_wgrad_ws"):
        real = getattr(tw, name)
        monkeypatch.setattr(tw, name, lambda *args, _real=real, _name=name, **kw: launched.append(_name)
                            or _real(*args, **kw))
    recipe = _recipes()["current"]
    a, b = grouped_operands(recipe, "fprop", 512, 768, "cuda", M_SPLITS, PAD, seed=4)
    dyq, xq = wgrad_operands(recipe, K_SPLITS["starts-on-16"], 256, 512)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fprop, wgrad = m_grouped_gemm(a, b), k_grouped_gemm(dyq, xq)
    assert not [w for w in caught if "Gluon" in str(w.message)] and not tw.FAILED, tw.FAILED
    assert launched == ["launch_tensor_gemm_ws", "launch_tensor_wgrad_ws"], launched
    assert _same_bits(fprop, _m_triton(a, b, "fprop", torch.bfloat16))
    assert _same_bits(wgrad, _k_triton_with_leads(dyq, xq, tw.DISPATCH_K["lead"]))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m_grouped_gemm(a, b)
        k_grouped_gemm(dyq, xq)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for fn, eager in ((lambda: m_grouped_gemm(a, b), fprop), (lambda: k_grouped_gemm(dyq, xq), wgrad)):
        _, static = _capture(fn)
        assert _same_bits(static, eager)


# ---------------------------------------------------------------- the dispatch decisions, on the CPU

def _op(rows=256, cols=1024, dtype=torch.float8_e4m3fn, factor=True, stride_k=1, ptr=1 << 20, device="cuda:0"):
    data = types.SimpleNamespace(device=torch.device(device), dim=lambda: 2, stride=lambda i: (cols, 1)[i],
                                 data_ptr=lambda: ptr, element_size=lambda: 1, dtype=dtype, shape=(rows, cols))
    return types.SimpleNamespace(data=data, factor=object() if factor else None, stride_k=stride_k, stride_r=cols,
                                 group_stride=0)


@pytest.fixture
def sm90(monkeypatch):
    from qmoe.kernels import _tensor_gemm_ws as tw

    if tw.gluon is None:
        pytest.skip("this triton has no Gluon")
    return pretend_sm90(monkeypatch, tw, "QMOE_TENSOR_GEMM")


def test_m_dispatch_takes_the_gluon_kernel_only_where_it_applies(sm90, monkeypatch):
    from qmoe.kernels import _gluon_sm90

    tw = sm90
    why = tw.unsupported_m
    assert why(_op(), _op(), 512, 1024, torch.bfloat16, 4096, 8) is None
    assert why(_op(), _op(dtype=torch.float8_e5m2), 512, 1024, torch.float16, 4096, 8) is None
    assert "float32" in why(_op(), _op(), 512, 1024, torch.float32, 4096, 8)  # the Triton kernel promotes
    assert "bfloat16 x" in why(_op(dtype=torch.bfloat16), _op(), 512, 1024, torch.bfloat16, 4096, 8)
    assert "operands" in why(_op(factor=False), _op(), 512, 1024, torch.bfloat16, 4096, 8)
    assert "N=384" in why(_op(), _op(), 384, 1024, torch.bfloat16, 4096, 8)
    assert "few rows" in why(_op(), _op(), 512, 1024, torch.bfloat16, 96 * 8, 8)
    assert why(_op(), _op(), 512, 1024, torch.bfloat16, tw.TRITON_ROWS_PER_GROUP * 8 - 1, 8) is None
    assert "rows per group or more" in why(_op(), _op(), 512, 1024, torch.bfloat16, tw.TRITON_ROWS_PER_GROUP * 8, 8)
    assert "aligned" in why(_op(cols=1000), _op(), 512, 1000, torch.bfloat16, 4096, 8)
    assert "contiguous" in why(_op(stride_k=2), _op(), 512, 1024, torch.bfloat16, 4096, 8)
    assert "not a CUDA device" in why(_op(device="cpu"), _op(device="cpu"), 512, 1024, torch.bfloat16, 4096, 8)
    monkeypatch.setenv("QMOE_TENSOR_GEMM", "triton")
    assert why(_op(), _op(), 512, 1024, torch.bfloat16, 4096, 8) == "QMOE_TENSOR_GEMM=triton"
    monkeypatch.delenv("QMOE_TENSOR_GEMM")
    monkeypatch.setattr(_gluon_sm90, "is_sm90", lambda index: False)
    assert "sm90" in why(_op(), _op(), 512, 1024, torch.bfloat16, 4096, 8)


def test_k_dispatch_takes_the_gluon_kernel_only_where_it_applies(sm90):
    tw = sm90
    out = torch.empty(4, 256, 512, dtype=torch.bfloat16)
    assert tw.unsupported_k(_op(), _op(), out, False) is None
    assert tw.unsupported_k(_op(), _op(), out, True) is None
    assert "float32" in tw.unsupported_k(_op(), _op(), out.float(), False)
    assert "K=384" in tw.unsupported_k(_op(), _op(), torch.empty(4, 256, 384, dtype=torch.bfloat16), False)
    assert "strides" in tw.unsupported_k(_op(), _op(), out.transpose(1, 2), False)
    assert "bfloat16 x" in tw.unsupported_k(_op(dtype=torch.bfloat16), _op(), out, False)
    assert "aligned" in tw.unsupported_k(_op(), _op(cols=1000), out, False)


def test_wgrad_takes_only_the_leads_it_knows():
    from qmoe.kernels import _tensor_gemm_ws as tw

    out = torch.empty(4, 256, 512, dtype=torch.bfloat16)
    for lead in (0, 8, 48, 256):
        with pytest.raises(ValueError, match=f"lead={lead}"):
            tw.launch_tensor_wgrad_ws(_op(), _op(), None, 256, 512, 4, out, lead=lead)


def test_stages_fit_shared_memory():
    from qmoe.kernels import _gluon_sm90
    from qmoe.kernels import _tensor_gemm_ws as tw

    assert tw._m_stages(tw.DISPATCH_M["stages"], tw.DISPATCH_M["bn"], torch.bfloat16) == tw.DISPATCH_M["stages"]
    assert tw._k_stages(tw.DISPATCH_K["stages"]) == tw.DISPATCH_K["stages"]
    m_smem = 3 * (128 + 256) * 128 + 2 * 64 * 256 * 2
    assert m_smem <= _gluon_sm90.SMEM_BYTES - _gluon_sm90.SMEM_SPARE
    assert tw._m_stages(5, 256, torch.bfloat16) == 3 and tw._k_stages(5) == 3


def test_a_gluon_compile_failure_warns_once_and_falls_back(sm90, monkeypatch):
    assert_a_compile_failure_falls_back_once(
        monkeypatch, sm90, "launch_tensor_gemm_ws",
        lambda: sm90.launch_m_dispatched(_op(), _op(), None, 4096, 512, 1024, 8, torch.bfloat16, None), None)
    out = torch.empty(4, 256, 512, dtype=torch.bfloat16)
    monkeypatch.setattr(sm90, "FAILED", {})
    assert_a_compile_failure_falls_back_once(
        monkeypatch, sm90, "launch_tensor_wgrad_ws",
        lambda: sm90.launch_k_dispatched(_op(), _op(), None, 256, 512, 4, out, False), None)


@pytest.mark.parametrize("kind", ["m", "k"])
def test_the_triton_kernel_runs_where_the_gluon_one_declines(monkeypatch, kind):
    """The launchers ask the tensor route first for TENSOR scaling without a tile config, and
    launch the Triton kernel only when it declines; explicit tiles and other scalings never ask."""
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import _tensor_gemm_ws as tw
    from qmoe.kernels import grouped_gemm as gg

    class _Triton:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: ran.append("triton")

    monkeypatch.setattr(gg, "wrapped", lambda kernel: _Triton())
    a = gg._Operand(torch.zeros(512, 512, dtype=torch.float8_e4m3fn), 512, 1, factor=torch.ones(4))
    b = gg._Operand(torch.zeros(512, 512, dtype=torch.float8_e4m3fn), 512, 1, factor=torch.ones(4))
    offsets = torch.tensor([0, 100, 300, 400, 512])
    for gluon_result, scaling, tiles, expect in ((True, Scaling.TENSOR, False, ["gluon"]),
                                                 (False, Scaling.TENSOR, False, ["gluon", "triton"]),
                                                 (True, Scaling.TENSOR, True, ["triton"]),
                                                 (True, Scaling.NONE, False, ["triton"])):
        ran = []
        if kind == "m":
            monkeypatch.setattr(tw, "launch_m_dispatched",
                                lambda *args, r=gluon_result: ran.append("gluon") or (args[-1] if r else None))
            cfg = gg.tile_configs(scaling, small_m=False)[0] if tiles else None
            gg._launch_m_tiles(a, b, offsets, 512, 512, 512, 4, scaling, torch.bfloat16, cfg)
        else:
            monkeypatch.setattr(tw, "launch_k_dispatched",
                                lambda *args, r=gluon_result: ran.append("gluon") or (args[6] if r else None))
            cfg = gg.k_tile_config(scaling) if tiles else None
            gg._launch_k_into(a, b, offsets, 512, 512, 4, scaling, torch.empty(4, 512, 512), False, cfg)
        assert ran == expect, (gluon_result, scaling, tiles, ran)
