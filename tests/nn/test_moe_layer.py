"""qmoe.nn.MoELayer on CPU against the plain PyTorch MoE of tests/nn/plain_moe.py.

fp32: every router option and activation, forward and all gradients, the auxiliary losses,
expert-bias updates and capacity drops. Recipes: within NUMERICS.md of fp32, grouped == split
bit for bit, empty experts get exact zero gradients, hypothesis over routing skew.
"""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import qmoe
from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                          NVFP4BlockScaling)
from qmoe.contracts.carriers import deinterleave_glu
from tests.nn.plain_moe import balance_scores, params_of, plain_moe, plain_route
from tests.nn.recipe_cases import DETERMINISTIC, QUANTIZED
from tests.tolerances import MOE_GEMM_DEPTH, assert_within_tolerance, recipe_tolerance

H, F, E = 32, 16, 8
PARAM_NAMES = ("router", "w1", "b1", "w2", "b2")


def _assert_fp32_close(out, ref, what=""):
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()), msg=what)


def _layer_grads(layer):
    """The layer's gradients named like params_of's (logical layout, stacked over experts)."""
    fc1, fc2 = layer.experts.fc1, layer.experts.fc2

    def stacked(ps):
        if not ps or any(p.grad is None for p in ps):
            return None
        return ps[0].grad if len(ps) == 1 else torch.stack([p.grad for p in ps])

    return {"router": layer.router.weight.grad, "w1": stacked(fc1.weights()), "b1": stacked(fc1.biases()),
            "w2": stacked(fc2.weights()), "b2": stacked(fc2.biases())}


def _run_layer(layer, x, g, recipe=None):
    """y, dx and the layer's gradients for loss = <y, g> + aux_loss."""
    layer.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
        y = layer(x)
    ((y * g).sum() + layer.aux_loss).backward()
    return {"y": y.detach(), "dx": x.grad, "aux": layer.aux_loss.detach(), **_layer_grads(layer)}


def _run_plain(layer, x, g, **options):
    """The same for the plain MoE built from the layer's logical state_dict."""
    params = params_of(layer)
    x = x.detach().clone().requires_grad_(True)
    record = {}
    y, aux, chosen = plain_moe(x, params, layer.top_k, record=record, **options)
    record["probs"].retain_grad()
    ((y * g).sum() + aux).backward()
    out = {"y": y.detach(), "dx": x.grad, "aux": aux.detach(), "chosen": chosen}
    out.update({k: None if v is None else v.grad for k, v in params.items()})
    # The router gradient sums x_t * dlogits_t over tokens, and dlogits cancels (p * (dp - <p, dp>)):
    # fp32 rounding leaves an error of about eps * |x_t| * |dprobs_t| per token, which is the
    # scale its tolerance is measured against (saturated routers have tiny true gradients).
    tokens = x.detach().reshape(-1, H)
    factor = abs(options.get("scaling_factor") or 1.0)
    out["router_scale"] = factor * float((tokens.abs().amax(-1) * record["probs"].grad.abs().amax(-1)).sum())
    return out


def _compare(got, want, names=("y", "dx", "aux") + PARAM_NAMES):
    for k in names:
        if want[k] is None:
            assert got[k] is None, k
        elif k == "router":
            scale = max(float(want[k].abs().max()), want["router_scale"])
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5 * scale, msg=k)
        else:
            _assert_fp32_close(got[k], want[k], k)


def _make(top_k, seed=0, **options):
    torch.manual_seed(seed)
    layer = qmoe.nn.MoELayer(H, F, E, top_k, **options)
    with torch.no_grad():  # spread the router so selections are clear-cut and probabilities varied
        layer.router.weight.mul_(4)
    return layer


def _data(shape, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, H, generator=gen), torch.randn(*shape, H, generator=gen)


# ------------------------------------------------------------------ fp32 == the plain MoE

ROUTER_CASES = [
    ("softmax-k2", 2, dict()),
    ("softmax-k1", 1, dict()),
    ("pre_softmax-k3", 3, dict(pre_softmax=True)),
    ("softmax-scaling", 2, dict(scaling_factor=1.5)),
    ("sigmoid-k2", 2, dict(score_function="sigmoid")),
    ("sigmoid-k1", 1, dict(score_function="sigmoid")),
    ("sqrtsoftplus-k3", 3, dict(score_function="sqrtsoftplus")),
    ("softmax-groups", 2, dict(num_groups=4, group_topk=2)),
    ("deepseek-v3", 4, dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5,
                            expert_bias=True)),
    ("sqrtsoftplus-groups-bias", 2, dict(score_function="sqrtsoftplus", num_groups=2, group_topk=1,
                                         expert_bias=True)),
    ("softmax-bias", 2, dict(expert_bias=True)),
    ("pre_softmax-bias-scaling", 2, dict(pre_softmax=True, expert_bias=True, scaling_factor=0.5)),
    ("deepseek-v3-hf", 3, dict(score_function="sigmoid", num_groups=4, group_topk=2, group_score_topk=2,
                               normalize_topk_probs=False, scaling_factor=2.5, expert_bias=True)),
    ("pre_softmax-normalised", 2, dict(pre_softmax=True, normalize_topk_probs=True)),
    ("sigmoid-k1-normalised", 1, dict(score_function="sigmoid", normalize_topk_probs=True)),
    ("router-bias", 2, dict(router_bias=True)),
]


def _with_bias(layer, options, seed=2):
    """Give the expert-bias buffer values that change selection; returns plain_moe's options."""
    options = dict(options)
    if options.pop("router_bias", False):  # zero at construction: give it values that matter
        with torch.no_grad():
            layer.router.bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(seed)) * 3)
    if options.pop("expert_bias", False):
        bias = torch.randn(E, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            # logits spread about 4, scores and probabilities lie in [0, 1]
            ranks_logits = options.get("score_function") is None and not options.get("pre_softmax")
            layer.router.expert_bias.copy_(bias * (2 if ranks_logits else 0.3))
        options["expert_bias"] = layer.router.expert_bias.clone()
    return options


@pytest.mark.parametrize("name, top_k, options", ROUTER_CASES, ids=[c[0] for c in ROUTER_CASES])
def test_fp32_matches_plain_moe_for_every_router_option(name, top_k, options):
    layer = _make(top_k, bias=True, **options).eval()  # eval: the expert bias stays put
    plain_options = _with_bias(layer, options)
    x, g = _data((40,))
    got = _run_layer(layer, x, g)
    want = _run_plain(layer, x, g, **plain_options)
    _compare(got, want)
    if "expert_bias" in plain_options:  # the bias did shift selection, and only selection
        unbiased = dict(plain_options, expert_bias=None)
        _, chosen_unbiased = plain_route(x @ layer.router.weight.detach().t(), top_k, **unbiased)
        assert not torch.equal(chosen_unbiased, want["chosen"])


SHARED_NAMES = ("router_bias", "shared_w1", "shared_w2", "shared_gate")


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
@pytest.mark.parametrize("gate", [False, True], ids=["ungated", "gated"])
def test_shared_experts_match_plain_moe(activation, gate):
    layer = _make(2, activation=activation, shared_expert_ffn_hidden_size=24, shared_expert_gate=gate,
                  router_bias=True)
    options = _with_bias(layer, dict(router_bias=True))
    assert layer.state_dict()["shared_experts.fc1.weight"].shape == ((2 if activation == "swiglu" else 1) * 24, H)
    assert ("shared_expert_gate.weight" in layer.state_dict()) == gate
    x, g = _data((3, 7))
    got = _run_layer(layer, x, g)
    sh = layer.shared_experts
    got.update(router_bias=layer.router.bias.grad, shared_w1=sh.fc1.weight.grad, shared_w2=sh.fc2.weight.grad,
               shared_gate=layer.shared_expert_gate.weight.grad if gate else None)
    want = _run_plain(layer, x, g, activation=activation, **options)
    _compare(got, want, ("y", "dx") + PARAM_NAMES + SHARED_NAMES)


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_shared_experts_under_recipes(recipe):
    layer = _make(2, shared_expert_ffn_hidden_size=32, shared_expert_gate=True)
    x, g = _data((64,))
    ref = _run_layer(layer, x, g)
    got = _run_layer(layer, x, g, recipe)
    if isinstance(recipe, DelayedScaling):
        got = _run_layer(layer, x, g, recipe)
    rtol, atol = recipe_tolerance(recipe)
    for k, n in (("y", 2), ("dx", 3)):
        assert_within_tolerance(got[k], ref[k], rtol * math.sqrt(n), atol * math.sqrt(n), k)


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "clamped_qgeglu", "relu2", "gelu"])
@pytest.mark.parametrize("router", ["softmax-k2", "deepseek-v3"])
def test_fp32_matches_plain_moe_for_every_activation(activation, router):
    top_k, options = next((k, o) for n, k, o in ROUTER_CASES if n == router)
    layer = _make(top_k, activation=activation, bias=True, **options).eval()
    with torch.no_grad():  # reach the clamps of clamped_qgeglu and the negative side of relu2
        layer.experts.fc1.weight.mul_(8)
    plain_options = _with_bias(layer, options)
    x, g = _data((2, 12))
    got = _run_layer(layer, x, g)
    want = _run_plain(layer, x, g, activation=activation, **plain_options)
    _compare(got, want)


@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 2, 3)], ids=["1-d", "2-d", "3-d", "4-d"])
def test_any_leading_shape(shape):
    layer = _make(2)
    x, g = _data(shape)
    got = _run_layer(layer, x, g)
    assert got["y"].shape == x.shape
    want = _run_plain(layer, x, g)
    _compare(got, want)


@pytest.mark.parametrize("recipe", [None, MXFP8BlockScaling(), NVFP4BlockScaling()], ids=["fp32", "mxfp8", "nvfp4"])
def test_empty_batch(recipe):
    layer = _make(2, bias=True)
    got = _run_layer(layer, torch.zeros(0, H), torch.zeros(0, H), recipe)
    assert got["y"].shape == got["dx"].shape == (0, H)
    for k in PARAM_NAMES:
        assert torch.equal(got[k], torch.zeros_like(got[k])), k


def test_bf16_layer_within_bf16_tolerance_and_router_in_fp32():
    layer = _make(2, bias=True, aux_loss_coeff=0.1)
    x, g = _data((2, 16))
    want = _run_plain(layer, x, g, aux_loss_coeff=0.1)
    low = _make(2, bias=True, aux_loss_coeff=0.1, params_dtype=torch.bfloat16)
    low.load_state_dict(layer.state_dict())
    assert low.router.weight.dtype == torch.float32 and low.experts.fc1.weight.dtype == torch.bfloat16
    got = _run_layer(low, x.bfloat16(), g.bfloat16())
    assert got["y"].dtype == got["dx"].dtype == got["w1"].dtype == torch.bfloat16
    assert got["router"].dtype == torch.float32
    rtol, atol = recipe_tolerance(None)
    for k in ("y", "dx") + PARAM_NAMES:
        assert_within_tolerance(got[k], want[k], rtol, atol, k)


def test_topk_router_selects_in_fp32():
    torch.manual_seed(3)
    router = qmoe.nn.TopKRouter(H, E, 2, score_function="sigmoid")
    x = torch.randn(64, H).bfloat16()
    probs, routing_map = router(x)
    assert probs.dtype == torch.float32 and routing_map.dtype == torch.bool
    want_probs, want_map = plain_route(x.float() @ router.weight.detach().t(), 2, "sigmoid")
    assert torch.equal(routing_map, want_map)
    _assert_fp32_close(probs.detach(), want_probs)
    assert torch.equal(router.tokens_per_expert, want_map.sum(0))


def test_without_bias_the_bias_gradients_are_absent():
    layer = _make(2)
    assert layer.experts.fc1.bias is None and layer.experts.fc2.bias is None
    x, g = _data((16,))
    _compare(_run_layer(layer, x, g), _run_plain(layer, x, g))


# ------------------------------------------------------------------ auxiliary losses

AUX_CASES = [
    ("aux", dict(aux_loss_coeff=0.1)),
    ("seq_aux", dict(seq_aux_loss_coeff=0.1)),
    ("z_loss", dict(z_loss_coeff=0.01)),
    ("all", dict(aux_loss_coeff=0.1, seq_aux_loss_coeff=0.2, z_loss_coeff=0.01)),
    ("all-sigmoid", dict(aux_loss_coeff=0.1, seq_aux_loss_coeff=0.2, z_loss_coeff=0.01,
                         score_function="sigmoid")),
    ("all-sqrtsoftplus-capacity", dict(aux_loss_coeff=0.1, seq_aux_loss_coeff=0.2, score_function="sqrtsoftplus",
                                       capacity_factor=0.75)),
]


def _independent_aux(x, layer, coeffs, score_function="softmax"):
    """The losses straight from their formulas (issue 6 / Switch / DeepSeek), via the plain routing."""
    b, s, _ = x.shape
    logits = x.reshape(-1, H) @ layer.router.weight.t()
    _, chosen = plain_route(logits, layer.top_k, score_function)
    p = balance_scores(logits, score_function)
    t, k = b * s, layer.top_k
    counts = chosen.sum(0).float()
    loss = coeffs.get("aux_loss_coeff", 0) * E * (p.sum(0) * counts).sum() / (k * t * t)
    seq = 0
    for i in range(b):
        c = chosen[i * s:(i + 1) * s].sum(0).float()
        seq = seq + (E / (k * s) * c * p[i * s:(i + 1) * s].mean(0)).sum()
    loss = loss + coeffs.get("seq_aux_loss_coeff", 0) * seq / b
    return loss + coeffs.get("z_loss_coeff", 0) * torch.logsumexp(logits, -1).square().mean()


@pytest.mark.parametrize("name, options", AUX_CASES, ids=[c[0] for c in AUX_CASES])
def test_aux_losses_match_formulas_and_backprop(name, options):
    layer = _make(2, **options)
    x, g = _data((3, 10))  # [B, S, H]: the sequence loss sees 3 sequences of 10
    got = _run_layer(layer, x, g)
    want = _run_plain(layer, x, g, **options)
    _compare(got, want)
    assert got["aux"] > 0
    if "capacity_factor" not in options:
        coeffs = {k: v for k, v in options.items() if k.endswith("coeff")}
        fn = options.get("score_function", "softmax")
        formula = _independent_aux(x, layer, coeffs, fn)
        _assert_fp32_close(got["aux"], formula.detach(), "aux vs formula")

    # the loss alone reaches the router weight (and nothing else)
    layer.zero_grad()
    layer(x)
    layer.aux_loss.backward()
    params = params_of(layer)
    _, aux, _ = plain_moe(x, params, 2, **options)
    aux.backward()
    _assert_fp32_close(layer.router.weight.grad, params["router"].grad, "d aux / d router")
    assert layer.experts.fc1.weight.grad is None


def test_sequence_loss_reads_batch_major_sequences():
    layer = _make(2, seq_aux_loss_coeff=1.0)
    x, _ = _data((4, 6))
    layer(x)
    per_sequence = layer.aux_loss.clone()
    layer(x.reshape(24, H))  # 2-D: one sequence of all tokens
    one_sequence = layer.aux_loss.clone()
    layer(x.transpose(0, 1))  # [6, 4, H]: other sequences
    transposed = layer.aux_loss.clone()
    _, aux, _ = plain_moe(x, params_of(layer, False), 2, seq_aux_loss_coeff=1.0)
    _assert_fp32_close(per_sequence, aux)
    assert not torch.isclose(per_sequence, one_sequence) and not torch.isclose(per_sequence, transposed)


def test_disabled_aux_loss_is_a_zero_scalar():
    layer = _make(2)
    x, g = _data((8,))
    layer(x)
    assert layer.aux_loss.shape == () and layer.aux_loss.item() == 0.0


# ------------------------------------------------------------------ expert bias and capacity

def test_expert_bias_updates_in_training_only():
    rate = qmoe.nn.TopKRouter(H, E, 2).expert_bias_update_rate
    layer = _make(2, score_function="sigmoid", expert_bias=True)
    assert layer.router.expert_bias is not None and torch.equal(layer.router.expert_bias, torch.zeros(E))
    assert "router.expert_bias" in layer.state_dict()
    x, g = _data((32,))
    for step in range(3):  # training: every forward selects with the old bias, then moves it
        before = layer.router.expert_bias.clone()
        got = _run_layer(layer, x, g)
        want = _run_plain(layer, x, g, score_function="sigmoid", expert_bias=before)
        _compare(got, want)
        counts = want["chosen"].sum(0).float()
        assert counts.max() > counts.min()  # unbalanced, so the update is not zero
        expected = before + rate * torch.sign(counts.mean() - counts)
        torch.testing.assert_close(layer.router.expert_bias, expected, rtol=0, atol=0)
        assert torch.equal(layer.router.tokens_per_expert, want["chosen"].sum(0))
    layer.eval()
    frozen = layer.router.expert_bias.clone()
    with torch.no_grad():
        layer(x)
    layer(x)
    assert torch.equal(layer.router.expert_bias, frozen)


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_factor_drops_the_lowest_probabilities(factor):
    layer = _make(2, capacity_factor=factor, aux_loss_coeff=0.1, bias=True)
    with torch.no_grad():  # skew: most tokens want expert 3
        layer.router.weight[3] += 0.5
    x, g = _data((40,))
    got = _run_layer(layer, x, g)
    want = _run_plain(layer, x, g, capacity_factor=factor, aux_loss_coeff=0.1)
    _compare(got, want)
    capacity = math.ceil(40 * 2 * factor / E)
    dropless = _run_plain(layer, x, g, aux_loss_coeff=0.1)["chosen"]
    assert want["chosen"].sum(0).max() == capacity
    assert dropless.sum() > want["chosen"].sum()  # something was dropped
    assert torch.equal(layer.router.tokens_per_expert, want["chosen"].sum(0))


# ------------------------------------------------------------------ recipes

RECIPES = QUANTIZED


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_within_numerics_tolerance_of_fp32(recipe):
    layer = _make(2, bias=True, aux_loss_coeff=0.1)
    x, g = _data((2, 16))
    want = _run_plain(layer, x, g, aux_loss_coeff=0.1)
    if isinstance(recipe, DelayedScaling):  # fresh scales are 1: a warm-up step records the amaxes
        _run_layer(layer, x, g, recipe)
    got = _run_layer(layer, x, g, recipe)
    _assert_fp32_close(got["aux"], want["aux"], "aux")  # the router is fp32 under every recipe
    for k in ("y", "dx") + PARAM_NAMES:
        assert_within_tolerance(got[k], want[k], *recipe_tolerance(recipe, MOE_GEMM_DEPTH[k]), k)
    assert not torch.equal(got["y"], want["y"])  # it did quantize
    # the output, and for FP8 every gradient too, meets NUMERICS.md's tolerance as it stands
    flat = ("y", "b2") if isinstance(recipe, NVFP4BlockScaling) else ("y", "dx") + PARAM_NAMES
    for k in flat:
        assert_within_tolerance(got[k], want[k], *recipe_tolerance(recipe), k)


def _grouped_and_split(recipe, top_k=2, x=None, g=None, steps=1, **options):
    results = []
    for path in ("grouped", "split"):
        layer = _make(top_k, bias=True, grouped_path=path, **options)
        for _ in range(steps):
            out = _run_layer(layer, x, g, recipe)
        results.append(out)
    return results


@pytest.mark.parametrize("recipe", DETERMINISTIC)
def test_grouped_path_equals_split_path(recipe):
    x, g = _data((24,))
    steps = 2 if isinstance(recipe, DelayedScaling) else 1  # the second step uses recorded amaxes
    grouped, split = _grouped_and_split(recipe, x=x, g=g, steps=steps, aux_loss_coeff=0.1)
    for k in ("y", "dx", "aux") + PARAM_NAMES:
        assert torch.equal(grouped[k], split[k]), k


def _kill_expert(layer, dead):
    """Inputs get feature 0 = 1 + |.|; the dead expert's router row reads only it, strongly negative."""
    with torch.no_grad():
        layer.router.weight[dead] = 0
        layer.router.weight[dead, 0] = -100


@pytest.mark.parametrize("recipe", [None] + RECIPES)
@pytest.mark.parametrize("dead", [0, 5, E - 1], ids=["first", "middle", "last"])
def test_expert_without_tokens_gets_exact_zero_gradients(recipe, dead):
    layer = _make(2, bias=True, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    _kill_expert(layer, dead)
    x, g = _data((24,))
    x[:, 0] = 1 + x[:, 0].abs()
    got = _run_layer(layer, x, g, recipe)
    assert layer.router.tokens_per_expert[dead] == 0
    assert all(torch.isfinite(v).all() for v in got.values() if v is not None)
    for k in ("w1", "b1", "w2", "b2"):
        assert torch.equal(got[k][dead], torch.zeros_like(got[k][dead])), k
        alive = [e for e in range(E) if e != dead and layer.router.tokens_per_expert[e] > 0]
        assert all(got[k][e].abs().sum() > 0 for e in alive), k


# ------------------------------------------------------------------ hypothesis: routing skew

@st.composite
def skews(draw):
    """Router logits biased towards one expert, from balanced to all tokens on it."""
    return dict(
        tokens=draw(st.integers(1, 24)),
        hot=draw(st.integers(0, E - 1)),
        strength=draw(st.sampled_from([0.0, 1.0, 4.0, 30.0, 200.0])),
        top_k=draw(st.sampled_from([1, 2, 3])),
        score_function=draw(st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"])),
        bias_on_selection=draw(st.booleans()),
        seed=draw(st.integers(0, 2 ** 16)),
    )


def _skewed(case, **options):
    layer = _make(case["top_k"], seed=case["seed"], score_function=case["score_function"],
                  expert_bias=case["bias_on_selection"], **options).eval()
    gen = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["tokens"], H, generator=gen)
    x[:, 0] = 1 + x[:, 0].abs()
    g = torch.randn(case["tokens"], H, generator=gen)
    with torch.no_grad():
        if case["bias_on_selection"]:  # skew the selection only
            layer.router.expert_bias[case["hot"]] = case["strength"]
        else:  # skew the logits (and so the probabilities)
            layer.router.weight[case["hot"], 0] += case["strength"]
    return layer, x, g


@given(case=skews())
def test_fp32_matches_plain_moe_under_routing_skew(case):
    layer, x, g = _skewed(case, bias=True)
    bias = layer.router.expert_bias
    got = _run_layer(layer, x, g)
    want = _run_plain(layer, x, g, score_function=case["score_function"],
                      expert_bias=None if bias is None else bias.clone())
    _compare(got, want)
    if case["strength"] == 200:
        assert want["chosen"][:, case["hot"]].all()  # every token chose the hot expert
    empty = (want["chosen"].sum(0) == 0).nonzero().flatten().tolist()
    for k in ("w1", "b1", "w2", "b2"):
        assert torch.isfinite(got[k]).all()
        for e in empty:
            assert torch.equal(got[k][e], torch.zeros_like(got[k][e])), (k, e)


@settings(max_examples=8)
@given(case=skews(), recipe=st.sampled_from([DelayedScaling(), Float8CurrentScaling(), Float8BlockScaling(),
                                              MXFP8BlockScaling(),
                                              NVFP4BlockScaling(disable_stochastic_rounding=True)]))
def test_recipes_under_routing_skew(case, recipe):
    """Skewed routing under a recipe: finite, empty experts exactly zero, grouped == split."""
    results = []
    for path in ("grouped", "split"):
        layer, x, g = _skewed(case, bias=True, grouped_path=path)
        results.append(_run_layer(layer, x, g, recipe))
    counts = layer.router.tokens_per_expert
    for k in ("y", "dx") + PARAM_NAMES:
        assert torch.isfinite(results[0][k]).all(), k
        assert torch.equal(results[0][k], results[1][k]), k
    for k in ("w1", "b1", "w2", "b2"):
        for e in (counts == 0).nonzero().flatten().tolist():
            assert torch.equal(results[0][k][e], torch.zeros_like(results[0][k][e])), (k, e)


# ------------------------------------------------------------------ delayed wgrad, interleaving, bad input

def test_delay_wgrad_compute_equals_normal_backward():
    normal = _make(2, bias=True)
    delayed = _make(2, bias=True, delay_wgrad_compute=True)
    delayed.load_state_dict(normal.state_dict())
    calls = []
    delayed.experts.fc1.weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    x, g = _data((16,))
    want = _run_layer(normal, x, g)
    got = _run_layer(delayed, x, g)
    assert got["w1"] is None and got["w2"] is None and calls == []
    delayed.backward_dw()
    got.update(_layer_grads(delayed))
    for k in ("y", "dx") + PARAM_NAMES:
        assert torch.equal(got[k], want[k]), k
    assert len(calls) == 1 and torch.equal(calls[0], want["w1"])


def test_glu_interleave_gives_the_same_layer():
    plain = _make(2, bias=True)
    inter = _make(2, bias=True, glu_interleave_size=4)
    inter.load_state_dict(plain.state_dict())
    sd = inter.state_dict()
    assert all(torch.equal(sd[k], v) if isinstance(v, torch.Tensor) else sd[k] == v
               for k, v in plain.state_dict().items())
    x, g = _data((20,))
    got, want = _run_layer(inter, x, g), _run_plain(plain, x, g)
    assert not torch.equal(inter.experts.fc1.weight, plain.experts.fc1.weight)  # physically interleaved
    got["w1"] = deinterleave_glu(got["w1"], 4)
    got["b1"] = deinterleave_glu(got["b1"][..., None], 4)[..., 0]
    _compare(got, want)


@pytest.mark.parametrize("build, call, exc", [
    (lambda: _make(2), lambda m: m(torch.randn(4, H + 1)), ValueError),
    (lambda: _make(2), lambda m: m(torch.randint(0, 3, (4, H))), TypeError),
    (lambda: _make(2), lambda m: m(torch.tensor(1.0)), ValueError),
    (lambda: _make(2), lambda m: m([[0.0] * H]), TypeError),
    (lambda: _make(E + 1), None, ValueError),
    (lambda: _make(2, activation="silu"), None, ValueError),
    (lambda: _make(2, score_function="tanh"), None, ValueError),
    (lambda: _make(2, aux_loss_coeff=-1.0), None, ValueError),
    (lambda: _make(2, score_function="sigmoid", pre_softmax=True), lambda m: m(torch.randn(4, H)), ValueError),
    (lambda: _make(2, num_groups=3, group_topk=1), lambda m: m(torch.randn(4, H)), ValueError),
    (lambda: _make(2, num_groups=4), lambda m: m(torch.randn(4, H)), ValueError),
    (lambda: _make(2, capacity_factor=0.0), lambda m: m(torch.randn(4, H)), ValueError),
    (lambda: _make(2, group_score_topk=2), None, ValueError),
    (lambda: _make(2, normalize_topk_probs=False), None, ValueError),
    (lambda: _make(2, shared_expert_gate=True), None, ValueError),
    (lambda: _make(2, shared_expert_ffn_hidden_size=0), None, ValueError),
], ids=["hidden", "int-input", "0-d", "list", "top_k", "activation", "score_function", "coeff",
        "pre_softmax-sigmoid", "groups-not-dividing", "groups-without-topk", "capacity", "score-topk-no-groups",
        "unnormalised-softmax", "gate-without-shared", "shared-size"])
def test_bad_input_raises(build, call, exc):
    with pytest.raises(exc):
        layer = build()
        call(layer)
