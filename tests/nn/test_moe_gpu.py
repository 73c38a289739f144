"""GPU: the whole MoE layer under each recipe, host-sync-free, and CUDA-graph replay == eager."""
import pytest
import torch

import qmoe
from qmoe.recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                          NVFP4BlockScaling)
from tests.tolerances import MOE_GEMM_DEPTH, assert_within_tolerance, recipe_tolerance

DEPTH_NAMES = {"router.weight": "router", "experts.fc1.weight": "w1", "experts.fc2.weight": "w2",
               "experts.fc1.bias": "b1", "experts.fc2.bias": "b2"}

pytestmark = pytest.mark.gpu

RECIPES = [
    pytest.param(None, id="bf16"),
    pytest.param(Float8CurrentScaling(), id="current"),
    pytest.param(Float8BlockScaling(), id="block"),
    pytest.param(MXFP8BlockScaling(), id="mxfp8"),
    pytest.param(NVFP4BlockScaling(disable_stochastic_rounding=True), id="nvfp4"),
    pytest.param(DelayedScaling(), id="delayed"),
]
T, H, F, E, K = 256, 256, 512, 8, 2


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("aux_loss_coeff", 1e-2)
    return qmoe.nn.MoELayer(H, F, E, K, params_dtype=torch.bfloat16, device="cuda", **kw)


def _step(layer, x, recipe, fn=None):
    """Forward, then backward of a fixed random upstream gradient (so gradient errors do not also
    carry the output's) plus the auxiliary loss."""
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
        y = (fn or layer)(x)
    g = torch.randn(y.shape, generator=torch.Generator(y.device).manual_seed(7), device=y.device, dtype=y.dtype)
    aux = layer.aux_loss
    torch.autograd.backward([y, aux] if aux.requires_grad else [y], [g, None] if aux.requires_grad else [g])
    grads = [x.grad] + [p.grad.clone() for p in layer.parameters()]
    return y.detach(), grads


@pytest.mark.parametrize("recipe", RECIPES)
def test_layer_within_tolerance_of_fp32_on_gpu(recipe):
    layer = _layer()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ref_layer = _layer().float()
    y_ref, g_ref = _step(ref_layer, x.float(), None)
    if isinstance(recipe, DelayedScaling):
        # two steps: the first records forward amaxes; FC1's gradient amax is only right once
        # FC2's gradient scale (from the first backward) is
        _step(layer, x, recipe)
        _step(layer, x, recipe)
    y, g = _step(layer, x, recipe)
    names = ["dx"] + [DEPTH_NAMES[n] for n, _ in layer.named_parameters()]
    for name, a, b in zip(["y"] + names, [y] + g, [y_ref] + g_ref):
        # the GEMMs chained in front of each quantity, bf16 included
        assert_within_tolerance(a, b, *recipe_tolerance(recipe, MOE_GEMM_DEPTH[name]), name)


@pytest.mark.parametrize("recipe", RECIPES)
def test_layer_has_no_host_sync(recipe):
    layer = _layer()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    _step(layer, x, recipe)  # warm up: autotuning and lazy state may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(layer, x, recipe)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("recipe", RECIPES)
def test_graph_replay_matches_eager(recipe):
    layer = _layer()
    sample = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x_new = torch.randn(T, H, device="cuda", dtype=torch.bfloat16) * 3 + 0.5  # new data, new routing
    with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
        graphed = qmoe.graph.capture(layer, (sample,))
    y_g, g_g = _step(layer, x_new, recipe, graphed)
    if isinstance(recipe, DelayedScaling):
        return  # the replay moved the scales; test_delayed_scales_update_across_replays covers it
    y_e, g_e = _step(layer, x_new, recipe)
    assert torch.equal(y_g, y_e)
    for i, (a, b) in enumerate(zip(g_g, g_e)):  # no float atomics anywhere: the same bits
        assert torch.equal(a, b), f"gradient {i}: max |diff| {(a.float() - b.float()).abs().max().item():.3g}"


def test_delayed_scales_update_across_replays():
    layer = _layer()
    recipe = DelayedScaling()
    sample = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with qmoe.autocast(recipe=recipe):
        graphed = qmoe.graph.capture(layer, (sample,))
    q_in = layer.experts.fc1.recipe_state.quantizers["input"]
    fresh = q_in.scale.clone()
    assert torch.equal(fresh, torch.ones_like(fresh))  # capture's warm-up left no trace
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    _step(layer, x, recipe, graphed)
    after_one = q_in.scale.clone()
    assert not torch.equal(after_one, fresh)
    _step(layer, 4 * x, recipe, graphed)
    assert (q_in.scale <= after_one).all() and not torch.equal(q_in.scale, after_one)


@pytest.mark.parametrize("recipe", RECIPES)
def test_whole_step_captured_after_eager_steps(recipe):
    """The CUDA-graph habit of PyTorch's docs after a few eager steps on the default stream: warm
    up on a side stream, capture forward + backward (aux loss included) with torch.cuda.graph,
    replay on new data. The eager steps' graphs must not reach into the capture (their
    gradient-accumulation nodes belong to the default stream); the replay equals an eager step."""
    layer = _layer(shared_expert_ffn_hidden_size=F)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
            y = layer(x)
        torch.autograd.backward([y, layer.aux_loss], [g, None])

    for _ in range(2):
        step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    with torch.no_grad():
        x.copy_(torch.randn_like(x) * 3 + 0.5)
    graph.replay()
    got = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    if isinstance(recipe, DelayedScaling):
        assert all(torch.isfinite(t).all() for t in got)
        return  # the replay moved the scales: an eager step now quantizes with others
    step()
    want = [x.grad] + [p.grad for p in layer.parameters()]
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"gradient {i}: max |diff| {(a.float() - b.float()).abs().max().item():.3g}"
