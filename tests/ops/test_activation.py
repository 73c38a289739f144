"""Scaled expert activation: the reference twins against autograd, and `qmoe.ops.expert_activation`.

a = act(h) * p;  dh = (da * p) * act'(h);  dprobs[r] = sum_j da[r, j] * act(h)[r, j].
The analytic backward of `qmoe.reference.activation` is checked against torch's autograd of the
plain formula `scaled_activation` in float64 (and float32), for every activation, both GLU
layouts, with and without probs, at the clamps of clamped_qgeglu. The op (an autograd Function
over the twins) is checked against the pure-torch path it replaced. The Triton kernels are
checked against the reference in tests/kernels/test_activation_interpret.py (CPU) and
tests/kernels/test_activation_kernels.py (GPU); the op's graph safety at the end of this file.
"""
import pytest
import torch
from hypothesis import given, strategies as st

from qmoe.dispatch import ACTIVATION
from qmoe.ops import expert_activation
from qmoe.reference import activation as reference
from qmoe.contracts.carriers import ACTIVATIONS, deinterleave_glu, interleave_glu, is_glu, QGEGLU_LIMIT
from qmoe.reference.activation import scaled_activation

ROWS, F = 13, 24


def _logical(h, k):
    """h in the [gate | linear] layout (the pre-kernel op deinterleaved exactly like this)."""
    return deinterleave_glu(h.t(), k).t() if k else h


def _old_expert_activation(h, probs, activation, k=None):
    """The pure-torch op this module replaced: deinterleave, then autograd through the formula."""
    return scaled_activation(_logical(h, k if is_glu(activation) else None), probs, activation)


def _inputs(activation, dtype=torch.float64, rows=ROWS, f=F, seed=0):
    """h spread over the interesting ranges (+-12: past the clamps, gelu's flat tails), probs in
    [0, 1) with a padding row of prob 0, da."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * f if is_glu(activation) else f
    h = (torch.randn(rows, width, generator=gen, dtype=torch.float64) * 4).clamp(-12, 12)
    probs = torch.rand(rows, generator=gen, dtype=torch.float64)
    probs[rows // 2:rows // 2 + 1] = 0.0
    da = torch.randn(rows, f, generator=gen, dtype=torch.float64)
    return h.to(dtype), probs.to(dtype), da.to(dtype)


def _autograd(h, probs, da, activation, k):
    """(a, dh, dprobs) by torch autograd of the plain formula."""
    h = h.clone().requires_grad_(True)
    p = probs.clone().requires_grad_(True) if probs is not None else None
    a = _old_expert_activation(h, p, activation, k)
    a.backward(da)
    return a.detach(), h.grad, (p.grad if p is not None else None)


CASES = [(act, k) for act in ACTIVATIONS for k in ([None, 4, 1] if is_glu(act) else [None])]
CASE_IDS = [f"{a}-k{k}" for a, k in CASES]


# ------------------------------------------------------------------ the analytic backward == autograd

@pytest.mark.parametrize("activation, k", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no-probs"])
def test_reference_backward_equals_autograd_float64(activation, k, with_probs):
    h, probs, da = _inputs(activation)
    probs = probs if with_probs else None
    a, dh_want, dp_want = _autograd(h, probs, da, activation, k)
    # (not bit for bit: torch's CPU kernels may take a vectorised or a scalar exp for different layouts)
    torch.testing.assert_close(reference.scaled_activation_forward(h, probs, activation, k), a, rtol=1e-14, atol=0)
    dh, dprobs = reference.scaled_activation_backward(h, probs, da, activation, k)
    assert dh.dtype == torch.float64 and dh.shape == h.shape
    torch.testing.assert_close(dh, dh_want, rtol=1e-12, atol=1e-12)
    if with_probs:
        assert dprobs.dtype == torch.float64
        torch.testing.assert_close(dprobs, dp_want, rtol=1e-12, atol=1e-12)
        assert reference.scaled_activation_backward(h, probs, da, activation, k, need_dprobs=False)[1] is None
    else:
        assert dprobs is None


@pytest.mark.parametrize("activation, k", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_backward_equals_autograd_low_precision(activation, k, dtype):
    # both compute in fp32 and round dh once to h's dtype; the operation order differs only where
    # autograd's saved intermediates are reassociated, so fp32 agrees to a few ulps and bf16 dh
    # to one bf16 ulp (a different fp32 value may round the other way).
    h, probs, da = _inputs(activation, dtype, seed=1)
    probs = probs.float()
    _, dh_want, dp_want = _autograd(h, probs, da, activation, k)
    dh, dprobs = reference.scaled_activation_backward(h, probs, da, activation, k)
    assert dh.dtype == dtype and dprobs.dtype == torch.float32
    rtol = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    scale = float(dh_want.abs().max())
    torch.testing.assert_close(dh.float(), dh_want.float(), rtol=rtol, atol=1e-6 * scale)
    torch.testing.assert_close(dprobs, dp_want, rtol=1e-5, atol=1e-5 * float(dp_want.abs().max()))


@pytest.mark.parametrize("k", [None, 2], ids=["k-none", "k2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_clamped_qgeglu_gradient_at_and_beyond_the_clamps(k, dtype):
    """torch.clamp passes the gradient on its bounds and stops it past them: gate <= 7 passes
    (the gate is only clamped above), linear in [-7, 7] passes."""
    lim = QGEGLU_LIMIT
    up = torch.nextafter(torch.tensor(lim, dtype=dtype), torch.tensor(100.0, dtype=dtype)).item()
    down = torch.nextafter(torch.tensor(lim, dtype=dtype), torch.tensor(0.0, dtype=dtype)).item()
    gates = torch.tensor([lim, up, down, 8.0, 100.0, -lim, -up, -100.0, 0.0, 1.0], dtype=dtype)
    linears = torch.tensor([lim, -lim, up, -up, 8.0, -8.0, down, -down, 0.5, -100.0], dtype=dtype)
    n = gates.numel()
    gate = gates[:, None].expand(n, n).reshape(-1, 4)  # every gate value with every linear value, F = 4
    linear = linears[None, :].expand(n, n).reshape(-1, 4)
    h_logical = torch.cat((gate, linear), dim=1)
    h = interleave_glu(h_logical.t(), k).t().contiguous() if k else h_logical
    probs = torch.linspace(0.1, 1.0, h.shape[0], dtype=dtype)
    da = torch.ones(h.shape[0], 4, dtype=dtype)
    _, dh_want, dp_want = _autograd(h, probs, da, "clamped_qgeglu", k)
    dh, dprobs = reference.scaled_activation_backward(h, probs, da, "clamped_qgeglu", k)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(dh, dh_want, rtol=tol, atol=tol)
    torch.testing.assert_close(dprobs, dp_want, rtol=tol, atol=tol)
    dh_logical = _logical(dh, k)
    dgate, dlin = dh_logical[:, :4], dh_logical[:, 4:]
    assert bool((dgate[gate > lim] == 0).all())
    assert bool((dgate[gate == lim] != 0).all())  # on the bound: passes
    assert bool((dlin[linear.abs() > lim] == 0).all())
    on_bound = (linear.abs() == lim) & ((gate == lim) | (gate == 1.0))  # where act / d linear is not 0
    assert bool(on_bound.any()) and bool((dlin[on_bound] != 0).all())


@given(rows=st.integers(0, 9), f_blocks=st.integers(1, 4), k=st.sampled_from([None, 1, 2, 3]),
       activation=st.sampled_from(ACTIVATIONS), with_probs=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_reference_backward_jagged_shapes(rows, f_blocks, k, activation, with_probs, seed):
    f = f_blocks * (k or 2)
    h, probs, da = _inputs(activation, rows=rows, f=f, seed=seed)
    probs = probs if with_probs else None
    _, dh_want, dp_want = _autograd(h, probs, da, activation, k if is_glu(activation) else None)
    dh, dprobs = reference.scaled_activation_backward(h, probs, da, activation, k)
    torch.testing.assert_close(dh, dh_want, rtol=1e-12, atol=1e-12)
    if with_probs:
        torch.testing.assert_close(dprobs, dp_want, rtol=1e-12, atol=1e-12)


def test_split_and_join_glu_follow_interleave_glu():
    h = torch.arange(2 * 3 * 8.0).reshape(3, 16)  # logical: gate columns 0..7, linear 8..15
    for k in (None, 1, 2, 4, 8):
        phys = interleave_glu(h.t(), k).t() if k else h
        gate, linear = reference.split_glu(phys, k)
        assert torch.equal(gate, h[:, :8]) and torch.equal(linear, h[:, 8:])
        assert torch.equal(reference.join_glu(gate, linear, k), phys)


# ------------------------------------------------------------------ the op == the pure-torch op it replaced

@pytest.mark.parametrize("activation, k", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("probs_mode", ["grad", "no-grad", "none"])
def test_op_matches_the_old_pure_torch_op(activation, k, dtype, probs_mode):
    h0, p0, da = _inputs(activation, dtype, seed=2)
    p0 = p0.float() if dtype != torch.float64 else p0
    out = {}
    for name, fn in (("new", expert_activation), ("old", _old_expert_activation)):
        h = h0.clone().requires_grad_(True)
        p = None if probs_mode == "none" else p0.clone().requires_grad_(probs_mode == "grad")
        a = fn(h, p, activation, k)
        a.backward(da)
        out[name] = (a.detach(), h.grad, None if p is None else p.grad)
    (a, dh, dp), (a_old, dh_old, dp_old) = out["new"], out["old"]
    assert a.dtype == dh.dtype == dtype
    rtol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7}[dtype]
    torch.testing.assert_close(a, a_old, rtol=rtol, atol=1e-6 * float(a_old.abs().max().float()))
    torch.testing.assert_close(dh, dh_old, rtol=rtol, atol=1e-6 * float(dh_old.abs().max().float()))
    if probs_mode == "grad":
        assert dp.dtype == p0.dtype
        torch.testing.assert_close(dp, dp_old, rtol=1e-12 if dtype == torch.float64 else 1e-5,
                                   atol=1e-5 * float(dp_old.abs().max()))
    else:
        assert dp is None


def test_op_gradients_follow_requires_grad_and_probs_dtype():
    h, probs, da = _inputs("swiglu", torch.float32, seed=3)
    # only probs requires grad
    p = probs.bfloat16().requires_grad_(True)
    a = expert_activation(h, p, "swiglu")
    a.backward(da)
    assert p.grad.dtype == torch.bfloat16 and h.grad is None
    want = (da * reference.activation_fn(h, "swiglu")).sum(1)
    torch.testing.assert_close(p.grad.float(), want, rtol=2.0 ** -7, atol=1e-5)
    # no grad anywhere: no graph
    assert not expert_activation(h, probs, "swiglu").requires_grad
    with torch.no_grad():
        assert torch.equal(expert_activation(h, probs, "swiglu"), scaled_activation(h, probs, "swiglu"))


def test_probs_none_is_prob_one_bit_for_bit():
    h, _, da = _inputs("geglu", torch.bfloat16, seed=4)
    ones = torch.ones(h.shape[0])
    assert torch.equal(expert_activation(h, None, "geglu"), expert_activation(h, ones, "geglu"))
    dh_none, _ = reference.scaled_activation_backward(h, None, da, "geglu")
    dh_ones, _ = reference.scaled_activation_backward(h, ones, da, "geglu")
    assert torch.equal(dh_none, dh_ones)


@pytest.mark.parametrize("activation", ["swiglu", "relu2", "clamped_qgeglu"])
def test_padding_rows_stay_zero(activation):
    h, probs, da = _inputs(activation, torch.float32, seed=5)
    pad = torch.tensor([0, 4, 5])
    h[pad], probs[pad] = 0.0, 0.0
    h.requires_grad_(True)
    a = expert_activation(h, probs, activation)
    a.backward(da)
    assert torch.equal(a[pad], torch.zeros(len(pad), a.shape[1]))
    assert torch.equal(h.grad[pad], torch.zeros(len(pad), h.shape[1]))


def test_strided_inputs_and_empty_shapes():
    h, probs, da = _inputs("swiglu", torch.float32, seed=6)
    wide = torch.zeros(h.shape[0], h.shape[1] + 5)
    wide[:, :h.shape[1]] = h
    strided_probs = torch.stack((probs, probs), 1)[:, 0]
    assert torch.equal(expert_activation(wide[:, :h.shape[1]], strided_probs, "swiglu", 4),
                       expert_activation(h, probs, "swiglu", 4))
    for r, f in ((0, 8), (5, 0), (0, 0)):
        e = torch.zeros(r, 2 * f, requires_grad=True)
        p = torch.rand(r, requires_grad=True)
        a = expert_activation(e, p, "swiglu")
        assert a.shape == (r, f)
        a.sum().backward()
        assert e.grad.shape == (r, 2 * f) and torch.equal(p.grad, torch.zeros(r))


BAD = [
    ("unknown activation", lambda: expert_activation(torch.randn(4, 8), None, "silu"), ValueError, "unknown"),
    ("1-D h", lambda: expert_activation(torch.randn(8), None, "gelu"), ValueError, "2-D"),
    ("3-D h", lambda: expert_activation(torch.randn(2, 4, 8), None, "gelu"), ValueError, "2-D"),
    ("odd GLU width", lambda: expert_activation(torch.randn(4, 7), None, "swiglu"), ValueError, "odd width"),
    ("int h", lambda: expert_activation(torch.ones(4, 8, dtype=torch.int32), None, "gelu"), TypeError, "h must"),
    ("probs rows", lambda: expert_activation(torch.randn(4, 8), torch.rand(5), "swiglu"), ValueError, "probs"),
    ("probs 2-D", lambda: expert_activation(torch.randn(4, 8), torch.rand(4, 1), "swiglu"), ValueError, "probs"),
    ("int probs", lambda: expert_activation(torch.randn(4, 8), torch.ones(4, dtype=torch.long), "gelu"), TypeError,
     "probs"),
    ("probs on meta", lambda: expert_activation(torch.randn(4, 8), torch.rand(4, device="meta"), "gelu"), ValueError,
     "device"),
    ("interleave not dividing F", lambda: expert_activation(torch.randn(4, 12), None, "swiglu", 4), ValueError,
     "glu_interleave_size"),
    ("negative interleave", lambda: expert_activation(torch.randn(4, 8), None, "geglu", -2), ValueError,
     "glu_interleave_size"),
    ("da shape", lambda: reference.scaled_activation_backward(torch.randn(4, 8), None, torch.randn(4, 8), "swiglu"),
     ValueError, "da"),
]


@pytest.mark.parametrize("what, call, error, match", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_raise_clear_errors(what, call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_interleave_size_is_ignored_for_pointwise_activations():
    h = torch.randn(4, 6)
    assert torch.equal(expert_activation(h, None, "relu2", 4), expert_activation(h, None, "relu2"))


def test_cpu_dispatch_picks_the_reference():
    t = torch.zeros(2, 2)
    for name in ("scaled_activation_forward", "scaled_activation_backward"):
        assert ACTIVATION.pick(name, t) is getattr(reference, name)


# ------------------------------------------------------------------ on the GPU: the op through the kernels

@pytest.mark.gpu
@pytest.mark.parametrize("activation, k", [("swiglu", None), ("clamped_qgeglu", 64), ("gelu", None)])
def test_gpu_op_uses_the_kernels_and_matches_reference(activation, k, monkeypatch):
    from qmoe.kernels import activation as kernels
    assert ACTIVATION.pick("scaled_activation_forward",
                          torch.zeros(1, device="cuda")) is kernels.scaled_activation_forward
    h0, p0, da = (t.cuda() for t in _inputs(activation, torch.bfloat16, rows=4099, f=1536, seed=7))
    p0 = p0.float()
    out = {}
    for backend in ("auto", "reference"):
        monkeypatch.setenv("QMOE_BACKEND", backend)
        h, p = h0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
        a = expert_activation(h, p, activation, k)
        a.backward(da)
        out[backend] = (a.detach().float(), h.grad.float(), p.grad)
    for got, want in zip(out["auto"], out["reference"]):
        torch.testing.assert_close(got, want, rtol=2.0 ** -7, atol=1e-5 * float(want.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no-probs"])
def test_gpu_op_has_no_host_sync_replays_in_a_cuda_graph_and_is_deterministic(with_probs):
    r, f, k = 4099, 1536, 128  # above the autotune threshold: the warm-up tunes outside the capture
    h_s, p_s, da_s = (t.cuda() for t in _inputs("swiglu", torch.bfloat16, rows=r, f=f, seed=8))
    p_s = p_s.float()
    h_s.requires_grad_(True)
    p_s.requires_grad_(with_probs)

    def step():
        a = expert_activation(h_s, p_s, "swiglu", k)
        grads = torch.autograd.grad(a, [h_s, p_s] if with_probs else [h_s], da_s)
        return (a,) + tuple(grads)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        first = step()  # compiles and autotunes outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for x, y in zip(again, first):
        assert torch.equal(x, y)  # the same launches give the same bits (no atomics in dprobs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    h_new, p_new, da_new = (t.cuda() for t in _inputs("swiglu", torch.bfloat16, rows=r, f=f, seed=9))
    with torch.no_grad():
        h_s.copy_(h_new)
        p_s.copy_(p_new.float())
        da_s.copy_(da_new)
    graph.replay()
    eager = step()
    for x, y in zip(captured, eager):
        assert torch.equal(x, y)


@pytest.mark.gpu
def test_gpu_op_under_torch_compile_matches_eager():
    """The custom ops trace (fake implementations) and the compiled forward's backward runs the kernel."""
    h0, p0, da = (t.cuda() for t in _inputs("geglu", torch.bfloat16, rows=1000, f=512, seed=10))
    p0 = p0.float()
    compiled = torch.compile(lambda h, p: expert_activation(h, p, "geglu", 32))
    out = {}
    for name, fn in (("eager", lambda h, p: expert_activation(h, p, "geglu", 32)), ("compiled", compiled)):
        h, p = h0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
        a = fn(h, p)
        a.backward(da)
        out[name] = (a.detach(), h.grad, p.grad)
    for got, want in zip(out["compiled"], out["eager"]):
        torch.testing.assert_close(got, want)
