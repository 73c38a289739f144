"""`recompute_activation`: FC2's input is rebuilt in the backward instead of kept, same bits.

For every recipe and both grouped paths, a GroupedMLP / MoELayer with recompute_activation=True
gives the outputs, gradients and delayed-scaling states of the default layer bit for bit over
two steps, the backward running after the qmoe.autocast region closed (so delayed scaling's
scales have moved on and the rebuild must use the forward's), with torch.autocast on and off,
and compiled (fullgraph) as eager. The memory claim is measured:
the bytes the autograd graph keeps for the backward shrink by the kept operand, at least
R x F elements of the recipe's input format.
"""
import contextlib
import gc

import pytest
import torch

import qmoe
from qmoe.quant import QuantizedTensor
from qmoe.quant.grouped import GroupedTensor
from tests.nn.loop_cases import E, F, GPU_F, GPU_H, H, K, SPLITS
from tests.nn.recipe_cases import QUANTIZED

RECIPES = [pytest.param(None, id="plain")] + QUANTIZED
PATHS = ["grouped", "split"]
# bits per element of FC2's input operand (its columnwise copy under a recipe; fp32 without one)
INPUT_BITS = {None: 32, "DelayedScaling": 8, "Float8CurrentScaling": 8, "Float8BlockScaling": 8,
              "MXFP8BlockScaling": 8, "NVFP4BlockScaling": 4}


def _states(module):
    return {f"{name}.{role}.{k}": t for name, m in module.named_modules() if hasattr(m, "recipe_state")
            for role, q in m.recipe_state.quantizers.items() for k, t in q.state_dict().items()}


def _mlp_steps(recipe, recompute, path, device="cpu", steps=2, delay_wgrad=False, amp=None):
    """Two steps of a GroupedMLP (bias, probs taking gradients), under torch.autocast(amp) if
    given; everything observable."""
    torch.manual_seed(0)
    h, f = (H, F) if device == "cpu" else (GPU_H, GPU_F)
    mlp = qmoe.nn.GroupedMLP(E, h, f, bias=True, grouped_path=path, recompute_activation=recompute,
                             delay_wgrad_compute=delay_wgrad, device=device)
    splits = torch.tensor(SPLITS, device=device)
    seen = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(sum(SPLITS), h, generator=g).to(device).requires_grad_(True)
        probs = torch.rand(sum(SPLITS), generator=g).to(device).requires_grad_(True)
        region = torch.autocast(device, dtype=amp) if amp is not None else contextlib.nullcontext()
        with region, qmoe.autocast(recipe=recipe, enabled=recipe is not None):
            y = mlp(x, splits, probs)
        y.float().square().mean().backward()  # outside the region: delayed scaling's scales have moved on
        if delay_wgrad:
            mlp.backward_dw()
        seen += [y.detach(), x.grad, probs.grad] + [p.grad.clone() for p in mlp.parameters()]
        mlp.zero_grad(set_to_none=True)
    return seen, _states(mlp)


def _assert_equal(got, want):
    (got_t, got_s), (want_t, want_s) = got, want
    assert len(got_t) == len(want_t)
    for i, (a, b) in enumerate(zip(got_t, want_t)):
        assert torch.equal(a, b), f"tensor {i} differs"
    assert got_s.keys() == want_s.keys()
    for name in want_s:
        assert torch.equal(got_s[name], want_s[name]), f"state {name} differs"


@pytest.mark.parametrize("amp", [pytest.param(None, id="fp32"), pytest.param(torch.bfloat16, id="autocast-bf16")])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_recomputed_activation_gives_the_same_bits(recipe, path, amp):
    torch.manual_seed(1)  # NVFP4's stochastic rounding draws from torch's generator: the same stream
    want = _mlp_steps(recipe, False, path, amp=amp)
    torch.manual_seed(1)
    got = _mlp_steps(recipe, True, path, amp=amp)
    _assert_equal(got, want)


@pytest.mark.parametrize("recipe", [pytest.param(None, id="fp32"), QUANTIZED[0]])
def test_recompute_with_deferred_weight_gradients(recipe):
    want = _mlp_steps(recipe, False, "grouped", delay_wgrad=True)
    got = _mlp_steps(recipe, True, "grouped", delay_wgrad=True)
    _assert_equal(got, want)


# ---- memory: the bytes the autograd graph keeps for its backward

_PAYLOAD = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv", "amax",
            "columnwise_amax")


def _storages(obj, out: dict) -> None:
    """Record the storages obj holds: tensors, and of quantized tensors (one, a GroupedTensor, or
    a list) their data, scales and amaxes (not the group bookkeeping, [E]-sized)."""
    if isinstance(obj, torch.Tensor):
        s = obj.untyped_storage()
        out[s.data_ptr()] = s.nbytes()
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _storages(o, out)
    elif isinstance(obj, (QuantizedTensor, GroupedTensor)):
        for name in _PAYLOAD:
            _storages(getattr(obj, name), out)


def _saved_bytes(forward) -> tuple[torch.Tensor, int]:
    """(forward()'s output, bytes of the distinct storages its graph keeps for the backward).

    Counted: every tensor autograd saves (built-in nodes and save_for_backward, seen by a
    saved-tensor hook) and the quantized operands qmoe's grouped linear keeps on its ctx
    (`ctx.saved`, outside save_for_backward)."""
    held: dict = {}

    def pack(t):
        _storages(t, held)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward()
    todo, seen = [y.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        saved = getattr(node, "saved", None)
        if saved is not None:
            _storages([saved.x_operand, saved.w_operand], held)
        todo += [fn for fn, _ in node.next_functions]
    return y, sum(held.values())


def _kept_bytes(recipe, path, recompute):
    torch.manual_seed(0)
    mlp = qmoe.nn.GroupedMLP(E, H, F, bias=True, grouped_path=path, recompute_activation=recompute)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(SPLITS), H, generator=g, requires_grad=True)
    probs = torch.rand(sum(SPLITS), generator=g, requires_grad=True)
    splits = torch.tensor(SPLITS)
    with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
        y, kept = _saved_bytes(lambda: mlp(x, splits, probs))
    fc2_input = None
    if not recompute:  # what FC2 keeps of its input for the weight gradient
        node = y.grad_fn
        while not hasattr(node, "saved"):
            node = node.next_functions[0][0]
        # a plain operand went through save_for_backward (after the split sizes and offsets)
        operand = node.saved.x_operand
        if operand is None:
            operand = node.saved_tensors[2 + node.saved._AUTOGRAD.index("x_operand")]
        held: dict = {}
        _storages(operand, held)
        fc2_input = sum(held.values())
    return kept, fc2_input


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_recompute_keeps_less_for_the_backward(recipe, path):
    plain, operand = _kept_bytes(recipe, path, recompute=False)
    recomputed, _ = _kept_bytes(recipe, path, recompute=True)
    bits = INPUT_BITS[type(recipe).__name__ if recipe is not None else None]
    assert operand >= sum(SPLITS) * F * bits // 8  # the [R, F] operand, in the recipe's input format
    assert plain - recomputed == operand  # exactly that operand less; nothing else kept instead


def test_recompute_activation_arguments():
    with pytest.raises(TypeError, match="recompute_activation"):
        qmoe.nn.MoELayer(H, F, E, K, recompute_activation=1)
    layer = qmoe.nn.MoELayer(H, F, E, K, recompute_activation=True)
    assert layer.recompute_activation and layer.experts.recompute_activation
    layer.recompute_activation = False
    assert not layer.experts.recompute_activation
    with pytest.raises(ValueError, match="needs input_activation"):
        qmoe.ops.grouped_linear(torch.randn(8, H), torch.tensor([8]), torch.randn(1, F, H), recompute_activation=True)


@pytest.mark.parametrize("name, dtype", [pytest.param(None, torch.float32, id="fp32"),
                                         pytest.param("mxfp8", torch.bfloat16, id="mxfp8")])
def test_compiled_recompute_equals_eager_default(name, dtype):
    """torch.compile (fullgraph, aot_eager on the CPU) of a layer with recompute_activation gives
    the eager default layer's bits (no graph break: the rebuild keeps no log in compiled code)."""
    from tests.nn.test_moe_compile import _inputs, _layer, _recipe, _step

    layer = _layer(dtype)
    x, g = _inputs(dtype)
    want = _step(layer, layer, _recipe(name), x, g)
    layer.recompute_activation = True
    got = _step(layer, torch.compile(layer, backend="aot_eager", fullgraph=True), _recipe(name), x, g)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


# ---- the MoE layer on the GPU: the kernels, the same bits, less memory held after the forward

def _moe_step(recipe, recompute, amp):
    torch.manual_seed(0)
    layer = qmoe.nn.MoELayer(GPU_H, GPU_F, E, K, bias=True, device="cuda", recompute_activation=recompute)
    x = torch.randn(512, GPU_H, device="cuda", requires_grad=True)
    gc.collect()  # an earlier step's cyclic garbage freed mid-forward would read as negative memory
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    region = torch.autocast("cuda", dtype=amp) if amp is not None else contextlib.nullcontext()
    with region, qmoe.autocast(recipe=recipe, enabled=recipe is not None):
        y = layer(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    (y.float().square().mean() + layer.aux_loss).backward()
    return [y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()], held


@pytest.mark.gpu
@pytest.mark.parametrize("amp", [pytest.param(None, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_moe_recompute_same_bits_less_memory(recipe, amp):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a CUDA GPU of compute capability >= 9.0")
    for recompute in (False, True):  # lazily allocated workspaces and caches are not the step's memory
        _moe_step(recipe, recompute, amp)
    torch.manual_seed(1)
    want, held_plain = _moe_step(recipe, False, amp)
    torch.manual_seed(1)
    got, held_recomputed = _moe_step(recipe, True, amp)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"tensor {i} differs"
    bits = INPUT_BITS[type(recipe).__name__ if recipe is not None else None]
    if recipe is None and amp is not None:
        bits = 16
    rows = 512 * K  # at least the routed rows of FC2's [R, F] input
    assert held_plain - held_recomputed >= rows * GPU_F * bits // 8
