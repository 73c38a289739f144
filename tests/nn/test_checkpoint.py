"""`qmoe.checkpoint`: checkpointed gradients equal the plain step's bit for bit.

For every recipe, both reentrant modes, the backward inside or outside the qmoe.autocast region
(and torch.autocast on or off): outputs, input and parameter gradients, aux losses, expert
biases and delayed-scaling states after the step are identical (also with the MoE layer's
recompute_activation inside the checkpoint). `torch.utils.checkpoint`
used directly on qmoe modules raises a qmoe error naming qmoe.checkpoint in both modes.
"""
import contextlib

import pytest
import torch
import torch.utils.checkpoint

import qmoe
from qmoe.recipes import DelayedScaling
from tests.nn.loop_cases import AMP, TinyModel, batch
from tests.nn.recipe_cases import QUANTIZED

RECIPES = [pytest.param(None, id="bf16")] + QUANTIZED
MODES = [pytest.param(False, id="nonreentrant"), pytest.param(True, id="reentrant")]
WHERE = [pytest.param(False, id="backward-outside"), pytest.param(True, id="backward-inside")]


def _qmoe_states(model):
    return {f"{name}.{role}.{k}": t for name, m in model.named_modules() if hasattr(m, "recipe_state")
            for role, q in m.recipe_state.quantizers.items() for k, t in q.state_dict().items()}


def _step(recipe, checkpoint=None, backward_inside=False, device="cpu", amp=None, steps=2, recompute=False):
    """Two training steps of TinyModel with its MoE block checkpointed (or not); everything observable.
    recompute: the MoE layer's recompute_activation."""
    model = TinyModel(device)
    model.moe.recompute_activation = recompute
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    grads = []
    for step in range(steps):
        x, target = batch(step, device)
        x.requires_grad_(True)
        opt.zero_grad()
        amp_region = torch.autocast(device, dtype=amp) if amp is not None else contextlib.nullcontext()
        with amp_region, qmoe.autocast(recipe=recipe, enabled=recipe is not None):
            h = model.moe(x) if checkpoint is None else checkpoint(model.moe, x)
            loss = torch.nn.functional.mse_loss(model.head(h + x).float(), target) + model.moe.aux_loss
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        grads.append({"loss": loss.detach(), "dx": x.grad, **{n: p.grad.clone() for n, p in model.named_parameters()}})
        opt.step()
    return grads, {**dict(model.named_buffers()), **_qmoe_states(model)}


def _assert_same(got, want):
    (got_grads, got_state), (want_grads, want_state) = got, want
    for step, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert g.keys() == w.keys()
        for name in w:
            assert torch.equal(g[name], w[name]), f"step {step}: {name} differs"
    assert got_state.keys() == want_state.keys()
    for name in want_state:
        assert torch.equal(got_state[name], want_state[name]), f"state {name} differs"


def _qmoe_checkpoint(reentrant):
    return lambda fn, *args: qmoe.checkpoint(fn, *args, use_reentrant=reentrant)


@pytest.mark.parametrize("backward_inside", WHERE)
@pytest.mark.parametrize("reentrant", MODES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpointed_gradients_equal_plain_bit_for_bit(recipe, reentrant, backward_inside):
    torch.manual_seed(0)  # NVFP4's stochastic rounding draws from torch's generator: same stream in both runs
    want = _step(recipe, backward_inside=backward_inside)
    torch.manual_seed(0)
    got = _step(recipe, _qmoe_checkpoint(reentrant), backward_inside=backward_inside)
    _assert_same(got, want)


@pytest.mark.parametrize("reentrant", MODES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_recompute_activation_inside_checkpoint_equals_plain(recipe, reentrant):
    """MoELayer(recompute_activation=True) under qmoe.checkpoint: the layer's rebuild replays the
    forward's state through the checkpoint's recompute, bit for bit."""
    torch.manual_seed(0)
    want = _step(recipe)
    torch.manual_seed(0)
    got = _step(recipe, _qmoe_checkpoint(reentrant), recompute=True)
    _assert_same(got, want)


@pytest.mark.parametrize("reentrant", MODES)
def test_checkpoint_under_torch_autocast(reentrant):
    recipe = DelayedScaling(amax_history_len=4)
    want = _step(recipe, amp=torch.bfloat16)
    got = _step(recipe, _qmoe_checkpoint(reentrant), amp=torch.bfloat16)
    _assert_same(got, want)


@pytest.mark.parametrize("reentrant", MODES)
@pytest.mark.parametrize("recipe", [pytest.param(None, id="bf16"), pytest.param(DelayedScaling(), id="delayed")])
def test_torch_utils_checkpoint_refuses_qmoe_modules(recipe, reentrant):
    def torch_checkpoint(fn, *args):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=reentrant)

    with pytest.raises(qmoe.UnsupportedError, match=r"qmoe\.checkpoint"):
        _step(recipe, torch_checkpoint, steps=1)
    if recipe is not None:  # the aborted backward left no pending update that blocks the next pass's
        _, state = _step(recipe, steps=1)
        assert (state["head.grad_output.scale"] != 1).all()


def test_nested_checkpoint_and_bad_arguments_raise():
    layer = qmoe.nn.Linear(32, 32)
    x = torch.randn(4, 32, requires_grad=True)
    with pytest.raises(qmoe.UnsupportedError, match="inside another qmoe.checkpoint"):
        qmoe.checkpoint(lambda t: qmoe.checkpoint(layer, t), x)
    with pytest.raises(TypeError, match="use_reentrant"):
        qmoe.checkpoint(layer, x, use_reentrant=None)


@pytest.mark.parametrize("device,amp", [p for p in AMP if p.id != "cpu-bf16"])
@pytest.mark.parametrize("backward_inside", WHERE)
@pytest.mark.parametrize("reentrant", MODES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpointed_gradients_equal_plain_on_gpu(recipe, reentrant, backward_inside, device, amp):
    torch.manual_seed(0)
    want = _step(recipe, backward_inside=backward_inside, device=device, amp=amp)
    torch.manual_seed(0)
    got = _step(recipe, _qmoe_checkpoint(reentrant), backward_inside=backward_inside, device=device, amp=amp)
    _assert_same(got, want)
