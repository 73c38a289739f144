"""A module keeps no autograd graph once the backward has run.

The router's logits and the layers' aux losses are kept on the modules after a forward, with
autograd, so a loss computed outside (Hugging Face's load-balancing loss) can use them. Kept past
the backward they would hold the whole step's graph into the next one, with the parameters'
gradient-accumulation nodes, which remember the CUDA stream of the step that made them: a step
captured in a CUDA graph after eager steps then fails (tests/nn/test_moe_gpu.py runs that habit).
"""
import pytest
import torch

import qmoe
from tests.nn.recipe_cases import QUANTIZED

T, H, F, E, K = 32, 64, 96, 4, 2


def _layer(**kw):
    torch.manual_seed(0)
    return qmoe.nn.MoELayer(H, F, E, K, aux_loss_coeff=1e-2, z_loss_coeff=1e-3, expert_bias=True,
                            shared_expert_ffn_hidden_size=F, shared_expert_gate=True, **kw)


def _graph_holders(module: torch.nn.Module) -> list[str]:
    """Names of the tensors any submodule keeps as an attribute with an autograd graph."""
    return [f"{name}.{attr}" if name else attr
            for name, m in module.named_modules()
            for attr, value in vars(m).items()
            if isinstance(value, torch.Tensor) and value.grad_fn is not None]


@pytest.mark.parametrize("recipe", [pytest.param(None, id="fp32")] + QUANTIZED)
def test_backward_releases_the_kept_results(recipe):
    layer = _layer()
    x = torch.randn(2, T // 2, H, requires_grad=True)
    with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
        y = layer(x)
    assert sorted(_graph_holders(layer)) == ["aux_loss", "router.aux_loss", "router.logits"]
    kept = {name: t.detach().clone() for name, t in
            [("aux_loss", layer.aux_loss), ("logits", layer.router.logits)]}
    (y.square().mean() + layer.aux_loss).backward()
    assert _graph_holders(layer) == []
    assert torch.equal(layer.aux_loss, kept["aux_loss"]) and layer.aux_loss.item() > 0
    assert torch.equal(layer.router.logits, kept["logits"])
    assert torch.equal(layer.router.aux_loss, layer.aux_loss)


def test_the_kept_logits_carry_autograd_until_the_backward():
    """A loss of the kept logits computed outside (the HF pattern) reaches the router's weight and
    adds to the gradient of the layer's output."""
    torch.manual_seed(0)
    layer = qmoe.nn.MoELayer(H, F, E, K)  # no expert bias: every forward routes alike
    x = torch.randn(T, H)

    def router_grad(output: bool, outside: bool) -> torch.Tensor:
        layer.zero_grad(set_to_none=True)
        y = layer(x)
        loss = (y.square().sum() if output else 0) + (layer.router.logits.softmax(-1).square().sum() if outside else 0)
        loss.backward()
        assert _graph_holders(layer) == []
        return layer.router.weight.grad.clone()

    alone = router_grad(False, True)
    assert alone.abs().sum() > 0
    torch.testing.assert_close(router_grad(True, True), router_grad(True, False) + alone, rtol=1e-5, atol=1e-6)


def test_checkpointed_layer_releases_too():
    layer = _layer()
    x = torch.randn(T, H, requires_grad=True)
    with qmoe.autocast(recipe=qmoe.recipes.DelayedScaling()):
        y = qmoe.checkpoint(layer, x)
        (y.square().mean() + layer.aux_loss).backward()
    assert _graph_holders(layer) == []
    assert layer.aux_loss.item() > 0
