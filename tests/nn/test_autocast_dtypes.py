"""qmoe modules under torch.autocast and after dtype casts (DESIGN.md's training-loop contract).

Under torch.autocast the quantized GEMMs follow the qmoe recipe and the rest follows
torch.autocast: outputs in the autocast dtype, the same step as with inputs and weights cast by
hand (NUMERICS.md tolerance), and within tolerance of the step without torch.autocast.
`.to(dtype)` and friends work on every module; the router computes in fp32 whatever its dtype.
"""
import copy
import contextlib

import pytest
import torch

import qmoe
from tests.nn.loop_cases import AMP, KINDS, gemms_in_series, inputs, make
from tests.nn.recipe_cases import DETERMINISTIC, QUANTIZED
from tests.tolerances import assert_within_tolerance, recipe_tolerance

RECIPES = [pytest.param(None, id="bf16")] + QUANTIZED


def _region(recipe):
    return qmoe.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()


def _step(module, kind, x, extra, recipe, amp=None, backward_in_amp=False, seed=5):
    """Output, input gradient and parameter gradients of loss = <y, g> for one step."""
    module.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    amp_region = torch.autocast(x.device.type, dtype=amp) if amp is not None else contextlib.nullcontext()
    with amp_region:
        with _region(recipe):
            y = module(x, *extra)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.device)
        if backward_in_amp:
            (y.float() * g).sum().backward()
    if not backward_in_amp:
        (y.float() * g).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads


def _compare(a, b, recipe, kind, what):
    n = gemms_in_series(kind)
    rtol, atol = recipe_tolerance(recipe, n)
    assert_within_tolerance(a[0].float(), b[0].float(), rtol, atol, f"{what} output")
    rtol, atol = recipe_tolerance(recipe, n + 1)
    assert_within_tolerance(a[1].float(), b[1].float(), rtol, atol, f"{what} dx")
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        if name == "router.weight":  # routes in fp32 either way; its gradient goes through the experts
            rtol, atol = recipe_tolerance(recipe, n + 1)
        assert_within_tolerance(a[2][name].float(), b[2][name].float(), rtol, atol, f"{what} d{name}")


@pytest.mark.parametrize("device,amp", AMP)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", KINDS)
def test_torch_autocast_equals_hand_cast_step(kind, recipe, device, amp):
    module = make(kind, device)
    x, extra = inputs(kind, device)
    # values the autocast dtype holds exactly: both runs route every token to the same experts (a
    # flipped near-tie would move a whole row, which no elementwise tolerance is meant to absorb)
    x = x.to(amp).to(x.dtype)
    got = _step(module, kind, x, extra, recipe, amp=amp)
    assert got[0].dtype == amp, "outputs come out in torch.autocast's dtype"
    assert got[1].dtype == torch.float32 and all(g.dtype == torch.float32 for g in got[2].values())

    by_hand = copy.deepcopy(module).to(amp)
    if kind == "moe":
        by_hand.router.float()  # routing is fp32 under torch.autocast: keep the same router weights
    want = _step(by_hand, kind, x.to(amp), extra, recipe)
    assert want[0].dtype == amp
    _compare(got, want, recipe, kind, "autocast vs hand cast")

    without = _step(module, kind, x, extra, recipe)  # torch.autocast off: fp32 activations
    assert without[0].dtype == torch.float32
    _compare(got, without, recipe, kind, "autocast on vs off")


@pytest.mark.parametrize("device,amp", AMP)
@pytest.mark.parametrize("recipe", DETERMINISTIC)
@pytest.mark.parametrize("kind", KINDS)
def test_backward_inside_torch_autocast_gives_the_same_bits(kind, recipe, device, amp):
    """torch.autocast is off inside qmoe's backward, wherever `.backward()` is called."""
    x, extra = inputs(kind, device)
    outside = _step(make(kind, device), kind, x, extra, recipe, amp=amp)
    inside = _step(make(kind, device), kind, x, extra, recipe, amp=amp, backward_in_amp=True)
    assert torch.equal(outside[0], inside[0]) and torch.equal(outside[1], inside[1])
    for name in outside[2]:
        assert torch.equal(outside[2][name], inside[2][name]), name


CASTS = [pytest.param("half", torch.float16, id="half"), pytest.param("bfloat16", torch.bfloat16, id="bfloat16"),
         pytest.param("float", torch.float32, id="float"), pytest.param("double", torch.float64, id="double")]


@pytest.mark.parametrize("cast,dtype", CASTS)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", ["linear", "moe"])
def test_dtype_casts(kind, recipe, cast, dtype):
    module = make(kind)
    x, extra = inputs(kind)
    want = _step(module, kind, x, extra, recipe)
    cast_module = getattr(copy.deepcopy(module), cast)()
    got = _step(cast_module, kind, x.to(dtype), extra, recipe)
    assert got[0].dtype == dtype and got[1].dtype == dtype
    assert all(p.grad.dtype == p.dtype == dtype for p in cast_module.parameters())
    # fp16 carries more mantissa than bf16, fp32/fp64 more still: bf16's tolerance bounds them all
    _compare(got, want, recipe, kind, f".{cast}()")
    if kind == "moe":
        router = cast_module.router
        logits = qmoe.ops.router_logits(x.reshape(-1, x.shape[-1]).to(dtype), router.weight)
        assert logits.dtype == torch.float32


def test_router_computes_in_fp32_and_keeps_expert_bias_fp32():
    torch.manual_seed(0)
    layer = qmoe.nn.MoELayer(32, 64, 4, 2, expert_bias=True).bfloat16()
    assert layer.router.weight.dtype == torch.bfloat16
    assert layer.router.expert_bias.dtype == torch.float32, "expert_bias stays fp32 through .bfloat16()"
    x = torch.randn(16, 32).bfloat16()
    w = layer.router.weight
    # the router's logits are the fp32 product of the bf16 values
    torch.testing.assert_close(qmoe.ops.router_logits(x, w), x.float() @ w.float().t(), rtol=0, atol=0)
    probs, _ = layer.router(x)
    assert probs.dtype == torch.float32
    before = layer.router.expert_bias.clone()
    layer(x)
    assert layer.router.expert_bias.dtype == torch.float32
    assert not torch.equal(before, layer.router.expert_bias), "the fp32 bias takes its 1e-3 steps"
    layer.double()
    assert layer.router.expert_bias.dtype == torch.float32 and layer.router.weight.dtype == torch.float64


def test_shared_expert_gate_stays_fp32_under_torch_autocast():
    """The shared experts' sigmoid gate is fp32 (like the router), torch.autocast or not."""
    torch.manual_seed(0)
    layer = qmoe.nn.MoELayer(32, 64, 4, 2, shared_expert_ffn_hidden_size=64, shared_expert_gate=True)
    tokens = torch.randn(16, 32).bfloat16()
    gate = torch.sigmoid(tokens.float() @ layer.shared_expert_gate.weight.float().t())  # fp32, autocast off
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer._shared_experts(tokens)
        dense = layer.shared_experts(tokens)
    assert got.dtype == torch.bfloat16 and torch.equal(got, (dense.float() * gate).bfloat16())
