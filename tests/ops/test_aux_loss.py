"""Balance losses, z-loss and the expert-bias update: contract on CPU, kernels == reference on GPU."""
import math

import pytest
import torch
from hypothesis import given, strategies as st

from qmoe.ops import moe_aux_loss, seq_aux_loss, update_expert_bias, z_loss
from qmoe.reference import aux_loss as reference


def _balanced(t, e, k):
    """Uniform probs and a routing that gives every expert t * k / e tokens."""
    probs = torch.full((t, e), 1.0 / e)
    routing_map = torch.zeros(t, e, dtype=torch.bool)
    for i in range(t):
        routing_map[i, [(i * k + j) % e for j in range(k)]] = True
    return probs, routing_map


# ------------------------------------------------------------------ the contract, on CPU


def test_balanced_routing_gives_coeff():
    probs, routing_map = _balanced(16, 8, 2)
    loss = moe_aux_loss(probs, routing_map.sum(0), 16, 8, 2, 0.01)
    torch.testing.assert_close(loss, torch.tensor(0.01), rtol=1e-6, atol=0)
    loss = seq_aux_loss(probs, routing_map, 4, 2, 0.01)
    torch.testing.assert_close(loss, torch.tensor(0.01), rtol=1e-6, atol=0)


def test_moe_aux_loss_matches_its_formula_and_takes_a_device_count():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(10, 4, generator=g)
    counts = torch.tensor([5, 0, 12, 3])
    want = (probs.sum(0) * counts).sum() * 4 * 0.1 / (2 * 10 ** 2)
    torch.testing.assert_close(moe_aux_loss(probs, counts, 10, 4, 2, 0.1), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(moe_aux_loss(probs, counts, torch.tensor(10), 4, 2, 0.1), want,
                               rtol=1e-6, atol=0)


def test_seq_aux_loss_sees_imbalance_inside_sequences():
    # Two sequences, each all on one expert, but the batch as a whole is balanced.
    probs = torch.tensor([[1.0, 0.0]] * 4 + [[0.0, 1.0]] * 4)
    routing_map = probs.bool()
    batch = moe_aux_loss(probs, routing_map.sum(0), 8, 2, 1, 1.0)
    per_seq = seq_aux_loss(probs, routing_map, 4, 1, 1.0)
    torch.testing.assert_close(batch, torch.tensor(1.0))
    torch.testing.assert_close(per_seq, torch.tensor(2.0))  # E / K * f * P = 2 * 1 * 1


def test_z_loss_of_equal_logits():
    loss = z_loss(torch.zeros(3, 8), 1e-3)
    torch.testing.assert_close(loss, torch.tensor(1e-3 * math.log(8) ** 2))


def test_losses_accumulate_in_fp32_for_bf16_inputs():
    probs = torch.rand(64, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    counts = torch.randint(0, 9, (16,), generator=torch.Generator().manual_seed(2))
    loss = moe_aux_loss(probs, counts, 64, 16, 2, 1.0)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, moe_aux_loss(probs.float(), counts, 64, 16, 2, 1.0))


@pytest.mark.parametrize("name", ["moe", "seq", "z"])
def test_gradcheck_fp64_reference(name):
    g = torch.Generator().manual_seed(3)
    x = torch.rand(6, 4, dtype=torch.float64, generator=g).requires_grad_(True)
    routing_map = torch.rand(6, 4, generator=g) > 0.5
    fns = {
        "moe": lambda p: reference.moe_aux_loss(p, routing_map.sum(0), 6, 4, 2, 0.3),
        "seq": lambda p: reference.seq_aux_loss(p, routing_map, 3, 2, 0.3),
        "z": lambda p: reference.z_loss(p * 4 - 2, 0.3),
    }
    torch.autograd.gradcheck(fns[name], (x,))


def test_update_expert_bias_moves_toward_balance_in_place():
    bias = torch.zeros(4)
    counts = torch.tensor([10, 2, 6, 6])  # mean 6
    out = update_expert_bias(bias, counts, rate=0.5)
    assert out is bias
    assert bias.tolist() == [-0.5, 0.5, 0.0, 0.0]


def test_update_expert_bias_keeps_the_bias_dtype():
    bias = torch.zeros(3, dtype=torch.bfloat16)
    update_expert_bias(bias, torch.tensor([1.0, 2.0, 3.0]), rate=0.25)
    assert bias.dtype == torch.bfloat16 and bias.tolist() == [0.25, 0.0, -0.25]


@given(st.integers(1, 6), st.integers(1, 8), st.integers(1, 4), st.floats(1e-4, 1.0))
def test_reference_losses_are_nonnegative_and_scale_with_coeff(b, e, k, coeff):
    g = torch.Generator().manual_seed(b * 100 + e)
    k = min(k, e)
    probs = torch.rand(b * 3, e, generator=g)
    routing_map = torch.rand(b * 3, e, generator=g) > 0.5
    one = reference.seq_aux_loss(probs, routing_map, 3, k, 1.0)
    assert one >= 0
    torch.testing.assert_close(reference.seq_aux_loss(probs, routing_map, 3, k, coeff), one * coeff)
    torch.testing.assert_close(reference.moe_aux_loss(probs, routing_map.sum(0), b * 3, e, k, coeff),
                               reference.moe_aux_loss(probs, routing_map.sum(0), b * 3, e, k, 1.0) * coeff)


def check_empty_batch_losses(device):
    """No tokens, no loss: every loss of a [0, E] batch is exactly 0 with an empty gradient
    (NUMERICS.md "Non-finite values"); a count of 0 tokens is valid for an empty batch only."""
    probs = torch.zeros(0, 4, device=device, requires_grad=True)
    routing_map = torch.zeros(0, 4, dtype=torch.bool, device=device)
    counts = routing_map.sum(0)
    losses = [moe_aux_loss(probs, counts, 0, 4, 2, 1e-2),
              moe_aux_loss(probs, counts, torch.tensor(0, device=device), 4, 2, 1e-2),
              seq_aux_loss(probs, routing_map, 3, 2, 1e-2), z_loss(probs, 1e-3)]
    for i, loss in enumerate(losses):
        assert loss.dtype == torch.float32 and loss.item() == 0.0, i
        (grad,) = torch.autograd.grad(loss, probs)
        assert grad.shape == (0, 4), i
    with pytest.raises(ValueError, match="num_tokens"):
        moe_aux_loss(torch.rand(4, 3, device=device), torch.ones(3, device=device), 0, 3, 1, 1.0)


def test_empty_batch_losses_are_zero():
    check_empty_batch_losses("cpu")


@pytest.mark.gpu
def test_empty_batch_losses_are_zero_on_gpu():
    check_empty_batch_losses("cuda")


@pytest.mark.parametrize("call,err,match", [
    (lambda: moe_aux_loss(torch.rand(4, 3), torch.ones(4), 4, 3, 1, 1.0), ValueError, "tokens_per_expert"),
    (lambda: moe_aux_loss(torch.rand(4, 3), torch.ones(3), 0, 3, 1, 1.0), ValueError, "num_tokens"),
    (lambda: moe_aux_loss(torch.rand(4, 3), torch.ones(3), torch.ones(2), 3, 1, 1.0), ValueError, "0-dim"),
    (lambda: moe_aux_loss(torch.rand(4, 3), torch.ones(3), 4, 3, 1, "x"), TypeError, "coeff"),
    (lambda: seq_aux_loss(torch.rand(6, 3), torch.ones(6, 3, dtype=torch.bool), 4, 1, 1.0), ValueError, "seq_length"),
    (lambda: seq_aux_loss(torch.rand(6, 3), torch.ones(6, 3), 3, 1, 1.0), TypeError, "bool"),
    (lambda: z_loss(torch.ones(3, dtype=torch.int64), 1.0), TypeError, "floating"),
    (lambda: update_expert_bias(torch.zeros(3), torch.ones(4)), ValueError, "shape"),
    (lambda: update_expert_bias(torch.zeros(3, dtype=torch.int32), torch.ones(3)), TypeError, "floating"),
], ids=["tpe_shape", "num_tokens", "num_tokens_dim", "coeff", "seq_divides", "map_dtype", "z_dtype",
        "bias_shape", "bias_dtype"])
def test_bad_arguments_raise_clear_errors(call, err, match):
    with pytest.raises(err, match=match):
        call()


# ------------------------------------------------------------------ kernels == reference, on GPU

GPU_SIZES = [(1, 8), (333, 60), (8192, 256), (131072, 64), (16384, 1024), (4096, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("t,e", GPU_SIZES, ids=[f"T{t}-E{e}" for t, e in GPU_SIZES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_reference(t, e, dtype):
    from qmoe.kernels import aux_loss as kernels
    torch.manual_seed(t + e)
    probs = torch.softmax(torch.randn(t, e, device="cuda"), -1).to(dtype)
    routing_map = torch.rand(t, e, device="cuda") < 8 / e
    counts = routing_map.sum(0)
    grad = torch.tensor(1.3, device="cuda")
    for nt in (t, torch.tensor(t, device="cuda")):
        args = (counts, nt, e, 8, 1e-2)
        torch.testing.assert_close(kernels.moe_aux_loss(probs, *args), reference.moe_aux_loss(probs, *args),
                                   rtol=1e-5, atol=0)
        torch.testing.assert_close(kernels.moe_aux_loss_backward(grad, probs, *args),
                                   reference.moe_aux_loss_backward(grad, probs, *args))
    seq = t if t < 64 else t // 4 if t % 4 == 0 else t
    args = (routing_map, seq, 8, 1e-2)
    torch.testing.assert_close(kernels.seq_aux_loss(probs, *args), reference.seq_aux_loss(probs, *args),
                               rtol=1e-5, atol=0)
    torch.testing.assert_close(kernels.seq_aux_loss_backward(grad, probs, *args),
                               reference.seq_aux_loss_backward(grad, probs, *args))
    logits = (torch.randn(t, e, device="cuda") * 4).to(dtype)
    torch.testing.assert_close(kernels.z_loss(logits, 1e-3), reference.z_loss(logits, 1e-3), rtol=1e-5, atol=0)
    # both compute in fp32 and round the gradient to the logits' dtype: a different fp32 summation
    # order may flip that last rounding, so bf16 allows one bf16 ulp
    ulp = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    torch.testing.assert_close(kernels.z_loss_backward(grad, logits, 1e-3),
                               reference.z_loss_backward(grad, logits, 1e-3), rtol=ulp, atol=1e-9)
    b_k, b_r = torch.randn(e, device="cuda"), None
    b_r = b_k.clone()
    kernels.update_expert_bias(b_k, counts, 1e-3)
    reference.update_expert_bias(b_r, counts, 1e-3)
    assert torch.equal(b_k, b_r)


@pytest.mark.gpu
def test_ops_are_graph_safe_with_a_device_token_count():
    torch.manual_seed(0)
    t, e = 4096, 64
    probs = torch.softmax(torch.randn(t, e, device="cuda"), -1).requires_grad_(True)
    logits = torch.randn(t, e, device="cuda", requires_grad=True)
    routing_map = torch.rand(t, e, device="cuda") < 0.1
    nt = torch.tensor(t, device="cuda")
    bias = torch.zeros(e, device="cuda")

    def step():
        counts = routing_map.sum(0)
        loss = moe_aux_loss(probs, counts, nt, e, 8, 1e-2) + seq_aux_loss(probs, routing_map, 1024, 8, 1e-2) \
            + z_loss(logits, 1e-3)
        grads = torch.autograd.grad(loss, [probs, logits])
        update_expert_bias(bias, counts, 1e-3)
        return loss, grads

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager_loss, eager_grads = step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_loss, g_grads = step()
    bias.zero_()
    graph.replay()
    torch.testing.assert_close(g_loss, eager_loss)
    for a, b in zip(g_grads, eager_grads):
        torch.testing.assert_close(a, b)
    assert bias.abs().max() == 1e-3


@pytest.mark.gpu
def test_losses_share_counters_safely_across_streams_and_graphs():
    # Eager launches share one arrival counter per stream and a captured launch keeps its own
    # (qmoe.kernels._counters.tickets); the last program of each launch resets it. Here two
    # streams run losses at once, and a graph replays on a third while eager launches run.
    from qmoe.kernels._counters import tickets
    t, e = 8192, 256
    probs, routing_map, counts, logits = _gpu_loss_inputs(t, e, seed=3)
    losses = [lambda: moe_aux_loss(probs, counts, t, e, 8, 1e-2),
              lambda: seq_aux_loss(probs, routing_map, 256, 8, 1e-2),  # row-chunked: per-pair counters
              lambda: z_loss(logits, 1e-3)]
    want = [loss() for loss in losses]
    streams = [torch.cuda.Stream() for _ in range(3)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    assert tickets(1, probs.device).data_ptr() != _on(streams[0], lambda: tickets(1, probs.device)).data_ptr()
    got = {0: [], 1: []}
    for _ in range(20):
        for i in (0, 1):
            with torch.cuda.stream(streams[i]):
                got[i].append([loss() for loss in losses])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=streams[2]):
        captured = [loss() for loss in losses]
        inside = tickets(1, probs.device)
    assert inside.data_ptr() not in {tickets(1, probs.device).data_ptr(),
                                     _on(streams[0], lambda: tickets(1, probs.device)).data_ptr()}
    for _ in range(5):
        with torch.cuda.stream(streams[2]):
            graph.replay()
        with torch.cuda.stream(streams[0]):
            got[0].append([loss() for loss in losses])
    torch.cuda.synchronize()
    for runs in got.values():
        for run in runs:
            for a, b in zip(run, want):
                assert torch.equal(a, b)
    for a, b in zip(captured, want):
        assert torch.equal(a, b)
    assert not tickets(64, probs.device).any() and not inside.any()


def _gpu_loss_inputs(t, e, seed):
    """(probs, routing_map, counts, logits) on the GPU: softmax probs, ~8 experts a token."""
    torch.manual_seed(seed)
    probs = torch.softmax(torch.randn(t, e, device="cuda"), -1)
    routing_map = torch.rand(t, e, device="cuda") < 8 / e
    return probs, routing_map, routing_map.sum(0), torch.randn(t, e, device="cuda") * 3


def _on(stream, fn):
    with torch.cuda.stream(stream):
        return fn()


# Shapes for the kernels' reduction layouts: few (sequence, column block) pairs force the
# row-chunked seq_aux_loss path (chunks finished by the last to arrive); many pairs, or a
# sequence shorter than a tile, the single-chunk one.
SEQ_SHAPES = [(131072, 8, 131072), (65536, 64, 16384), (8192, 256, 4096), (16384, 128, 4096),
              (4096, 4096, 4096), (2048, 96, 1), (999, 5, 333)]


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,seq", SEQ_SHAPES, ids=[f"T{t}-E{e}-L{s}" for t, e, s in SEQ_SHAPES])
def test_seq_aux_loss_kernel_layouts(t, e, seq):
    from qmoe.kernels import aux_loss as kernels
    torch.manual_seed(t + e + seq)
    probs = torch.softmax(torch.randn(t, e, device="cuda"), -1)
    routing_map = torch.rand(t, e, device="cuda") < min(1.0, 4 / e)
    args = (routing_map, seq, min(4, e), 1e-2)
    torch.testing.assert_close(kernels.seq_aux_loss(probs, *args), reference.seq_aux_loss(probs, *args),
                               rtol=1e-5, atol=0)
    grad = torch.tensor(0.7, device="cuda")
    torch.testing.assert_close(kernels.seq_aux_loss_backward(grad, probs, *args),
                               reference.seq_aux_loss_backward(grad, probs, *args))


@pytest.mark.gpu
def test_losses_are_deterministic():
    # Partials are added in a fixed order by the last program, never by float atomics.
    t, e = 65536, 256
    probs, routing_map, counts, logits = _gpu_loss_inputs(t, e, seed=1)
    for loss in (lambda: moe_aux_loss(probs, counts, t, e, 8, 1e-2),
                 lambda: moe_aux_loss(probs, counts, torch.tensor(t, device="cuda"), e, 8, 1e-2),
                 lambda: seq_aux_loss(probs, routing_map, 4096, 8, 1e-2),
                 lambda: seq_aux_loss(probs, routing_map, t, 8, 1e-2),
                 lambda: z_loss(logits, 1e-3)):
        first = loss()
        for _ in range(3):
            assert torch.equal(loss(), first)


# Small and large: the backward kernels broadcast the balance losses' gradient rows (one
# sequence, or many) and read z_loss's logits and logsumexp at every size.
OP_GRAD_CASES = [(8192, 256, 4096), (16384, 128, 4096), (333, 60, 111), (1, 8, 1), (16384, 1024, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,seq", OP_GRAD_CASES, ids=[f"T{t}-E{e}-L{s}" for t, e, s in OP_GRAD_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_gradients_match_reference(t, e, seq, dtype):
    # Through the autograd Functions: the backward reuses what the forward kernel kept (unit
    # gradient rows or logsumexp) and writes a contiguous gradient .grad keeps without a copy.
    torch.manual_seed(t * 7 + e)
    probs = torch.softmax(torch.randn(t, e, device="cuda"), -1).to(dtype)
    logits = (torch.randn(t, e, device="cuda") * 4).to(dtype)
    routing_map = torch.rand(t, e, device="cuda") < min(1.0, 8 / e)
    counts = routing_map.sum(0)
    nt = torch.tensor(t, device="cuda")
    ops_fns = [lambda p, l: moe_aux_loss(p, counts, t, e, min(8, e), 1e-2),
               lambda p, l: moe_aux_loss(p, counts, nt, e, min(8, e), 1e-2),
               lambda p, l: seq_aux_loss(p, routing_map, seq, min(8, e), 1e-2),
               lambda p, l: z_loss(l, 1e-3)]
    ref_fns = [lambda p, l: reference.moe_aux_loss(p, counts, t, e, min(8, e), 1e-2),
               lambda p, l: reference.moe_aux_loss(p, counts, nt, e, min(8, e), 1e-2),
               lambda p, l: reference.seq_aux_loss(p, routing_map, seq, min(8, e), 1e-2),
               lambda p, l: reference.z_loss(l, 1e-3)]
    g = torch.tensor(1.7, device="cuda")
    for op, ref in zip(ops_fns, ref_fns):
        p, l = probs.clone().requires_grad_(True), logits.clone().requires_grad_(True)
        rp, rl = probs.clone().requires_grad_(True), logits.clone().requires_grad_(True)
        got, want = op(p, l), ref(rp, rl)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        got.backward(g)
        want.backward(g)
        for a, b in ((p.grad, rp.grad), (l.grad, rl.grad)):
            if b is None:
                assert a is None
                continue
            assert a.is_contiguous() and a.dtype == b.dtype
            # bf16: both round an fp32 gradient computed in a different order: one bf16 ulp
            tol = dict(rtol=1e-5, atol=1e-9) if dtype == torch.float32 else dict(rtol=2.0 ** -7, atol=1e-9)
            torch.testing.assert_close(a, b, **tol)
