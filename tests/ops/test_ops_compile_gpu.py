"""Each op family compiled on the GPU (torch.compile, fullgraph) equals eager, forward and backward.

AOTAutograd (backend="aot_eager") runs the very kernels eager runs (each launcher is one opaque
op, kernels/launch.KernelOp), so results must be bit-identical; Inductor may fuse the
torch glue around them, so it gets fp32 tolerance.

The scaled-bias case caught a real failure (H200, torch 2.11): the grouped bias forward was
torch glue ending in a no-op `.to(fp32)`, so the autograd.Function's output aliased an
intermediate and AOTAutograd gave it a zero gradient (the backward graph fed zeros to the dgrad
GEMM). The forward is a kernel op now
(kernels/bias.py), and the reference no longer returns an alias.
"""
from __future__ import annotations

import pytest
import torch

import qmoe.ops as ops

pytestmark = pytest.mark.gpu

DEV = "cuda"
T, H, N, E, K = 96, 64, 48, 4, 2


def _inputs(seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return {
        "logits": torch.randn(T, E, device=DEV, generator=g),
        "x": torch.randn(T, H, device=DEV, generator=g),
        "w": torch.randn(E, N, H, device=DEV, generator=g) * 0.1,
        "b": torch.randn(E, N, device=DEV, generator=g),
        "dy": torch.randn(T * K, N, device=DEV, generator=g),
        "dout": torch.randn(T, H, device=DEV, generator=g),
    }


def _route(t):
    probs, routing_map = ops.topk_route(t["logits"], K)
    return probs, routing_map


def route_only(t):
    probs, _ = _route(t)
    return (probs * torch.arange(1.0, E + 1, device=DEV)).sum(), [probs]


def permute_unpermute(t):
    probs, routing_map = _route(t)
    rows, row_probs, row_id_map, split_sizes = _permute(t["x"], routing_map, probs)
    out = ops.moe_unpermute(rows * 2.0, row_id_map, probs)
    return (out * t["dout"]).sum(), [out, rows, row_probs]


def _permute(x, routing_map, probs):
    out = ops.moe_permute(x, routing_map, probs, top_k=K)
    return out[0], out[1], out[2], out[3]


def grouped_gemm(t):
    probs, routing_map = _route(t)
    rows, _, row_id_map, split_sizes = _permute(t["x"], routing_map, probs)
    y = ops.grouped_linear(rows, split_sizes, t["w"])
    return (y * t["dy"][: y.shape[0]]).sum(), [y]


def grouped_gemm_scaled_bias(t):
    """Bias scaled per row by the routing prob: the bias kernels, and split sizes read by torch glue."""
    probs, routing_map = _route(t)
    rows, row_probs, row_id_map, split_sizes = _permute(t["x"], routing_map, probs)
    y = ops.grouped_linear(rows, split_sizes, t["w"], t["b"], scales=row_probs)
    out = ops.moe_unpermute(y, row_id_map)
    return (y * t["dy"][: y.shape[0]]).sum() + out.square().sum(), [y, out]


def activation(t):
    h = torch.cat([t["x"], t["x"].flip(0)], 1)
    a = ops.expert_activation(h, t["logits"][:, 0].sigmoid(), "swiglu")
    return (a * t["dout"]).sum(), [a]


def aux_losses(t):
    probs, routing_map = _route(t)
    tokens = routing_map.sum(0)
    aux = ops.moe_aux_loss(probs, tokens, T, E, K, 0.1)
    z = ops.z_loss(t["logits"], 0.01)
    return aux + z, [aux, z]


LEAVES = ("logits", "x", "w", "b")
CASES = {f.__name__: f for f in (route_only, permute_unpermute, grouped_gemm, grouped_gemm_scaled_bias, activation,
                                  aux_losses)}


def _run(fn, t):
    leaves = {k: v.detach().clone().requires_grad_(k in LEAVES) for k, v in t.items()}
    loss, outs = fn(leaves)
    loss.backward()
    grads = [leaves[k].grad for k in LEAVES]
    return [o.detach() for o in outs] + [gr if gr is not None else torch.zeros(()) for gr in grads]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", list(CASES))
def test_op_compiles_to_eager_results(case, backend):
    torch._dynamo.reset()
    t = _inputs()
    want = _run(CASES[case], t)
    compiled = torch.compile(CASES[case], backend=backend, fullgraph=True)
    got = _run(compiled, t)
    names = [f"out{i}" for i in range(len(want) - len(LEAVES))] + [f"d{k}" for k in LEAVES]
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        if backend == "aot_eager":
            assert torch.equal(g, w), f"{name}: max diff {(g.float() - w.float()).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=name)
