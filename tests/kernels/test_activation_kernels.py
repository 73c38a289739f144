"""The scaled-activation kernels against the reference on the GPU, at realistic sizes.

Tolerances as in test_activation_interpret.py (both compute in fp32 and round once to h's
dtype): rtol 1e-5 for fp32, one output ulp for bf16 / fp16 (2^-7, 2^-10); an absolute term of
1e-5 of the tensor's largest magnitude (the GPU's exp and division are a couple of ulps off,
and torch's gelu tail cancels in 1 + tanh); dprobs to 1e-5 of sum_j |da * act| per row.
Bit for bit: interleaved == plain layout for a and dh (only the column indexing differs), the
same launch twice (dprobs has no atomics), graph replay == eager. The custom ops' fake implementations and
the launchers' argument checks run on CPU too.
"""
from __future__ import annotations

import pytest
import torch

from qmoe.contracts.carriers import ACTIVATIONS, interleave_glu, is_glu
from qmoe.kernels import activation as kernels
from qmoe.reference import activation as reference
from tests.kernels.activation_inputs import activation_inputs

DEV = "cuda"
FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
RTOL = {FP32: 1e-5, BF16: 2.0 ** -7, FP16: 2.0 ** -10}


def _inputs(activation, dtype, rows, f, seed=0):
    return activation_inputs(activation, dtype, rows, f, seed, DEV)


def _bits(t):
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _assert_close(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    finite = want.float()[torch.isfinite(want.float())]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    torch.testing.assert_close(got.float(), want.float(), rtol=RTOL[want.dtype], atol=1e-5 * scale + 1e-30,
                               equal_nan=True, msg=lambda m: f"{what}: {m}")


def _assert_dprobs_close(got, want, h, da, activation, k):
    act = reference.scaled_activation_forward(h.float(), None, activation, k)
    tol = 1e-5 * (da.float() * act).abs().sum(1)
    assert got.dtype == torch.float32 and got.shape == want.shape
    bad = ~((got == want) | ((got - want).abs() <= tol) | (torch.isnan(got) & torch.isnan(want)))
    assert not bool(bad.any()), \
        f"dprobs: rows {bad.nonzero().flatten()[:8].tolist()}: {got[bad][:8]} vs {want[bad][:8]}"


def _compare(h, probs, da, activation, k=None, what=""):
    _assert_close(kernels.scaled_activation_forward(h, probs, activation, k),
                  reference.scaled_activation_forward(h, probs, activation, k), f"{what} a")
    dh, dprobs = kernels.scaled_activation_backward(h, probs, da, activation, k)
    dh_want, dprobs_want = reference.scaled_activation_backward(h, probs, da, activation, k)
    _assert_close(dh, dh_want, f"{what} dh")
    if probs is None:
        assert dprobs is None
    else:
        _assert_dprobs_close(dprobs, dprobs_want, h, da, activation, k)
    # the same elementwise code; compiled without the live act of the reduction, FMA contraction
    # could in principle differ by an ulp (the interpreter test checks these bit for bit)
    dh_only, none = kernels.scaled_activation_backward(h, probs, da, activation, k, need_dprobs=False)
    assert none is None
    _assert_close(dh_only, dh, f"{what} dh of the 2-D launch")


# ---------------------------------------------------------------- kernels == reference

@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=["bf16", "fp16", "fp32"])
def test_kernels_match_reference_at_a_realistic_size(activation, dtype):
    # 4099 rows (odd: a masked last row block), F = 1536; 6.3M outputs: the autotuned launches
    h, probs, da = _inputs(activation, dtype, 4099, 1536, seed=1)
    _compare(h, probs, da, activation)


# (rows, F, activation, dtype, probs): below the autotune threshold (one fixed tile), F not a
# multiple of 16 (no 16-byte accesses for the linear half), one row, one column.
SHAPES = [(1, 8, "swiglu", BF16, True), (65, 2048, "geglu", BF16, False), (257, 1000, "swiglu", FP16, True),
          (3, 4099, "gelu", FP32, True), (1000, 1, "clamped_qgeglu", BF16, True), (513, 136, "relu2", BF16, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows, f, activation, dtype, with_probs", SHAPES,
                         ids=[f"R{r}-F{f}-{a}" for r, f, a, _, _ in SHAPES])
def test_odd_shapes_and_no_probs(rows, f, activation, dtype, with_probs):
    h, probs, da = _inputs(activation, dtype, rows, f, seed=rows + f)
    _compare(h, probs if with_probs else None, da, activation)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["swiglu", "clamped_qgeglu"])
@pytest.mark.parametrize("k", [1, 8, 64, 128, 1536])
def test_interleaved_layout_equals_plain_layout_bit_for_bit(activation, k):
    """The kernel reads interleaved gate / linear columns in place: a and dh (re-interleaved) equal
    the plain layout's bits. dprobs sums the same output columns, but the compiler may give the
    tiles another register layout (k = 1: no 16-byte runs) and with it another summation tree:
    close, not necessarily bit-equal."""
    h, probs, da = _inputs(activation, BF16, 4099, 1536, seed=k)
    h_inter = interleave_glu(h.t(), k).t().contiguous()
    assert torch.equal(_bits(kernels.scaled_activation_forward(h_inter, probs, activation, k)),
                       _bits(kernels.scaled_activation_forward(h, probs, activation)))
    dh_inter, dp_inter = kernels.scaled_activation_backward(h_inter, probs, da, activation, k)
    dh, dp = kernels.scaled_activation_backward(h, probs, da, activation)
    assert torch.equal(_bits(dh_inter), _bits(interleave_glu(dh.t(), k).t()))
    _assert_dprobs_close(dp_inter, dp, h, da, activation, None)
    _compare(h_inter, probs, da, activation, k, f"k={k}")


@pytest.mark.gpu
def test_strided_views_are_read_in_place():
    h, probs, da = _inputs("swiglu", BF16, 4099, 1536, seed=2)
    wide_h = torch.zeros(4099, 2 * 1536 + 64, dtype=BF16, device=DEV)
    wide_h[:, 32:32 + 2 * 1536] = h
    wide_da = torch.zeros(4099, 1536 + 8, dtype=BF16, device=DEV)  # row stride not a multiple of 16
    wide_da[:, :1536] = da
    p2 = torch.stack((probs, probs), 1)[:, 1]
    views = (wide_h[:, 32:32 + 2 * 1536], p2, wide_da[:, :1536])
    _compare(*views, "swiglu", 64, "row-strided")
    for got, want in zip(kernels.scaled_activation_backward(*views, "swiglu", 64),
                         kernels.scaled_activation_backward(h, probs, da, "swiglu", 64)):
        assert torch.equal(_bits(got), _bits(want))
    h_cols = h.t().contiguous().t()  # column-strided: copied by the launcher
    _compare(h_cols, probs, da, "swiglu", None, "column-strided")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_special_values_match_reference(activation, dtype):
    """NaN, +-inf, huge and tiny magnitudes, signed zeros: the same NaNs and infinities as torch."""
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1e20, -1e20, 1e4, -1e4,
                             100.0, -100.0, 7.0, -7.0, 1e-30, -1e-30, 0.0, -0.0])
    n = specials.numel()
    rows = torch.cat([specials.roll(i) for i in range(n)]).reshape(n, n)[:, :16]  # every value in every column
    h = (torch.cat((rows, rows.flip(0)), 1) if is_glu(activation) else rows).to(DEV, dtype)
    gen = torch.Generator().manual_seed(1)
    probs = torch.rand(n, generator=gen).to(DEV)
    da = torch.randn(n, 16, generator=gen).to(DEV, dtype)
    _compare(h, probs, da, activation, None, "specials")


@pytest.mark.gpu
def test_backward_is_deterministic():
    h, probs, da = _inputs("swiglu", BF16, 16384, 2048, seed=3)
    first = kernels.scaled_activation_backward(h, probs, da, "swiglu")
    for _ in range(3):
        again = kernels.scaled_activation_backward(h, probs, da, "swiglu")
        for x, y in zip(again, first):
            assert torch.equal(_bits(x), _bits(y))


@pytest.mark.gpu
def test_launches_replay_from_a_cuda_graph_without_host_syncs():
    r, f, k = 4099, 1536, 128
    h, probs, da = _inputs("geglu", BF16, r, f, seed=4)

    def step():
        return (kernels.scaled_activation_forward(h, probs, "geglu", k),
                *kernels.scaled_activation_backward(h, probs, da, "geglu", k),
                kernels.scaled_activation_backward(h, probs, da, "geglu", k, need_dprobs=False)[0])

    step()  # compiles and autotunes before the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    h_new, p_new, da_new = _inputs("geglu", BF16, r, f, seed=5)
    h.copy_(h_new)
    probs.copy_(p_new)
    da.copy_(da_new)
    graph.replay()
    for x, y in zip(captured, step()):
        assert torch.equal(_bits(x), _bits(y))


@pytest.mark.gpu
def test_empty_shapes():
    for rows, f in ((0, 8), (5, 0), (0, 0)):
        h, probs, da = (torch.zeros(rows, 2 * f, device=DEV), torch.rand(rows, device=DEV),
                        torch.zeros(rows, f, device=DEV))
        assert kernels.scaled_activation_forward(h, probs, "swiglu").shape == (rows, f)
        dh, dprobs = kernels.scaled_activation_backward(h, probs, da, "swiglu")
        assert dh.shape == (rows, 2 * f) and torch.equal(dprobs, torch.zeros(rows, device=DEV))


# ---------------------------------------------------------------- no GPU needed

def test_custom_ops_have_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        h = torch.empty(4099, 3072, device=DEV, dtype=torch.bfloat16)
        p = torch.empty(4099, device=DEV)
        a, amax = torch.ops.qmoe.scaled_activation_forward(h, p, 0, 64, None)
        assert a.shape == (4099, 1536) and a.dtype == torch.bfloat16 and amax.shape == (0,)
        dh, dprobs, amax = torch.ops.qmoe.scaled_activation_backward(h, p, a, 0, 64, True, None)
        assert dh.shape == h.shape and dh.dtype == h.dtype and dprobs.shape == (4099,) and amax.shape == (0,)
        assert dprobs.dtype == torch.float32
        dh, dprobs, _ = torch.ops.qmoe.scaled_activation_backward(torch.empty_like(a), None, a, 4, 0, True,
                                                                  None)  # gelu
        assert dh.shape == (4099, 1536) and dprobs.shape == (0,)
        offsets = torch.empty(33, device=DEV, dtype=torch.int64)  # 32 row groups: their amaxes come along
        _, amax = torch.ops.qmoe.scaled_activation_forward(h, p, 0, 64, offsets)
        assert amax.shape == (32,) and amax.dtype == torch.float32
        _, _, amax = torch.ops.qmoe.scaled_activation_backward(h, p, a, 0, 64, False, offsets)
        assert amax.shape == (32,) and amax.dtype == torch.float32


@pytest.mark.parametrize("args, error", [
    ((torch.randn(4, 8, dtype=torch.float64), None, "swiglu"), TypeError),
    ((torch.randn(4, 7), None, "swiglu"), ValueError),
    ((torch.randn(4, 8), torch.rand(3), "swiglu"), ValueError),
    ((torch.randn(4, 8), None, "swiglu", 3), ValueError),
    ((torch.randn(4, 8), None, "tanh"), ValueError),
], ids=["fp64", "odd-width", "probs-rows", "interleave", "activation"])
def test_launchers_reject_bad_input_before_launching(args, error):
    with pytest.raises(error):
        kernels.scaled_activation_forward(*args)
    da = torch.randn(4, 4)
    with pytest.raises(error):
        kernels.scaled_activation_backward(*args[:2], da, *args[2:])
