"""The weight cache under CUDA graphs (`qmoe.quant.capture_weights`, `qmoe.graph.capture(...,
keep_weights=True)`): a "keep" capture quantizes and keeps, "reuse" captures read what it kept,
plain captures keep nothing, and the graphed training loop gives the eager loop's bits.

The CPU tests simulate a capture in progress (the capture check reports one); the GPU tests
capture and replay for real.
"""
import contextlib
import copy
import pickle

import pytest
import torch

import qmoe
import qmoe.ops.grouped_linear_paths as paths
import qmoe.quant.weight_cache as weight_cache
from qmoe.graph import GraphedModule
from qmoe.quant import capture_weights, clear_weight_caches
from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                          NVFP4BlockScaling)
from tests.nn.loop_cases import E, F, H, SPLITS


@pytest.fixture
def capturing(monkeypatch):
    monkeypatch.setattr(weight_cache, "_capturing", lambda: True)


def _layer():
    torch.manual_seed(0)
    return qmoe.nn.GroupedLinear(E, H, F, bias=False, cache_quantized_weights=True)


def _forward(layer, x, recipe=Float8CurrentScaling()):
    with qmoe.autocast(recipe=recipe):
        return layer(x, torch.tensor(SPLITS))


def test_keep_then_reuse(capturing, weight_quantizations):
    layer = _layer()
    x = torch.randn(sum(SPLITS), H)
    with capture_weights("keep"):
        kept_y = _forward(layer, x)
        assert torch.equal(_forward(layer, x), kept_y)  # a recompute in the same capture reads what it kept
    cache = layer.weight_cache
    assert len(weight_quantizations) == 1 and cache.kept_for_graphs is not None
    assert cache.kept is None and cache.captured
    with capture_weights("reuse"):
        with torch.no_grad():
            layer.weight.mul_(2)  # a graph cannot see versions: the reuse graph reads the kept buffers
        assert torch.equal(_forward(layer, x), kept_y)
    assert len(weight_quantizations) == 1
    with capture_weights("keep"):  # a new keep capture quantizes again, replacing the kept result
        y = _forward(layer, x)
    assert len(weight_quantizations) == 2 and not torch.equal(y, kept_y)


def test_what_reuse_does_not_find_it_quantizes(capturing, weight_quantizations):
    layer = _layer()
    x = torch.randn(sum(SPLITS), H)
    with capture_weights("reuse"):  # nothing kept yet
        _forward(layer, x)
    assert len(weight_quantizations) == 1 and layer.weight_cache.kept_for_graphs is None
    with capture_weights("keep"):
        _forward(layer, x)
    with capture_weights("reuse"):
        _forward(layer, x, Float8BlockScaling())  # another recipe: another quantizer
        layer.weight = torch.nn.Parameter(layer.weight.detach().clone())  # another weight
        _forward(layer, x)
    assert len(weight_quantizations) == 4


def test_plain_captures_keep_nothing(capturing, weight_quantizations):
    layer = _layer()
    x = torch.randn(sum(SPLITS), H)
    for _ in range(2):
        _forward(layer, x)  # a capture outside capture_weights
    assert len(weight_quantizations) == 2 and layer.weight_cache.kept_for_graphs is None


def test_delayed_scaling_reuses_within_a_region_and_records_each_reuse(capturing, weight_quantizations,
                                                                       monkeypatch):
    """Delayed scaling under one region: keep, then reuse with the weight's amax recorded again (a
    run without the cache records it at every quantize); the update at the region's exit changes
    the cache's stamp, which tells a replayer to replay the keep graph."""
    from qmoe.quant.delayed import DelayedScalingState
    recorded = []
    real = DelayedScalingState.record
    monkeypatch.setattr(DelayedScalingState, "record", lambda st, amax: recorded.append(st) or real(st, amax))
    layer, recipe = _layer(), DelayedScaling()
    x = torch.randn(sum(SPLITS), H)
    with qmoe.autocast(recipe=recipe):
        with capture_weights("keep"):
            kept_y = layer(x, torch.tensor(SPLITS))
        first = list(recorded)  # the input's and the weight's slots
        with capture_weights("reuse"):
            assert torch.equal(layer(x, torch.tensor(SPLITS)), kept_y)
        stamp = layer.weight_cache.graph_stamp()
    assert len(weight_quantizations) == 1 and layer.weight_cache.kept_for_graphs is not None
    assert len(first) == 2 and {id(st) for st in recorded[2:]} == {id(st) for st in first}
    assert layer.weight_cache.graph_stamp() != stamp  # the region's exit updated the scale


def test_eager_calls_after_a_capture_do_not_read_the_graphs_weights(monkeypatch, weight_quantizations):
    layer = _layer()
    x = torch.randn(sum(SPLITS), H)
    monkeypatch.setattr(weight_cache, "_capturing", lambda: True)
    with capture_weights("keep"):
        _forward(layer, x)
    monkeypatch.setattr(weight_cache, "_capturing", lambda: False)
    with torch.no_grad():
        layer.weight.add_(1)
    with capture_weights("reuse"):  # no capture in progress: the role does not apply
        for _ in range(2):
            y = _forward(layer, x)
    plain = qmoe.nn.GroupedLinear(E, H, F, bias=False)
    with torch.no_grad():
        plain.weight.copy_(layer.weight)
    assert torch.equal(y, _forward(plain, x)) and sum(w is layer.weight for w in weight_quantizations) == 3
    assert layer.weight_cache.kept is None


def test_a_reuse_graphs_bf16_copies_stay_its_own(capturing):
    cache = weight_cache.WeightCache()
    w = torch.nn.Parameter(torch.randn(E, F, H))
    q = qmoe.quant.make_quantizer(MXFP8BlockScaling(), "weight")

    def fresh(rowwise, columnwise):
        return paths.quantize_weights(w, q, rowwise=rowwise, columnwise=columnwise)
    with capture_weights("keep"):
        kept = cache.bind([w]).quantize(w, q, True, True, fresh)
    kept.bf16_copies["rowwise"] = torch.zeros(1)
    with capture_weights("reuse"):
        view = cache.bind([w]).quantize(w, q, True, True, fresh)
    assert view is not kept and view.rowwise_data is kept.rowwise_data
    assert view.columnwise_scale_inv is kept.columnwise_scale_inv
    view.bf16_copies["columnwise"] = torch.zeros(1)
    assert view.bf16_copies["rowwise"] is kept.bf16_copies["rowwise"] and set(kept.bf16_copies) == {"rowwise"}


def test_clear_counts_and_copies_start_empty(capturing):
    layer = _layer()
    with capture_weights("keep"):
        _forward(layer, torch.randn(sum(SPLITS), H))
    cache = layer.weight_cache
    clear_weight_caches(layer)
    assert cache.clears == 1 and cache.kept_for_graphs is not None  # the graph still writes those buffers
    for clone in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert clone.kept_for_graphs is None and clone.kept is None and clone.clears == 1
    assert "kept_for_graphs=True" in repr(cache)


def test_bad_role_and_keep_weights_without_a_cache():
    with pytest.raises(ValueError, match=r"capture_weights\(role='first'\).*'keep', 'reuse'"):
        with capture_weights("first"):
            pass
    with pytest.raises(ValueError, match="cache_quantized_weights=True"):
        qmoe.graph.capture(qmoe.nn.GroupedLinear(E, H, F), (torch.randn(4, H),), keep_weights=True)


def test_the_replayer_replays_the_keep_graph_after_every_change():
    """Which graph a call replays: "keep" first, after an optimizer step and after a clear."""
    layer = _layer()
    ran = []
    graphed = GraphedModule(lambda x: ran.append("keep") or x, layer, [], False,
                            reuse=lambda x: ran.append("reuse") or x)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(2):
        for _ in range(3):
            graphed(torch.zeros(1))
        layer.weight.grad = torch.ones_like(layer.weight)
        opt.step()
    graphed(torch.zeros(1))
    clear_weight_caches(layer)
    graphed(torch.zeros(1))
    graphed(torch.zeros(1))
    assert ran == ["keep", "reuse", "reuse"] * 2 + ["keep", "keep", "reuse"]


def test_the_replayer_replays_the_keep_graph_after_a_scale_update(monkeypatch):
    """A change of the caches' stamp (a delayed-scaling update) sends the next call to "keep"."""
    layer = _layer()
    stamp = [0]
    monkeypatch.setattr(layer.weight_cache, "graph_stamp", lambda: (stamp[0],))
    ran = []
    graphed = GraphedModule(lambda x: ran.append("keep") or x, layer, [], False,
                            reuse=lambda x: ran.append("reuse") or x)
    for _ in range(2):
        graphed(torch.zeros(1))
        graphed(torch.zeros(1))
        stamp[0] += 1
    assert ran == ["keep", "reuse"] * 2


def test_a_call_copies_a_gradient_left_in_a_graphs_buffer_once():
    """_keep_grads: a gradient autograd kept from a replay (the graph's buffer) is copied at the
    next call, before a replay could rewrite it; the copy is then kept as the accumulator."""
    layer = _layer()
    static = torch.ones_like(layer.weight)  # what a backward replay hands over
    graphed = GraphedModule(lambda x: x, layer, [], False)
    layer.weight.grad = static
    graphed(torch.zeros(1))
    g = layer.weight.grad
    assert g is not static and torch.equal(g, torch.ones_like(g))
    static.fill_(5.0)  # the next replay rewrites its buffer
    g.add_(static)  # accumulation adds into the copy
    graphed(torch.zeros(1))
    assert layer.weight.grad is g and torch.equal(g, torch.full_like(g, 6.0))


# ---- on the GPU: real captures and replays

T, GH, GF, GE, K = 512, 256, 512, 4, 2  # 1024 routed rows over 4 experts: the emulated GEMMs' dequantize route
GPU_RECIPES = [
    pytest.param(Float8CurrentScaling(), id="current"),
    pytest.param(Float8BlockScaling(), id="block"),
    pytest.param(MXFP8BlockScaling(), id="mxfp8"),
    pytest.param(NVFP4BlockScaling(disable_stochastic_rounding=True), id="nvfp4"),
]


def _moe(cache: bool):
    torch.manual_seed(0)
    return qmoe.nn.MoELayer(GH, GF, GE, K, aux_loss_coeff=1e-2, params_dtype=torch.bfloat16, device="cuda",
                            cache_quantized_weights=cache)


def _loop(layer, recipe, fn, steps=2, micro=3, region_per_step=False):
    """`steps` SGD steps of `micro` micro-batches through `fn`; every output and gradient, then the
    weights. region_per_step: one `qmoe.autocast` region around each step's micro-batches (their
    forward and backward), so delayed scaling updates once per step; then also every recipe state."""
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    seen = []
    for step in range(steps):
        with qmoe.autocast(recipe=recipe) if region_per_step else contextlib.nullcontext():
            for m in range(micro):
                g = torch.Generator(device="cuda").manual_seed(step * micro + m)
                x = torch.randn(T, GH, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
                with qmoe.autocast(recipe=recipe):
                    y = fn(x)
                torch.autograd.backward([y, layer.aux_loss], [torch.ones_like(y) / y.numel() * (m + 1), None])
                seen += [y.detach().clone(), x.grad.clone()]  # a replay's grad may live in the graph's memory
        seen += [p.grad.clone() for p in layer.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
    seen += [p.detach().clone() for p in layer.parameters()]
    if region_per_step:
        seen += _recipe_states(layer)
    return seen


def _recipe_states(layer):
    """Every tensor of the layer's recipe states (delayed scaling's scales and amax histories)."""
    out = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            out.append(v.detach().clone())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)
    walk({k: v for k, v in layer.state_dict().items() if k.endswith("_extra_state")})
    return out


def _graphed(layer, recipe, keep_weights=True):
    """qmoe.graph.capture of `layer` under `recipe`, and a list that counts the reuse graph's replays."""
    sample = torch.randn(T, GH, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with qmoe.autocast(recipe=recipe):
        graphed = qmoe.graph.capture(layer, (sample,), keep_weights=keep_weights)
    reused = []
    if keep_weights:
        reuse = graphed._reuse
        graphed._reuse = lambda *a: reused.append(1) or reuse(*a)
    return graphed, reused


def _assert_same_bits(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"tensor {i}: max |diff| {(a.float() - b.float()).abs().max().item():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_graphed_loop_with_kept_weights_gives_the_eager_bits(recipe):
    """qmoe.graph.capture(keep_weights=True) through two optimizer steps of three micro-batches:
    the same outputs, gradients and weights as eager steps without the cache, with the reuse graph
    replayed for the second and third micro-batches; then a write the versions do not see gives
    stale weights until clear_weight_caches, as documented."""

    eager = _moe(False)
    want = _loop(eager, recipe, eager)
    layer = _moe(True)
    graphed, reused = _graphed(layer, recipe)
    _assert_same_bits(_loop(layer, recipe, graphed), want)
    assert len(reused) == 4
    kept = [m.weight_cache.kept_for_graphs for m in layer.modules() if hasattr(m, "weight_cache")]
    assert len(kept) == 2 and all(k is not None for k in kept)
    if isinstance(recipe, (MXFP8BlockScaling, NVFP4BlockScaling)):  # made by the keep graph, fprop's and dgrad's
        slots = {"rowwise", "columnwise"} if isinstance(recipe, MXFP8BlockScaling) else {"2d"}  # NVFP4: 2-D blocks
        assert all(set(k.bf16_copies) == slots for k in kept)

    x = torch.randn(T, GH, device="cuda", dtype=torch.bfloat16)
    with qmoe.autocast(recipe=recipe):
        before = graphed(x).detach().clone()
        layer.experts.fc1.weight.data.mul_(0.5)  # no version bump: the replayer cannot tell
        assert torch.equal(graphed(x), before)
        clear_weight_caches(layer)
        after = graphed(x)
    eager.load_state_dict(layer.state_dict())
    with qmoe.autocast(recipe=recipe):
        assert torch.equal(after, eager(x)) and not torch.equal(after, before)


@pytest.mark.gpu
@pytest.mark.parametrize("region_per_step,reuses", [(True, 4), (False, 0)], ids=["region-per-step", "per-call"])
def test_graphed_delayed_scaling_reuses_within_a_region(region_per_step, reuses):
    """Delayed scaling under qmoe.graph.capture(keep_weights=True): with one region per optimizer
    step, the reuse graph runs for the second and third micro-batches and the outputs, gradients,
    weights, scales and amax histories equal the eager loop's without the cache; with a region
    per call every call's scale update sends it to the keep graph, with the same bits."""
    recipe = DelayedScaling()
    eager = _moe(False)
    want = _loop(eager, recipe, eager, region_per_step=region_per_step)
    layer = _moe(True)
    graphed, reused = _graphed(layer, recipe)
    _assert_same_bits(_loop(layer, recipe, graphed, region_per_step=region_per_step), want)
    assert len(reused) == reuses
    if region_per_step:
        assert len(_recipe_states(layer)) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("keep_grads", [True, False], ids=["as-shipped", "without-keep-grads"])
def test_graphed_gradient_accumulation_gives_the_eager_bits(keep_grads, monkeypatch):
    """One graph replayed for three micro-batches per optimizer step (qmoe.graph.capture, no
    weight cache): the eager loop's gradients and weights. Without `_keep_grads`, autograd keeps
    the first backward's static gradient buffer as .grad and the next replay overwrites it."""
    recipe = Float8CurrentScaling()
    eager = _moe(False)
    want = _loop(eager, recipe, eager)
    layer = _moe(False)
    graphed, _ = _graphed(layer, recipe, keep_weights=False)
    if not keep_grads:
        monkeypatch.setattr(graphed, "_keep_grads", lambda: None)
    got = _loop(layer, recipe, graphed)
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    assert same is keep_grads, "without _keep_grads the accumulated gradients should differ" if same else \
        [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)][:8]


@pytest.mark.gpu
def test_hand_made_captures_of_the_whole_step():
    """The bench's habit: forward + backward captured once under capture_weights("keep") and once
    under ("reuse"), replayed as first / later micro-batches: the eager steps' gradients."""
    recipe = MXFP8BlockScaling()
    layer, eager = _moe(True), _moe(False)
    x = torch.randn(T, GH, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, GH, device="cuda", dtype=torch.bfloat16)

    def step(module):
        x.grad = None
        for p in module.parameters():
            p.grad = None
        with qmoe.autocast(recipe=recipe):
            y = module(x)
        torch.autograd.backward([y, module.aux_loss], [dy, None])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(layer)
    torch.cuda.current_stream().wait_stream(side)
    first, later = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    grads = {}  # each capture's gradients: allocated inside it, written by its replays
    for graph, role in ((first, "keep"), (later, "reuse")):
        with capture_weights(role), torch.cuda.graph(graph):
            step(layer)
        grads[graph] = [x.grad] + [p.grad for p in layer.parameters()]
    for graph in (first, later, later):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
        graph.replay()
        got = [g.clone() for g in grads[graph]]
        step(eager)
        want = [x.grad] + [p.grad for p in eager.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
