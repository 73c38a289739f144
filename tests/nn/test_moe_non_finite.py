"""A token with non-finite values in a MoELayer stays its own problem (NUMERICS.md, "Non-finite values").

Its router logits are NaN or +-inf, so it still gets exactly top_k experts (the routing rule of
qmoe/reference/router.py), and every other token's output and input gradient are what they are
when that token is not in the batch at all. CPU, so the reference backend; small shapes.
"""
import pytest
import torch

import qmoe
from qmoe.recipes import Float8CurrentScaling, MXFP8BlockScaling

H, F, E, K, T, BAD = 32, 16, 8, 2, 12, 5
INF, NAN = float("inf"), float("nan")


def _layer(**options):
    torch.manual_seed(0)
    return qmoe.nn.MoELayer(H, F, E, K, **options)


def _run(layer, x, g, recipe):
    x = x.clone().requires_grad_(True)
    with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
        y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.router.tokens_per_expert


def _poison(x, kind):
    x = x.clone()
    if kind == "nan":
        x[BAD] = NAN
    elif kind == "one_nan":
        x[BAD, 3] = NAN
    else:
        x[BAD, 0] = INF  # logits of +-inf, by the sign of each expert's weight
    return x


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling(), MXFP8BlockScaling()],
                         ids=["fp32", "current", "mxfp8"])
@pytest.mark.parametrize("kind", ["nan", "one_nan", "inf"])
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_a_non_finite_token_leaves_the_other_tokens_alone(recipe, kind, score_function):
    layer = _layer(score_function=score_function)
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
    # so the run without the token quantizes the same gradients (a per-tensor amax sees every
    # token's finite gradient, the poisoned token's included)
    g[BAD] = 0
    y, dx, tokens_per_expert = _run(layer, _poison(x, kind), g, recipe)
    assert int(tokens_per_expert.sum()) == T * K
    others = torch.arange(T) != BAD
    want_y, want_dx, _ = _run(layer, x[others], g[others], recipe)
    torch.testing.assert_close(y[others], want_y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx[others], want_dx, rtol=1e-6, atol=1e-6)


def test_auxiliary_losses_of_a_nan_token_keep_the_other_gradients_finite():
    layer = _layer(score_function="sigmoid", aux_loss_coeff=1e-2, seq_aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
                   num_groups=4, group_topk=2)
    gen = torch.Generator().manual_seed(2)
    x = _poison(torch.randn(T, H, generator=gen), "nan").requires_grad_(True)
    y = layer(x)
    others = torch.arange(T) != BAD
    (y[others].square().sum() + layer.aux_loss).backward()
    assert int(layer.router.tokens_per_expert.sum()) == T * K
    assert torch.isfinite(y[others]).all() and torch.isfinite(x.grad[others]).all()
