"""torch.compile(MoELayer): the grouped path is one graph (no graph breaks) and matches eager.

Usage under test: `with qmoe.autocast(recipe=r): y = torch.compile(layer)(x)`, autocast outside
the compiled region. The layer reads the region's recipe through a thread-local that
torch.compile guards on, so each recipe gets its own graph and a new region reuses it.
`fullgraph=True` turns any graph break (forward, or the autograd Functions' backward, which
Dynamo traces too) into an error.

CPU (reference backend): backend="aot_eager": AOTAutograd traces forward and backward through
the reference's custom ops and runs the traced ops as they are (Inductor's C++ code generation
takes ~20 s a graph on CPU, so it runs on the GPU below). The graph runs eager's ops in eager's
order, so the output and every gradient are equal to eager's bit for bit.

GPU (sm90 kernels): the same, one graph per recipe: aot_eager equals eager bit for bit;
Inductor fuses the torch glue (router softmax, aux losses) in its own order. Measured on an
H200 (torch 2.11) at the GPU shape: y equal; dx 1.7e-3 and router.weight 4e-4 off in relative
norm with bf16 parameters (bf16 roundings of the glue), 2e-12 in fp32. (Until 2026-11-23 the
layer ran eagerly on CUDA inside compiled models: a bias-added output aliased an intermediate
and AOTAutograd gave it a zero gradient; tests/ops/test_ops_compile_gpu.py has the story.)

DelayedScaling refuses torch.compile (on the CPU, where the layer is traced) with
qmoe.UnsupportedError's message: its histories and scales update outside forward and backward
(at autocast exit, after backward).
"""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import qmoe
from qmoe.recipes import recipe_from_config
from tests.tolerances import assert_within_tolerance, recipe_tolerance

TOP_K = 2
NAMES = ["current", "block", "mxfp8", "nvfp4"]
CASES = [pytest.param(None, torch.float32, id="fp32"), pytest.param(None, torch.bfloat16, id="bf16")] + \
    [pytest.param(name, torch.bfloat16, id=name) for name in NAMES]


def _recipe(name):
    if name is None:
        return None
    config = {"name": name}
    if name == "nvfp4":
        config["disable_stochastic_rounding"] = True  # eager and compiled draw no random numbers
    return recipe_from_config(config)


SHAPES = {"cpu": (2, 8, 64, 32, 4), "cuda": (4, 64, 256, 512, 8)}  # B, S, H, F, E


def _layer(dtype, device="cpu"):
    torch.manual_seed(0)
    _, _, h, f, e = SHAPES[device]
    return qmoe.nn.MoELayer(h, f, e, TOP_K, bias=True, aux_loss_coeff=1e-2, seq_aux_loss_coeff=1e-3,
                            z_loss_coeff=1e-3, params_dtype=dtype, device=device)


def _step(layer, fn, recipe, x, g):
    """Output, dx and every parameter gradient of <y, g> + aux_loss."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
        y = fn(x)
    ((y.float() * g.float()).sum() + layer.aux_loss).backward()
    return {"y": y.detach(), "dx": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}


def _inputs(dtype, device="cpu", seed=1):
    """x and the upstream gradient, [B, S, H]: also the sequence-level loss's layout."""
    gen = torch.Generator().manual_seed(seed)
    shape = SHAPES[device][:3]
    return torch.randn(shape, generator=gen).to(device, dtype), torch.randn(shape, generator=gen).to(device, dtype)


@pytest.fixture(autouse=True, scope="module")
def _room_for_every_graph():
    # every (device, dtype, backend, recipe) here is a graph of MoELayer.forward; torch.compile
    # keeps 8 per function by default, then runs it eagerly
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


class _Compiled:
    """One compiled layer per (device, dtype, backend), shared by the recipes and the tests (a
    graph costs seconds to trace): a recipe it has not run yet compiles exactly one graph into it
    (fullgraph: no breaks), a recipe it has run compiles nothing. It remembers which recipes it
    has run, so these checks hold whichever test, in whichever order, runs a recipe first."""

    cache: dict = {}

    def __init__(self, dtype, device, backend):
        self.layer = _layer(dtype, device)
        self.counter = CompileCounterWithBackend(backend)
        self.compiled = torch.compile(self.layer, backend=self.counter, fullgraph=True)
        self.recipes_run = set()

    @classmethod
    def get(cls, dtype, device="cpu", backend="aot_eager"):
        key = (device, dtype, backend)
        if key not in cls.cache:
            cls.cache[key] = cls(dtype, device, backend)
        return cls.cache[key]

    def step(self, name, x, g):
        frames = self.counter.frame_count
        out = _step(self.layer, self.compiled, _recipe(name), x, g)  # a fresh recipe object each time
        new_graphs = self.counter.frame_count - frames
        assert new_graphs == (0 if name in self.recipes_run else 1), f"{name}: {new_graphs} new graphs"
        self.recipes_run.add(name)
        return out


def _assert_equal(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert want[name] is not None and torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("name, dtype", CASES)
def test_compiled_layer_is_one_graph_and_equals_eager(name, dtype):
    compiled = _Compiled.get(dtype)
    x, g = _inputs(dtype)
    got = compiled.step(name, x, g)
    _assert_equal(got, _step(compiled.layer, compiled.layer, _recipe(name), x, g))
    again = compiled.step(name, x, g)  # a new autocast region with the same recipe: no new graph
    _assert_equal(again, got)


def test_switching_recipes_reuses_their_graphs():
    """Each region picks its recipe's graph (same results), with no recompilation."""
    compiled = _Compiled.get(torch.bfloat16)
    x, g = _inputs(torch.bfloat16, seed=2)
    names = [None] + NAMES
    first = {name: compiled.step(name, x, g) for name in names}  # compiles what is missing
    for name in names[::-1]:
        _assert_equal(compiled.step(name, x, g), first[name])


def test_delayed_scaling_refuses_compile():
    layer = _layer(torch.bfloat16)
    x, g = _inputs(torch.bfloat16)
    compiled = torch.compile(layer, backend="aot_eager")
    with pytest.raises(RuntimeError, match="torch.compile is not supported for recipe DelayedScaling"):
        _step(layer, compiled, _recipe("delayed"), x, g)
    _step(layer, layer, _recipe("delayed"), x, g)  # eager still runs


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name, dtype", CASES)
def test_compiled_layer_is_one_graph_and_equals_eager_on_gpu(name, dtype, backend):
    """aot_eager runs eager's kernel ops in eager's order (bit for bit); Inductor fuses the torch
    glue around them (router, aux losses, offsets) in its own fp32 order: fp32 within 1e-4, the
    rest within NUMERICS.md's tolerance."""
    recipe = _recipe(name)
    layer = _layer(dtype, "cuda")
    x, g = _inputs(dtype, "cuda")
    want = _step(layer, layer, recipe, x, g)
    counter = CompileCounterWithBackend(backend)
    got = _step(layer, torch.compile(layer, backend=counter, fullgraph=True), recipe, x, g)
    assert counter.frame_count == 1
    if backend == "aot_eager":
        _assert_equal(got, want)
        return
    rtol, atol = (1e-4, 1e-4) if dtype == torch.float32 else recipe_tolerance(recipe)
    for k in want:
        assert_within_tolerance(got[k], want[k], rtol, atol, k)
