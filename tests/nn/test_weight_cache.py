"""`cache_quantized_weights` and `recompute_weight_columnwise`: fewer weight quantizations or less
memory, the same bits.

A GroupedMLP trained for two optimizer steps of three gradient-accumulation micro-batches gives,
with the weight cache on, the outputs, gradients, weights and delayed-scaling states of the layer
without it, bit for bit, for every recipe and both paths, while quantizing each weight once per
step (stateless recipes) or once per `qmoe.autocast` region (delayed scaling, whose scale moves at
every region exit). The same holds with `qmoe.checkpoint` (the recompute reuses the weights, or
for delayed scaling quantizes them afresh with the first run's scale) and with
`recompute_weight_columnwise` (dgrad's weight copy made again in the backward). Then what can
go wrong: an optimizer step, `load_state_dict`, a no_grad or inference-mode forward, a CUDA-graph
capture, copies and pickles of the layer, and deleting it.
"""
import contextlib
import copy
import gc
import io
import pickle
import weakref

import pytest
import torch

import qmoe
import qmoe.ops.grouped_linear_paths as paths
import qmoe.quant.weight_cache as weight_cache
from qmoe.quant import clear_weight_caches
from qmoe.recipes import DelayedScaling, Float8CurrentScaling
from tests.nn.loop_cases import E, F, GPU_F, GPU_H, H, SPLITS
from tests.nn.recipe_cases import QUANTIZED

RECIPES = [pytest.param(None, id="plain")] + QUANTIZED
STEPS, MICRO = 2, 3


def _states(module):
    return {f"{name}.{role}.{k}": t for name, m in module.named_modules() if hasattr(m, "recipe_state")
            for role, q in m.recipe_state.quantizers.items() for k, t in q.state_dict().items()}


def _train(recipe, device="cpu", path="grouped", region="micro", checkpoint=False, **options):
    """STEPS optimizer steps of MICRO micro-batches; everything observable. region="micro": one
    qmoe.autocast per micro-batch forward (the backward outside it: delayed scaling's scales have
    moved on), "step": one region around the whole step, backward passes included."""
    torch.manual_seed(0)
    h, f = (H, F) if device == "cpu" else (GPU_H, GPU_F)
    mlp = qmoe.nn.GroupedMLP(E, h, f, bias=True, grouped_path=path, device=device, **options)
    opt = torch.optim.SGD(mlp.parameters(), lr=0.5)
    splits = torch.tensor(SPLITS, device=device)
    on = dict(recipe=recipe, enabled=recipe is not None)
    seen = []
    for step in range(STEPS):
        with qmoe.autocast(**on) if region == "step" else contextlib.nullcontext():
            for micro in range(MICRO):
                g = torch.Generator().manual_seed(step * MICRO + micro)
                x = torch.randn(sum(SPLITS), h, generator=g).to(device).requires_grad_(True)
                probs = torch.rand(sum(SPLITS), generator=g).to(device).requires_grad_(True)
                with qmoe.autocast(**on) if region == "micro" else contextlib.nullcontext():
                    y = qmoe.checkpoint(mlp, x, splits, probs) if checkpoint else mlp(x, splits, probs)
                y.float().square().mean().backward()
                seen += [y.detach(), x.grad, probs.grad]
        seen += [p.grad.clone() for p in mlp.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
    seen += [p.detach().clone() for p in mlp.parameters()]
    return seen, _states(mlp)


def _assert_equal(got, want):
    (got_t, got_s), (want_t, want_s) = got, want
    assert len(got_t) == len(want_t)
    for i, (a, b) in enumerate(zip(got_t, want_t)):
        assert torch.equal(a, b), f"tensor {i} differs"
    assert got_s.keys() == want_s.keys()
    for name in want_s:
        assert torch.equal(got_s[name], want_s[name]), f"state {name} differs"


def _same_run(recipe, calls, **kw):
    """(quantizations without the cache, with it), after checking both runs give the same bits."""
    torch.manual_seed(1)  # NVFP4's stochastic rounding of dy draws from torch's generator: the same stream
    want = _train(recipe, **kw)
    without = len(calls)
    torch.manual_seed(1)
    got = _train(recipe, cache_quantized_weights=True, **kw)
    _assert_equal(got, want)
    return without, len(calls) - without


@pytest.mark.parametrize("path", ["grouped", "split"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_weight_cache_gives_the_same_bits(recipe, path, weight_quantizations):
    without, with_cache = _same_run(recipe, weight_quantizations, path=path)
    if path == "split" or recipe is None:
        assert with_cache == without  # nothing to keep: the cross-check path, plain GEMMs
    elif isinstance(recipe, DelayedScaling):
        assert with_cache == without == 2 * STEPS * MICRO  # every region exit moves the scales
    else:
        assert without == 2 * STEPS * MICRO and with_cache == 2 * STEPS  # FC1, FC2 once per step


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_one_region_per_step_reuses_every_recipe(recipe, weight_quantizations):
    without, with_cache = _same_run(recipe, weight_quantizations, region="step")
    assert without == 2 * STEPS * MICRO and with_cache == 2 * STEPS


@pytest.mark.parametrize("region", ["micro", "step"])
@pytest.mark.parametrize("recipe", QUANTIZED)
def test_checkpoint_recomputes_reuse_the_weights(recipe, region, weight_quantizations):
    without, with_cache = _same_run(recipe, weight_quantizations, region=region, checkpoint=True)
    assert without == 2 * 2 * STEPS * MICRO  # forward and recompute
    if not isinstance(recipe, DelayedScaling):
        assert with_cache == 2 * STEPS
    else:  # the recompute quantizes with the first run's scale, which the log holds: afresh
        assert with_cache == 2 * STEPS * MICRO + (2 * STEPS if region == "step" else 2 * STEPS * MICRO)


@pytest.mark.parametrize("layout", ["deferred-wgrad", "per-expert-weights"])
def test_deferred_weight_gradients_and_per_expert_weights(layout, weight_quantizations):
    """The weight handed to the op is then a stand-in (detached) or a stack made every call: the
    cache keys on the module's parameters, so it still reuses, with the same bits."""
    recipe = QUANTIZED[2].values[0]  # block scaling

    def run(cache):
        torch.manual_seed(0)
        kw = dict(delay_wgrad_compute=True) if layout == "deferred-wgrad" else dict(single_grouped_weight=False)
        mlp = qmoe.nn.GroupedMLP(E, H, F, cache_quantized_weights=cache, **kw)
        out = []
        for micro in range(3):
            x = torch.randn(sum(SPLITS), H, generator=torch.Generator().manual_seed(micro), requires_grad=True)
            with qmoe.autocast(recipe=recipe):
                y = mlp(x, torch.tensor(SPLITS))
            y.square().mean().backward()
            mlp.backward_dw()
            out += [y.detach(), x.grad]
        return out + [p.grad for p in mlp.parameters()]

    want = run(False)
    before = len(weight_quantizations)
    got = run(True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert before == 6 and len(weight_quantizations) - before == 2


# ---- recompute_weight_columnwise

@pytest.mark.parametrize("path", ["grouped", "split"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_recomputed_weight_columnwise_gives_the_same_bits(recipe, path):
    torch.manual_seed(1)
    want = _train(recipe, path=path)
    torch.manual_seed(1)
    _assert_equal(_train(recipe, path=path, recompute_weight_columnwise=True), want)


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("region", ["micro", "step"])
@pytest.mark.parametrize("recipe", [QUANTIZED[0], QUANTIZED[1]])  # delayed (a scale to replay), current
def test_recomputed_weight_columnwise_with_the_cache(recipe, region, checkpoint):
    torch.manual_seed(1)
    want = _train(recipe, region=region, checkpoint=checkpoint)
    torch.manual_seed(1)
    got = _train(recipe, region=region, checkpoint=checkpoint, recompute_weight_columnwise=True,
                 cache_quantized_weights=True)
    _assert_equal(got, want)


def _fc2_saved(y):
    node = y.grad_fn
    while not hasattr(node, "saved"):
        node = node.next_functions[0][0]
    return node


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling()], ids=["plain", "current"])
def test_recompute_weight_columnwise_keeps_the_parameter_not_a_copy(recipe):
    mlp = qmoe.nn.GroupedMLP(E, H, F, recompute_weight_columnwise=True)
    x = torch.randn(sum(SPLITS), H, requires_grad=True)
    with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
        y = mlp(x, torch.tensor(SPLITS), torch.rand(sum(SPLITS)))
    node = _fc2_saved(y)
    assert node.saved.w_operand is None
    weight = node.saved_tensors[2 + _saved_index("weight")]
    assert weight.untyped_storage().data_ptr() == mlp.fc2.weight.untyped_storage().data_ptr()
    y.sum().backward()
    assert mlp.fc2.weight.grad is not None and x.grad is not None


def _saved_index(name):
    from qmoe.ops.grouped_linear import _Saved
    return _Saved._AUTOGRAD.index(name)


# ---- what could make a kept weight wrong

def _layer(recipe=Float8CurrentScaling(), **kw):
    torch.manual_seed(0)
    layer = qmoe.nn.GroupedLinear(E, H, F, bias=False, cache_quantized_weights=True, **kw)
    plain = qmoe.nn.GroupedLinear(E, H, F, bias=False)
    return layer, plain


def _forward(layer, x, recipe=Float8CurrentScaling()):
    with qmoe.autocast(recipe=recipe):
        return layer(x, torch.tensor(SPLITS))


def _misses(calls, layer) -> int:
    return sum(w is layer.weight for w in calls)


def _fresh(layer, plain, x, recipe=Float8CurrentScaling()):
    """What a layer without a cache gives with `layer`'s current weights."""
    with torch.no_grad():
        plain.weight.copy_(layer.weight)
    return _forward(plain, x, recipe)


def test_an_optimizer_step_makes_the_next_forward_quantize_the_new_weights(weight_quantizations):
    layer, plain = _layer()
    opt = torch.optim.Adam(layer.parameters(), lr=0.1)
    x = torch.randn(sum(SPLITS), H)
    y0 = _forward(layer, x)
    y0.square().sum().backward()
    assert torch.equal(_forward(layer, x), y0) and _misses(weight_quantizations, layer) == 1  # reused
    opt.step()
    y1 = _forward(layer, x)
    assert _misses(weight_quantizations, layer) == 2
    assert not torch.equal(y1, y0)
    assert torch.equal(y1, _fresh(layer, plain, x))


def test_load_state_dict_and_in_place_writes_invalidate(weight_quantizations):
    layer, plain = _layer()
    x = torch.randn(sum(SPLITS), H)
    _forward(layer, x)
    other = qmoe.nn.GroupedLinear(E, H, F, bias=False)
    layer.load_state_dict(other.state_dict())
    assert torch.equal(_forward(layer, x), _fresh(layer, plain, x))
    with torch.no_grad():
        layer.weight.mul_(2)
    assert torch.equal(_forward(layer, x), _fresh(layer, plain, x))
    assert _misses(weight_quantizations, layer) == 3


def test_writes_through_data_need_clear():
    """The documented limit: `.data` bypasses the version counter, so the kept copy is stale until cleared."""
    layer, plain = _layer()
    x = torch.randn(sum(SPLITS), H)
    y0 = _forward(layer, x)
    layer.weight.data.mul_(2)
    assert torch.equal(_forward(layer, x), y0)  # stale: the cache cannot see this write
    layer.weight_cache.clear()
    assert torch.equal(_forward(layer, x), _fresh(layer, plain, x))


def test_replacing_the_parameter_or_the_recipe_misses(weight_quantizations):
    layer, plain = _layer()
    x = torch.randn(sum(SPLITS), H)
    _forward(layer, x)
    layer.weight = torch.nn.Parameter(layer.weight.detach() * 3)  # same version (0), another tensor
    assert torch.equal(_forward(layer, x), _fresh(layer, plain, x))
    _forward(layer, x, recipe=DelayedScaling())  # another recipe: its own quantizer
    _forward(layer, x)
    assert _misses(weight_quantizations, layer) == 3  # the new parameter's: one per change


def test_no_grad_and_inference_mode(weight_quantizations):
    layer, plain = _layer()
    x = torch.randn(sum(SPLITS), H, requires_grad=True)
    with torch.no_grad():
        y = _forward(layer, x)
    assert layer.weight_cache.kept.columnwise_data is None  # inference needs fprop's copy only
    assert torch.equal(y, _fresh(layer, plain, x))
    y = _forward(layer, x)  # training needs dgrad's copy too: quantized again, both copies kept
    assert layer.weight_cache.kept.columnwise_data is not None and _misses(weight_quantizations, layer) == 2
    with torch.no_grad():
        _forward(layer, x)  # the kept copies serve inference as well
    assert _misses(weight_quantizations, layer) == 2
    with torch.inference_mode():
        layer.weight_cache.clear()
        _forward(layer, x)  # kept as inference tensors, which a training forward cannot use ...
    y = _forward(layer, x)
    assert _misses(weight_quantizations, layer) == 4
    y.square().sum().backward()  # ... so it quantized again, and its backward runs
    assert x.grad is not None


def test_a_capture_turns_the_cache_off(monkeypatch, weight_quantizations):
    """Inside a CUDA-graph capture nothing is read from or stored in the cache (a replay must quantize
    the weights of its own time), and a cache that has seen a capture stays off. Simulated on the
    CPU: the capture check reports a capture in progress."""
    layer, plain = _layer()
    x = torch.randn(sum(SPLITS), H)
    _forward(layer, x)
    assert layer.weight_cache.kept is not None
    monkeypatch.setattr(weight_cache, "_capturing", lambda: True)
    y = _forward(layer, x)
    assert layer.weight_cache.kept is None and layer.weight_cache.captured
    monkeypatch.setattr(weight_cache, "_capturing", lambda: False)
    for _ in range(2):
        assert torch.equal(_forward(layer, x), y)
    assert _misses(weight_quantizations, layer) == 4 and layer.weight_cache.kept is None


def test_a_miss_drops_the_old_copy_first_and_a_hit_saves_the_kept_copy(monkeypatch):
    layer, _ = _layer()
    real = paths.quantize_weights

    def check(*args, **kwargs):
        assert layer.weight_cache.kept is None, "two quantized copies at once"
        return real(*args, **kwargs)
    monkeypatch.setattr(paths, "quantize_weights", check)
    x = torch.randn(sum(SPLITS), H, requires_grad=True)
    for _ in range(2):
        y = _forward(layer, x)
        saved = y.grad_fn.saved.w_operand
        kept = layer.weight_cache.kept
        assert saved.columnwise_data is kept.columnwise_data and saved.rowwise_data is None
        assert kept.rowwise_data is not None  # the saved copy went without it, not the kept one
        y.square().sum().backward()
        with torch.no_grad():
            layer.weight.add_(0.5)


def test_state_dict_copies_and_pickles(tmp_path):
    layer, plain = _layer()
    x = torch.randn(sum(SPLITS), H)
    y = _forward(layer, x)
    plain.load_state_dict(layer.state_dict())
    assert layer.state_dict().keys() == plain.state_dict().keys()
    for name, t in plain.state_dict().items():
        other = layer.state_dict()[name]
        assert torch.equal(t, other) if isinstance(t, torch.Tensor) else t == other, name
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer)), _torch_roundtrip(layer)):
        assert clone.weight_cache.kept is None and clone.cache_quantized_weights
        assert torch.equal(_forward(clone, x), y)
        assert clone.weight_cache.kept is not None
    assert layer.weight_cache.kept is not None


def test_layers_pickled_before_the_options_load_with_them_off():
    layer, _ = _layer()
    x = torch.randn(sum(SPLITS), H)
    y = _forward(layer, x)
    for cls, module in ((qmoe.nn.GroupedLinear, layer), (qmoe.nn.Linear, qmoe.nn.Linear(H, F))):
        state = dict(module.__getstate__())
        for name in ("weight_cache", "_cache_quantized_weights", "recompute_weight_columnwise"):
            state.pop(name, None)
        old = cls.__new__(cls)
        old.__setstate__(state)
        assert not old.cache_quantized_weights and old.weight_cache.kept is None
        if cls is qmoe.nn.GroupedLinear:
            assert not old.recompute_weight_columnwise and torch.equal(_forward(old, x), y)


def _torch_roundtrip(module):
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_deleting_the_layer_frees_the_kept_weights():
    """The cache holds its weights by weak reference: it keeps neither them nor (through them) the
    layer alive, and goes with the layer (modules sit in reference cycles of their own hooks:
    collected by the garbage collector)."""
    layer, _ = _layer()
    x = torch.randn(sum(SPLITS), H, requires_grad=True)
    _forward(layer, x).sum().backward()
    kept = weakref.ref(layer.weight_cache.kept.columnwise_data)
    weight = weakref.ref(layer.weight)
    cache = layer.weight_cache  # e.g. held by an autograd graph that outlives the layer
    del layer
    gc.collect()
    assert weight() is None and cache.kept is not None
    del cache
    assert kept() is None
    layer, _ = _layer()
    _forward(layer, x)
    kept = weakref.ref(layer.weight_cache.kept.rowwise_data)
    del layer
    gc.collect()
    assert kept() is None


def test_turning_the_option_off_frees_and_to_clears():
    layer, _ = _layer()
    x = torch.randn(sum(SPLITS), H)
    _forward(layer, x)
    layer.to(torch.float64)
    assert layer.weight_cache.kept is None
    layer.to(torch.float32)
    _forward(layer, x)
    layer.cache_quantized_weights = False
    assert layer.weight_cache.kept is None
    _forward(layer, x)
    assert layer.weight_cache.kept is None
    with pytest.raises(TypeError, match="cache_quantized_weights"):
        layer.cache_quantized_weights = 1


@pytest.mark.parametrize("recipe", [QUANTIZED[0], QUANTIZED[1], QUANTIZED[4]])
def test_moe_layer_with_shared_experts(recipe):
    def run(**options):
        torch.manual_seed(0)
        layer = qmoe.nn.MoELayer(H, F, E, 2, shared_expert_ffn_hidden_size=F, **options)
        opt = torch.optim.SGD(layer.parameters(), lr=0.5)
        out = []
        for step in range(2):
            for micro in range(2):
                x = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(10 * step + micro),
                                requires_grad=True)
                with qmoe.autocast(recipe=recipe):
                    y = layer(x)
                y.square().mean().backward()
                out += [y.detach(), x.grad]
            out += [p.grad.clone() for p in layer.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
        return out, layer

    torch.manual_seed(1)
    want, _ = run()
    torch.manual_seed(1)
    got, layer = run(cache_quantized_weights=True, recompute_weight_columnwise=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    caches = [m.weight_cache for m in layer.modules() if hasattr(m, "weight_cache")]
    assert len(caches) == 4 and all(c.kept is not None for c in caches)  # experts' FC1, FC2; shared FC1, FC2
    clear_weight_caches(layer)
    assert all(c.kept is None for c in caches)
    with qmoe.autocast(recipe=recipe):
        layer(torch.randn(2, 16, H))
    assert all(c.kept is not None for c in caches)
    layer.cache_quantized_weights = False
    assert all(c.kept is None for c in caches) and not layer.experts.fc2.cache_quantized_weights


# ---- the kernels (emulated MXFP8 / NVFP4 on their dequantize-first route included)

@pytest.mark.gpu
@pytest.mark.parametrize("rw", [False, True], ids=["kept-columnwise", "recompute-columnwise"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_weight_cache_gives_the_same_bits_on_the_gpu(recipe, rw, weight_quantizations):
    _same_run(recipe, weight_quantizations, device="cuda", recompute_weight_columnwise=rw)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [QUANTIZED[3], QUANTIZED[4]])
def test_bf16_weights_kept_on_the_dequantize_route(recipe):
    """Enough rows per expert for the emulated GEMMs' dequantize-first route: the cache keeps the bf16
    weights beside the quantized ones, and the steps still match the uncached layer bit for bit."""
    from qmoe.kernels.grouped_gemm import DEQUANT_MIN_ROWS

    def run(cache):
        torch.manual_seed(0)
        layer = qmoe.nn.GroupedMLP(2, 256, 256, device="cuda", cache_quantized_weights=cache)
        splits = torch.tensor([DEQUANT_MIN_ROWS, DEQUANT_MIN_ROWS + 128], device="cuda")
        out = []
        for micro in range(3):
            x = torch.randn(int(splits.sum()), 256, device="cuda", requires_grad=True)
            with qmoe.autocast(recipe=recipe):
                y = layer(x, splits)
            y.float().square().mean().backward()
            out += [y.detach(), x.grad]
        return out + [p.grad for p in layer.parameters()], layer

    torch.manual_seed(1)
    want, _ = run(False)
    torch.manual_seed(1)
    got, layer = run(True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert layer.fc1.weight_cache.kept.bf16_copies  # the route kept its bf16 weights
