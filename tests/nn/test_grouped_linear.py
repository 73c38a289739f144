"""qmoe.nn.GroupedLinear on CPU: a per-group loop in fp32, every recipe, grouped == split, scaled
bias gradients, empty groups, state_dict layouts, delayed weight gradients and bad input."""
import pytest
import torch

import qmoe
from qmoe.recipes import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling
from tests.nn.recipe_cases import DETERMINISTIC, QUANTIZED
from tests.tolerances import assert_within_tolerance, recipe_tolerance

E, K, N = 4, 64, 48

RECIPES = [pytest.param(None, id="fp32")] + QUANTIZED


def _splits(recipe, sizes):
    """Group sizes padded to the recipe's align_size, as moe_permute would; a zero-row tail after them."""
    align = recipe.align_size if recipe is not None else 1
    padded = [-(-s // align) * align for s in sizes]
    return torch.tensor(padded), sum(padded) + 2 * align


def _plain(x, splits, w, b=None, scales=None):
    """y[rows of g] = x_g @ w_g^T + b_g * scales[row]; rows past sum(splits) belong to the last group."""
    bounds, start = [], 0
    for g, m in enumerate(splits.tolist()):
        end = x.shape[0] if g == len(splits) - 1 else start + m
        bounds.append((start, end))
        start = end
    out = []
    for g, (a, c) in enumerate(bounds):
        y = x[a:c] @ w[g].t()
        if b is not None:
            y = y + b[g] * (scales[a:c, None] if scales is not None else 1)
        out.append(y)
    return torch.cat(out)


def _run(layer, x, splits, g, recipe, scales=None):
    layer.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    s = None if scales is None else scales.detach().clone().requires_grad_(True)
    with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
        y = layer(x, splits, s)
    y.backward(g)
    grads = [p.grad.clone() for p in layer.weights() + layer.biases()]
    return [y.detach(), x.grad] + grads + ([s.grad] if s is not None else [])


def _assert_fp32_close(out, ref, what=""):
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()), msg=what)


# ------------------------------------------------------------------ fp32 against a per-group loop

@pytest.mark.parametrize("path", ["grouped", "split"])
@pytest.mark.parametrize("single", [True, False], ids=["single", "per-expert"])
@pytest.mark.parametrize("sizes", [[5, 0, 17, 3], [0, 0, 0, 9], [7, 1, 0, 0]], ids=["jagged", "only-last", "tail-last"])
def test_fp32_matches_per_group_loop(path, single, sizes):
    torch.manual_seed(0)
    layer = qmoe.nn.GroupedLinear(E, K, N, single_grouped_weight=single, single_grouped_bias=single,
                                  grouped_path=path)
    splits = torch.tensor(sizes)
    x = torch.randn(sum(sizes) + 3, K)  # 3 tail rows join the last group
    g = torch.randn(x.shape[0], N)
    w = layer.stacked_weight().detach().clone().requires_grad_(True)
    b = layer.stacked_bias().detach().clone().requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    ref = _plain(xr, splits, w, b)
    ref.backward(g)
    y, dx, *grads = _run(layer, x, splits, g, None)
    _assert_fp32_close(y, ref.detach(), "y")
    _assert_fp32_close(dx, xr.grad, "dx")
    dw = grads[0] if single else torch.stack(grads[:E])
    db = grads[-1] if single else torch.stack(grads[E:])
    _assert_fp32_close(dw, w.grad, "dW")
    _assert_fp32_close(db, b.grad, "db")


def test_fp32_no_bias_and_no_rows():
    layer = qmoe.nn.GroupedLinear(E, K, N, bias=False)
    assert layer.bias is None and layer.biases() == [] and layer.stacked_bias() is None
    y = layer(torch.zeros(0, K), torch.zeros(E, dtype=torch.int64))
    assert y.shape == (0, N)


# ------------------------------------------------------------------ scaled bias

@pytest.mark.parametrize("path", ["grouped", "split"])
def test_scale_bias_gradients_match_autograd_of_plain_formula(path):
    torch.manual_seed(1)
    layer = qmoe.nn.GroupedLinear(E, K, N, scale_bias=True, grouped_path=path)
    with torch.no_grad():
        layer.bias.normal_()  # large enough that the bias terms matter in every gradient
    splits = torch.tensor([6, 0, 9, 4])
    x, scales = torch.randn(21, K), torch.rand(21)
    g = torch.randn(21, N)
    y, dx, dw, db, ds = _run(layer, x, splits, g, None, scales)
    xr, sr = x.clone().requires_grad_(True), scales.clone().requires_grad_(True)
    w = layer.weight.detach().clone().requires_grad_(True)
    b = layer.bias.detach().clone().requires_grad_(True)
    ref = _plain(xr, splits, w, b, sr)
    ref.backward(g)
    for name, o, r in [("y", y, ref.detach()), ("dx", dx, xr.grad), ("dW", dw, w.grad), ("dbias", db, b.grad),
                       ("dscales", ds, sr.grad)]:
        _assert_fp32_close(o, r, name)
    assert db[1].abs().sum() == 0  # the empty group


@pytest.mark.parametrize("recipe", [MXFP8BlockScaling(), Float8CurrentScaling()], ids=["mxfp8", "current"])
def test_scale_bias_gradients_are_not_quantized(recipe):
    """dbias and dscales read the incoming gradient, never a quantized copy: same bits as in fp32."""
    torch.manual_seed(2)
    layer = qmoe.nn.GroupedLinear(E, K, N, scale_bias=True)
    splits, _ = _splits(recipe, [6, 0, 9, 4])
    rows = int(splits.sum())
    x, scales, g = torch.randn(rows, K), torch.rand(rows), torch.randn(rows, N)
    *_, db, ds = _run(layer, x, splits, g, recipe, scales)
    *_, db_ref, ds_ref = _run(layer, x, splits, g, None, scales)
    assert torch.equal(db, db_ref) and torch.equal(ds, ds_ref)


# ------------------------------------------------------------------ recipes

@pytest.mark.parametrize("recipe", RECIPES[1:])
def test_recipe_within_tolerance_of_fp32(recipe):
    torch.manual_seed(3)
    layer = qmoe.nn.GroupedLinear(E, K, N)
    splits, rows = _splits(recipe, [40, 0, 72, 17])
    x, g = torch.randn(rows, K), torch.randn(rows, N)
    ref = _run(layer, x, splits, g, None)
    if isinstance(recipe, DelayedScaling):  # fresh scales are 1: one step records the amaxes
        _run(layer, x, splits, g, recipe)
    out = _run(layer, x, splits, g, recipe)
    rtol, atol = recipe_tolerance(recipe)
    for name, o, r in zip(("y", "dx", "dW", "db"), out, ref):
        assert o.shape == r.shape
        assert_within_tolerance(o, r, rtol, atol, name)
    assert not torch.equal(out[0], ref[0])  # it did quantize


@pytest.mark.parametrize("recipe", DETERMINISTIC)
@pytest.mark.parametrize("single", [True, False], ids=["single", "per-expert"])
def test_grouped_path_equals_split_path(recipe, single):
    torch.manual_seed(4)
    splits, rows = _splits(recipe, [40, 0, 72, 17])
    x, g, scales = torch.randn(rows, K), torch.randn(rows, N), torch.rand(rows)
    results = []
    for path in ("grouped", "split"):
        torch.manual_seed(5)
        layer = qmoe.nn.GroupedLinear(E, K, N, single_grouped_weight=single, single_grouped_bias=single,
                                      scale_bias=True, grouped_path=path)
        steps = 2 if isinstance(recipe, DelayedScaling) else 1  # the second step uses recorded amaxes
        for _ in range(steps):
            out = _run(layer, x, splits, g, recipe, scales)
        results.append(out)
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"output {i} differs between the grouped and split paths"


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("empty", [0, 2], ids=["first", "middle"])
def test_empty_group_gets_exact_zero_weight_gradient(recipe, empty):
    torch.manual_seed(6)
    sizes = [33, 20, 17, 40]
    sizes[empty] = 0
    splits, rows = _splits(recipe, sizes)
    layer = qmoe.nn.GroupedLinear(E, K, N, single_grouped_weight=False, single_grouped_bias=False)
    x, g = torch.randn(rows, K), torch.randn(rows, N)
    y, dx, *grads = _run(layer, x, splits, g, recipe)
    for t in [y, dx] + grads:
        assert torch.isfinite(t).all()
    assert torch.equal(grads[empty], torch.zeros(N, K))
    assert torch.equal(grads[E + empty], torch.zeros(N))
    assert all(grads[i].abs().sum() > 0 for i in range(E) if i != empty)


# ------------------------------------------------------------------ state_dict layouts

LAYOUTS = [(True, True), (True, False), (False, True), (False, False)]


def _logical(layer):
    return layer.stacked_weight().detach(), layer.stacked_bias().detach()


@pytest.mark.parametrize("src", LAYOUTS, ids=lambda v: f"src-w{int(v[0])}b{int(v[1])}")
@pytest.mark.parametrize("dst", LAYOUTS, ids=lambda v: f"dst-w{int(v[0])}b{int(v[1])}")
def test_state_dict_round_trips_across_layouts(src, dst):
    torch.manual_seed(7)
    a = qmoe.nn.GroupedLinear(3, 8, 5, single_grouped_weight=src[0], single_grouped_bias=src[1])
    b = qmoe.nn.GroupedLinear(3, 8, 5, single_grouped_weight=dst[0], single_grouped_bias=dst[1])
    sd = a.state_dict()
    keys = set(sd)
    b.load_state_dict(sd)
    assert set(sd) == keys  # the caller's dict is left alone
    for x, y in zip(_logical(a), _logical(b)):
        assert torch.equal(x, y)
    want = ({"weight"} if dst[0] else {f"weight{g}" for g in range(3)}) | \
        ({"bias"} if dst[1] else {f"bias{g}" for g in range(3)})
    assert set(b.state_dict()) == want | {"_extra_state"}  # the recipe state
    a2 = qmoe.nn.GroupedLinear(3, 8, 5, single_grouped_weight=src[0], single_grouped_bias=src[1])
    a2.load_state_dict(b.state_dict())  # and back
    for x, y in zip(_logical(a), _logical(a2)):
        assert torch.equal(x, y)


def test_state_dict_without_bias():
    a = qmoe.nn.GroupedLinear(3, 8, 5, bias=False)
    b = qmoe.nn.GroupedLinear(3, 8, 5, bias=False, single_grouped_weight=False)
    b.load_state_dict(a.state_dict())
    assert set(b.state_dict()) == {"weight0", "weight1", "weight2", "_extra_state"}
    assert torch.equal(b.stacked_weight(), a.weight)


@pytest.mark.parametrize("single", [True, False], ids=["into-single", "into-per-expert"])
@pytest.mark.parametrize("damage, match", [
    ("drop_weight1", "incomplete"),
    ("extra_weight3", "incomplete"),
    ("drop_bias0", "incomplete"),
    ("both_weight_forms", "ambiguous"),
    ("both_bias_forms", "ambiguous"),
])
def test_incomplete_or_ambiguous_state_dict_raises(single, damage, match):
    src = qmoe.nn.GroupedLinear(3, 8, 5, single_grouped_weight=False, single_grouped_bias=False)
    stacked = qmoe.nn.GroupedLinear(3, 8, 5)
    sd = src.state_dict()
    if damage == "drop_weight1":
        del sd["weight1"]
    elif damage == "extra_weight3":
        sd["weight3"] = sd["weight0"].clone()
    elif damage == "drop_bias0":
        del sd["bias0"]
    elif damage == "both_weight_forms":
        sd["weight"] = stacked.weight.detach()
    else:
        sd["bias"] = stacked.bias.detach()
    dst = qmoe.nn.GroupedLinear(3, 8, 5, single_grouped_weight=single, single_grouped_bias=single)
    before = [t.clone() for t in dst.state_dict().values() if isinstance(t, torch.Tensor)]
    with pytest.raises(ValueError, match=match):
        dst.load_state_dict(sd)
    after = [t for t in dst.state_dict().values() if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_stacked_state_dict_with_wrong_expert_count_raises():
    sd = qmoe.nn.GroupedLinear(2, 8, 5).state_dict()
    with pytest.raises(ValueError, match="2 experts"):
        qmoe.nn.GroupedLinear(3, 8, 5, single_grouped_weight=False, single_grouped_bias=False).load_state_dict(sd)


# ------------------------------------------------------------------ delayed weight gradients

@pytest.mark.parametrize("recipe", [None, MXFP8BlockScaling()], ids=["fp32", "mxfp8"])
@pytest.mark.parametrize("path", ["grouped", "split"])
@pytest.mark.parametrize("single", [True, False], ids=["single", "per-expert"])
def test_delay_wgrad_compute_equals_normal_backward(recipe, path, single):
    torch.manual_seed(8)
    kw = dict(single_grouped_weight=single, single_grouped_bias=single, grouped_path=path, scale_bias=True)
    normal = qmoe.nn.GroupedLinear(E, K, N, **kw)
    delayed = qmoe.nn.GroupedLinear(E, K, N, delay_wgrad_compute=True, **kw)
    delayed.load_state_dict(normal.state_dict())
    seen = {id(m): [] for m in (normal, delayed)}
    for m in (normal, delayed):
        for p in m.weights():
            p.register_post_accumulate_grad_hook(lambda p, log=seen[id(m)]: log.append(p.grad is not None))
    splits, rows = _splits(recipe, [40, 0, 20, 17])
    steps = [(torch.randn(rows, K), torch.rand(rows), torch.randn(rows, N)) for _ in range(2)]
    grads = {}
    for m in (normal, delayed):
        for x, s, g in steps:  # two backward passes accumulate
            with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
                y = m(x.requires_grad_(True), splits, s)
            y.backward(g)
        if m is delayed:
            assert all(p.grad is None for p in m.weights()) and seen[id(m)] == []
            assert all(b.grad is not None for b in m.biases())  # bias gradients are not deferred
            m.backward_dw()
            assert m._wgrad_queue == []
        grads[id(m)] = [p.grad for p in m.weights() + m.biases()]
    for a, b in zip(grads[id(normal)], grads[id(delayed)]):
        assert torch.equal(a, b)
    assert seen[id(normal)] == seen[id(delayed)] == [True] * (2 * len(normal.weights()))


def test_delay_wgrad_compute_without_input_grad():
    """The weight gradient is still deferred when nothing else in the layer needs a gradient."""
    layer = qmoe.nn.GroupedLinear(E, K, N, bias=False, delay_wgrad_compute=True)
    ref = qmoe.nn.GroupedLinear(E, K, N, bias=False)
    ref.load_state_dict(layer.state_dict())
    x, splits = torch.randn(12, K), torch.tensor([3, 3, 0, 6])
    layer(x, splits).sum().backward()
    layer.backward_dw()
    ref(x, splits).sum().backward()
    assert torch.equal(layer.weight.grad, ref.weight.grad)


def test_delay_wgrad_compute_under_no_grad_queues_nothing():
    layer = qmoe.nn.GroupedLinear(E, K, N, delay_wgrad_compute=True)
    with torch.no_grad():
        layer(torch.randn(4, K), torch.tensor([1, 1, 1, 1]))
    assert layer._wgrad_queue == []


# ------------------------------------------------------------------ bad input

def _layer(**kw):
    return qmoe.nn.GroupedLinear(3, 8, 4, **kw)


@pytest.mark.parametrize("call, exc", [
    (lambda: _layer()(torch.randn(5, 9), torch.tensor([1, 2, 2])), ValueError),
    (lambda: _layer()(torch.randn(5), torch.tensor([1, 2, 2])), ValueError),
    (lambda: _layer()(torch.randint(0, 3, (5, 8)), torch.tensor([1, 2, 2])), TypeError),
    (lambda: _layer()(torch.randn(5, 8), [1, 2, 2]), TypeError),
    (lambda: _layer()(torch.randn(5, 8), torch.tensor([1.0, 2.0, 2.0])), TypeError),
    (lambda: _layer()(torch.randn(5, 8), torch.tensor([1, 4])), ValueError),
    (lambda: _layer()(torch.randn(5, 8), torch.tensor([1, 2, 2], device="meta")), ValueError),
    (lambda: _layer()(torch.randn(5, 8), torch.tensor([1, 2, 3])), ValueError),
    (lambda: _layer()(torch.randn(5, 8), torch.tensor([4, -1, 2])), ValueError),
    (lambda: _layer(grouped_path="split")(torch.randn(5, 8), torch.tensor([4, -1, 2])), ValueError),
    (lambda: _layer(grouped_path="split")(torch.randn(5, 8), torch.tensor([3, 3, 0])), ValueError),
    (lambda: _layer(scale_bias=True)(torch.randn(5, 8), torch.tensor([1, 2, 2])), ValueError),
    (lambda: _layer(scale_bias=True)(torch.randn(5, 8), torch.tensor([1, 2, 2]), torch.rand(4)), ValueError),
    (lambda: _layer(scale_bias=True)(torch.randn(5, 8), torch.tensor([1, 2, 2]), torch.ones(5, dtype=torch.int32)),
     ValueError),
    (lambda: _layer()(torch.randn(5, 8), torch.tensor([1, 2, 2]), torch.rand(5)), ValueError),
    (lambda: _layer(grouped_path="fast"), ValueError),
    (lambda: _layer(bias=False, scale_bias=True), ValueError),
    (lambda: qmoe.nn.GroupedLinear(0, 8, 4), ValueError),
    (lambda: qmoe.nn.GroupedLinear(3, 8, True), ValueError),
], ids=["features", "1-d", "int-x", "list-splits", "float-splits", "splits-shape", "splits-device",
        "splits-sum-too-big", "negative-split", "negative-split-split-path", "sum-too-big-split-path",
        "missing-scales", "scales-shape", "int-scales", "scales-without-scale-bias", "path-name",
        "scale-bias-without-bias", "zero-groups", "bool-features"])
def test_bad_input_raises(call, exc):
    with pytest.raises(exc):
        call()


def test_split_sizes_below_the_rows_give_the_tail_to_the_last_group():
    torch.manual_seed(9)
    layer = _layer()
    x = torch.randn(7, 8)
    y = layer(x, torch.tensor([2, 0, 1]))
    want = torch.cat([x[:2] @ layer.weight[0].t() + layer.bias[0], x[2:] @ layer.weight[2].t() + layer.bias[2]])
    _assert_fp32_close(y.detach(), want.detach())
