"""The permute fused into FC1's input quantization (`moe_permute(..., gather=True)`, which MoELayer
uses under a recipe) and the unpermute run inside FC2 (`grouped_linear(..., unpermute=)`, whose
backward quantizes the output gradient's rows gathered from the tokens' gradient) give the unfused
layer's outputs and gradients bit for bit, for every recipe, through a few steps (delayed
scaling's history included); on the GPU the quantize kernels then read the tokens and their
gradient themselves (no permuted copy of either is written) and the Gluon casts gather as they
load. `QMOE_PERMUTE_GATHER=0` / `QMOE_UNPERMUTE_INSIDE=0` are the unfused layer.
"""
from __future__ import annotations

import copy

import pytest
import torch

import qmoe
from qmoe.contracts.carriers import AmaxSlot, GatheredRows, RowsWithAmax, permuted_sources
from qmoe.ops.grouped_linear import observe_steps
from qmoe.recipes import recipe_from_config
from tests.kernels.interpret import INTERPRETING

RECIPES = ("delayed", "current", "block", "mxfp8", "nvfp4")
on_gpu = pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _steps(layer, x0, recipe_name, gather: bool, monkeypatch, steps: int = 2, inside: bool = True):
    monkeypatch.setenv("QMOE_PERMUTE_GATHER", "1" if gather else "0")
    monkeypatch.setenv("QMOE_UNPERMUTE_INSIDE", "1" if inside else "0")
    layer = copy.deepcopy(layer)
    x = x0.clone().requires_grad_()
    torch.manual_seed(1)  # NVFP4's stochastic rounding draws from it
    recipe = recipe_from_config({"name": recipe_name})
    for _ in range(steps):
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        with qmoe.autocast(recipe=recipe):
            y = layer(x)
        (y.float().square().mean() + layer.aux_loss).backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


def _same_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    assert torch.equal(a.view(raw), b.view(raw)), what


def _layer(device, hidden=256, ffn=128, experts=4, top_k=2, bias=False):
    torch.manual_seed(0)
    return qmoe.nn.MoELayer(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, top_k=top_k,
                            aux_loss_coeff=1e-2, device=device, bias=bias)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fused_permute_gives_the_unfused_bits(recipe, monkeypatch):
    layer = _layer("cpu")
    x = torch.randn(2, 24, 256)
    fused = _steps(layer, x, recipe, True, monkeypatch)
    unfused = _steps(layer, x, recipe, False, monkeypatch)
    for i, (a, b) in enumerate(zip(fused, unfused)):
        _same_bits(a, b, f"output / gradient {i}")


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_unpermute_inside_fc2_gives_the_unfused_bits(recipe, bias, monkeypatch):
    """FC2 summing its rows back to the tokens itself, its backward quantizing dy's rows gathered from
    the tokens' gradient (the bias gradient from those rows copied), against moe_unpermute after it;
    and the gradient's quantize step really is handed the gathered rows."""
    layer = _layer("cpu", bias=bias)
    x = torch.randn(2, 24, 256)
    seen = []

    def watch(plan, step, inputs, out):
        if step == "quantize_grad":  # current scaling's dy comes with its amax
            dy = inputs[0]
            seen.append(type(dy.rows if isinstance(dy, RowsWithAmax) else dy))

    with observe_steps(watch):
        inside = _steps(layer, x, recipe, True, monkeypatch, inside=True)
    assert seen == [GatheredRows, torch.Tensor] * 2  # FC2's dy gathered, then FC1's (from FC2's dgrad); 2 steps
    apart = _steps(layer, x, recipe, True, monkeypatch, inside=False)
    for i, (a, b) in enumerate(zip(inside, apart)):
        _same_bits(a, b, f"output / gradient {i}")


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_unpermute_inside_with_non_finite_gradients(recipe):
    """grouped_linear(..., unpermute=) against grouped_linear then moe_unpermute (current scaling's
    grad amax from the unpermute's backward, handed by an AmaxSlot) when the tokens' gradient holds
    NaN and inf: the same dx and dW bits (the amax counts finite values only, NUMERICS.md)."""
    gen = torch.Generator().manual_seed(4)
    t, e, h, n = 40, 4, 128, 64
    x = torch.randn(t, h, generator=gen)
    probs, routing_map = qmoe.ops.topk_route(torch.randn(t, e, generator=gen), 2)
    w0 = torch.randn(e, n, h, generator=gen)
    dout = torch.randn(t, n, generator=gen)
    dout[3, 5], dout[7, 0], dout[11, 9] = float("nan"), float("inf"), -float("inf")
    rec = recipe_from_config({"name": recipe})
    quantizers = {r: rec.quantizer(r) for r in ("input", "weight", "grad_output")}
    results = []
    for inside in (True, False):
        xi, w = x.clone().requires_grad_(), w0.clone().requires_grad_()
        rows, _, row_id_map, splits = qmoe.ops.moe_permute(xi, routing_map, probs, align_size=rec.align_size,
                                                           top_k=2, gather=True)
        if inside:
            out = qmoe.ops.grouped_linear(rows, splits.long(), w, quantizers=quantizers, unpermute=row_id_map)
        else:
            slot = AmaxSlot() if quantizers["grad_output"].takes_amax else None
            y = qmoe.ops.grouped_linear(rows, splits.long(), w, quantizers=quantizers, grad_output_amax=slot)
            out = qmoe.ops.moe_unpermute(y, row_id_map, grad_amax=slot)
        out.backward(dout)
        results.append((out.detach(), xi.grad, w.grad))
    for i, (a, b) in enumerate(zip(*results)):
        _same_bits(a, b, f"output / gradient {i}")


def test_unpermute_argument_errors():
    x = torch.randn(8, 16)
    probs, routing_map = qmoe.ops.topk_route(torch.randn(8, 4), 2)
    rows, _, row_id_map, splits = qmoe.ops.moe_permute(x, routing_map, probs, top_k=2)
    w = torch.randn(4, 8, 16)
    with pytest.raises(TypeError, match="unpermute must be the RowIdMap"):
        qmoe.ops.grouped_linear(rows, splits.long(), w, unpermute=row_id_map.rows)
    with pytest.raises(ValueError, match="exclude each other"):
        qmoe.ops.grouped_linear(rows, splits.long(), w, unpermute=row_id_map, grad_output_amax=AmaxSlot())
    with pytest.raises(ValueError, match="permuted rows"):
        qmoe.ops.grouped_linear(rows[:-1], splits.long(), w, unpermute=row_id_map)
    # without a recipe the unpermute runs after the op: moe_unpermute's result and gradients
    xr = rows.detach().requires_grad_()
    got = qmoe.ops.grouped_linear(xr, splits.long(), w, unpermute=row_id_map)
    got.square().sum().backward()
    want_x = xr.grad.clone()
    xr.grad = None
    want = qmoe.ops.moe_unpermute(qmoe.ops.grouped_linear(xr, splits.long(), w), row_id_map)
    want.square().sum().backward()
    assert got.shape == (8, 8) and torch.equal(got, want) and torch.equal(want_x, xr.grad)


def test_gathered_rows_stand_for_the_permuted_rows():
    """The index moe_permute(gather=True) makes picks each permuted row's token (-1: padding), and
    grouped_linear without a recipe (no kernel gathers there) copies the rows and differentiates
    through them as the permute does."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 16, generator=gen, requires_grad=True)
    probs, routing_map = qmoe.ops.topk_route(torch.randn(6, 4, generator=gen), 2)
    rows, row_probs, row_id_map, splits = qmoe.ops.moe_permute(x, routing_map, probs, align_size=4, top_k=2,
                                                               gather=True)
    assert isinstance(rows, GatheredRows) and rows.source is x and rows.shape == (6 * 2 + 4 * 3, 16)
    want, *_ = qmoe.ops.moe_permute(x, routing_map, probs, align_size=4, top_k=2)
    assert torch.equal(rows.materialize(), want)
    assert torch.equal(rows.index, permuted_sources(row_id_map))
    assert int((rows.index < 0).sum()) == rows.shape[0] - 12  # 12 token copies, the rest padding
    w = torch.randn(4, 8, 16, generator=gen, requires_grad=True)
    y = qmoe.ops.grouped_linear(rows, splits.long(), w)
    y.square().sum().backward()
    got = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    qmoe.ops.grouped_linear(want, splits.long(), w).square().sum().backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], w.grad)


def test_gathered_rows_need_their_map():
    x = torch.randn(4, 16)
    rows = GatheredRows(x, torch.tensor([0, 1, -1, 3], dtype=torch.int32))
    with pytest.raises(TypeError, match="row_id_map"):
        qmoe.ops.grouped_linear(rows, torch.tensor([4]), torch.randn(1, 8, 16))
    with pytest.raises(ValueError, match="index"):
        qmoe.quant.GroupedTensor.quantize(GatheredRows(x, torch.tensor([0.5])), [1],
                                          recipe_from_config({"name": "block"}).quantizer("input"))


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_fused_permute_on_the_gpu(recipe, monkeypatch):
    """Bit for bit the unfused layer on the kernels (Gluon casts gathering by cp.async included), and
    no permuted copy of the tokens is written: the permute's scatter kernel does not run."""
    layer = _layer("cuda", hidden=512, ffn=256, experts=8, top_k=3)
    x = torch.randn(4, 100, 512, device="cuda", dtype=torch.bfloat16)
    layer = layer.to(torch.bfloat16)
    fused = _steps(layer, x, recipe, True, monkeypatch, steps=3)
    unfused = _steps(layer, x, recipe, False, monkeypatch, steps=3)
    for i, (a, b) in enumerate(zip(fused, unfused)):
        _same_bits(a, b, f"output / gradient {i}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _steps(layer, x, recipe, True, monkeypatch, steps=1)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert not any("_scatter_rows_kernel" in n for n in names), sorted(names)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_unpermute_inside_on_the_gpu(recipe, monkeypatch):
    """FC2's unpermute inside the op on the kernels: bit for bit the unfused layer (with biases, so the
    bias gradient's copy of the rows runs too), and the unpermute's backward, the kernel that wrote
    the [R, H] copy of the output gradient, does not run."""
    layer = _layer("cuda", hidden=512, ffn=256, experts=8, top_k=3, bias=True).to(torch.bfloat16)
    x = torch.randn(4, 100, 512, device="cuda", dtype=torch.bfloat16)
    inside = _steps(layer, x, recipe, True, monkeypatch, steps=3, inside=True)
    apart = _steps(layer, x, recipe, True, monkeypatch, steps=3, inside=False)
    for i, (a, b) in enumerate(zip(inside, apart)):
        _same_bits(a, b, f"output / gradient {i}")
    layer = _layer("cuda", hidden=512, ffn=256, experts=8, top_k=3).to(torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _steps(layer, x, recipe, True, monkeypatch, steps=1)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert not any("_scatter_grad_rows_kernel" in n for n in names), sorted(names)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gluon_casts_gather(dtype):
    """The Gluon FP8 1x128 and MXFP8 casts (both copies, MXFP8 also as values) of gathered rows: the
    permuted rows' bits, with padding rows, uneven groups and NaN / inf among the tokens."""
    from qmoe.contracts.formats import E4M3, ScaleMode
    from qmoe.kernels import grouped_quantize as gq
    torch.manual_seed(5)
    t, e, k, align = 700, 9, 4, 32
    x = (torch.randn(t, 1152, device="cuda") * 10.0 ** torch.randint(-3, 4, (t, 1), device="cuda")).to(dtype)
    x.view(-1)[::997] = float("nan")
    x.view(-1)[5::1999] = float("inf")
    probs, routing_map = qmoe.ops.topk_route(torch.randn(t, e, device="cuda"), k)
    routing_map[:, 0] = False  # an empty expert
    rows, _, row_id_map, splits = qmoe.ops.moe_permute(x, routing_map, probs, align_size=align, top_k=k,
                                                       num_rows=-(-(t * k + e * (align - 1)) // align) * align,
                                                       gather=True)
    permuted = rows.materialize()
    groups = torch.cat((splits[:-1], splits[-1:] + (rows.shape[0] - splits.sum()))).long()
    cases = [(gq.grouped_quantize_fp8_block, (1, 128, E4M3, True, 0.0, True, True)),
             (gq.grouped_quantize_fp8_block, (1, 128, E4M3, True, 0.0, False, True))]
    if dtype == torch.bfloat16:
        cases += [(gq.grouped_quantize_mxfp8, (E4M3, ScaleMode.ROUND_UP, True, True)),
                  (gq.grouped_quantize_mxfp8, (E4M3, ScaleMode.ROUND_UP, True, True, ("rowwise",))),
                  (gq.grouped_quantize_mxfp8, (E4M3, ScaleMode.ROUND_UP, True, True, ("rowwise", "columnwise")))]
    for fn, args in cases:
        for i, (got, want) in enumerate(zip(fn(rows, groups, *args), fn(permuted, groups, *args))):
            if got is None or want is None:
                assert got is None and want is None
                continue
            _same_bits(got, want, f"{fn.__name__}{args} output {i}")
