"""qmoe.nn.GroupedMLP on CPU: every activation against the plain expert loop, the prob's place and
gradient, padding rows, GLU interleaving (same numbers, logical state_dict) and delayed wgrad."""
import pytest
import torch

import qmoe
from qmoe.contracts.carriers import deinterleave_glu, interleave_glu
from tests.nn.plain_moe import GLU, plain_activation

E, H, F = 3, 32, 16
ACTIVATIONS = ["swiglu", "geglu", "clamped_qgeglu", "relu2", "gelu"]


def _assert_fp32_close(out, ref, what=""):
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()), msg=what)


def _plain_mlp(x, splits, probs, w1, b1, w2, b2, activation):
    """Row r of group g: probs[r] * (act(x_r W1_g^T + b1_g) W2_g^T + b2_g); last group takes the tail."""
    out, start = [], 0
    for g, m in enumerate(splits.tolist()):
        end = x.shape[0] if g == len(splits) - 1 else start + m
        h = plain_activation(x[start:end] @ w1[g].t() + b1[g], activation)
        out.append(probs[start:end, None] * (h @ w2[g].t() + b2[g]))
        start = end
    return torch.cat(out)


def _leaves(mlp):
    sd = mlp.state_dict()
    return [sd[k].clone().requires_grad_(True) for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]


def _inputs(rows=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, H, generator=gen) * 2  # wide enough to reach the clamps of clamped_qgeglu
    probs = torch.rand(rows, generator=gen)
    return x, probs, torch.randn(rows, H, generator=gen)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("path", ["grouped", "split"])
def test_matches_plain_expert_loop(activation, path):
    torch.manual_seed(0)
    mlp = qmoe.nn.GroupedMLP(E, H, F, activation=activation, bias=True, grouped_path=path)
    assert mlp.fc1.weight.shape == (E, (2 if activation in GLU else 1) * F, H)
    with torch.no_grad():
        mlp.fc1.weight.mul_(4)
    splits = torch.tensor([9, 0, 12])
    x, probs, g = _inputs()
    if activation == "clamped_qgeglu":
        h = torch.einsum("rh,nh->rn", x[:9], mlp.fc1.weight[0].detach())
        assert (h[:, :F] > 7).any() and (h[:, F:].abs() > 7).any()  # both clamps are exercised
    xs, ps = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    y = mlp(xs, splits, ps)
    y.backward(g)
    xr, pr = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    leaves = _leaves(mlp)
    ref = _plain_mlp(xr, splits, pr, *leaves, activation)
    ref.backward(g)
    _assert_fp32_close(y.detach(), ref.detach(), "y")
    _assert_fp32_close(xs.grad, xr.grad, "dx")
    _assert_fp32_close(ps.grad, pr.grad, "dprobs")
    params = [mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]
    for name, p, leaf in zip(("dW1", "db1", "dW2", "db2"), params, leaves):
        _assert_fp32_close(p.grad, leaf.grad, name)


def test_without_probs_is_prob_one():
    torch.manual_seed(1)
    mlp = qmoe.nn.GroupedMLP(E, H, F, bias=True)
    x, _, _ = _inputs()
    splits = torch.tensor([10, 4, 10])
    torch.testing.assert_close(mlp(x, splits), mlp(x, splits, torch.ones(24)), rtol=0, atol=0)


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_padding_rows_with_prob_zero_come_out_zero(activation):
    """fc1's bias makes act(h) nonzero on zero rows; the prob (and fc2's prob-scaled bias) zeroes them."""
    torch.manual_seed(2)
    mlp = qmoe.nn.GroupedMLP(E, H, F, activation=activation, bias=True)
    with torch.no_grad():
        mlp.fc1.bias.fill_(1.0)
    x, probs, g = _inputs()
    pad = torch.tensor([3, 4, 5, 11, 20, 21, 22, 23])
    x[pad] = 0
    probs[pad] = 0
    x.requires_grad_(True)
    y = mlp(x, torch.tensor([6, 6, 8]), probs)
    assert torch.equal(y[pad], torch.zeros(len(pad), H))
    y.backward(g)
    assert torch.equal(x.grad[pad], torch.zeros(len(pad), H))


# ------------------------------------------------------------------ GLU interleaving

def test_interleave_helpers_layout_and_inverse():
    w = torch.arange(8.0)[:, None].expand(8, 2)  # rows gate 0..3, linear 4..7
    got = interleave_glu(w, 2)[:, 0].tolist()
    assert got == [0, 1, 4, 5, 2, 3, 6, 7]
    assert torch.equal(deinterleave_glu(interleave_glu(w, 2), 2), w)
    stack = torch.randn(3, 16, 5)
    assert torch.equal(deinterleave_glu(interleave_glu(stack, 4), 4), stack)
    with pytest.raises(ValueError):
        interleave_glu(torch.randn(12, 3), 4)


@pytest.mark.parametrize("activation", GLU)
@pytest.mark.parametrize("single", [True, False], ids=["single", "per-expert"])
@pytest.mark.parametrize("block", [1, 4])
def test_glu_interleave_same_numbers_and_logical_state_dict(activation, single, block):
    torch.manual_seed(3)
    logical = qmoe.nn.GroupedMLP(E, H, F, activation=activation, bias=True, single_grouped_weight=single)
    inter = qmoe.nn.GroupedMLP(E, H, F, activation=activation, bias=True, single_grouped_weight=single,
                               glu_interleave_size=block)
    inter.load_state_dict(logical.state_dict())
    sd, want = inter.state_dict(), logical.state_dict()
    assert list(sd) == list(want)
    for k in want:
        if k.endswith("_extra_state"):  # the recipe state: none yet
            assert sd[k] == want[k] == {"version": 1, "recipes": []}, k
        else:
            assert torch.equal(sd[k], want[k]), k
    # physically interleaved: alternating `block`-row gate / linear blocks
    w_phys, w_log = inter.fc1.stacked_weight().detach(), logical.fc1.stacked_weight().detach()
    b_phys, b_log = inter.fc1.stacked_bias().detach(), logical.fc1.stacked_bias().detach()
    assert torch.equal(w_phys[:, :block], w_log[:, :block])
    assert torch.equal(w_phys[:, block:2 * block], w_log[:, F:F + block])
    assert torch.equal(b_phys[:, block:2 * block], b_log[:, F:F + block])
    assert not torch.equal(w_phys, w_log)

    x, probs, g = _inputs()
    splits = torch.tensor([7, 0, 17])
    out = {}
    for name, m in (("logical", logical), ("inter", inter)):
        xs, ps = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        y = m(xs, splits, ps)
        y.backward(g)
        dw1, db1 = m.fc1.stacked_weight().grad if single else torch.stack([p.grad for p in m.fc1.weights()]), \
            m.fc1.stacked_bias().grad if single else torch.stack([p.grad for p in m.fc1.biases()])
        if m is inter:
            dw1, db1 = deinterleave_glu(dw1, block), deinterleave_glu(db1[..., None], block)[..., 0]
        out[name] = [y.detach(), xs.grad, ps.grad, dw1, db1]
    for what, a, b in zip(("y", "dx", "dprobs", "dW1", "db1"), out["inter"], out["logical"]):
        _assert_fp32_close(a, b, what)

    back = qmoe.nn.GroupedMLP(E, H, F, activation=activation, bias=True, single_grouped_weight=not single)
    back.load_state_dict(inter.state_dict())  # the logical form loads into any layout
    assert torch.equal(back.fc1.stacked_weight(), w_log)


def test_glu_interleave_argument_checks():
    with pytest.raises(ValueError, match="GLU"):
        qmoe.nn.GroupedMLP(E, H, F, activation="relu2", glu_interleave_size=4)
    with pytest.raises(ValueError, match="divisor"):
        qmoe.nn.GroupedMLP(E, H, F, glu_interleave_size=5)
    with pytest.raises(ValueError, match="divisor"):
        qmoe.nn.GroupedMLP(E, H, F, glu_interleave_size=0)


# ------------------------------------------------------------------ delayed weight gradients and bad input

def test_delay_wgrad_compute_equals_normal_backward():
    torch.manual_seed(4)
    normal = qmoe.nn.GroupedMLP(E, H, F, bias=True)
    delayed = qmoe.nn.GroupedMLP(E, H, F, bias=True, delay_wgrad_compute=True)
    delayed.load_state_dict(normal.state_dict())
    x, probs, g = _inputs()
    splits = torch.tensor([8, 8, 8])
    for m in (normal, delayed):
        m(x, splits, probs.clone().requires_grad_(True)).backward(g)
    assert delayed.fc1.weight.grad is None and delayed.fc2.weight.grad is None
    delayed.backward_dw()
    for (name, a), b in zip(normal.named_parameters(), delayed.parameters()):
        assert torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize("call", [
    lambda m: m(torch.randn(6, H), torch.tensor([2, 2, 2]), torch.rand(5)),
    lambda m: m(torch.randn(6, H), torch.tensor([2, 2, 2]), torch.ones(6, dtype=torch.int64)),
    lambda m: m(torch.randn(6, H + 1), torch.tensor([2, 2, 2]), torch.rand(6)),
    lambda m: m(torch.randn(6, H), torch.tensor([2, 2]), torch.rand(6)),
], ids=["probs-shape", "int-probs", "hidden", "splits-shape"])
def test_bad_input_raises(call):
    with pytest.raises(ValueError):
        call(qmoe.nn.GroupedMLP(E, H, F))


def test_unknown_activation_raises():
    with pytest.raises(ValueError, match="activation"):
        qmoe.nn.GroupedMLP(E, H, F, activation="silu")
