"""MoELayer(overlap_shared_experts=True): the shared experts run on a side CUDA stream, forked
before the router and joined before the sum, with the same bits as in line.

On the CPU the option changes nothing (no CUDA call at all); the fork/join structure is checked
with a stand-in side stream. The GPU tests check the bits eager and inside qmoe.graph.capture,
that the shared experts' forward and backward really run on the side stream, and no host sync.
"""
import copy
import io

import pytest
import torch

import qmoe
import qmoe.nn.moe as moe_module
from qmoe.nn.side_stream import side_stream_for
from qmoe.recipes import DelayedScaling, Float8BlockScaling, MXFP8BlockScaling

H, F, FS, E, K = 32, 48, 64, 8, 2


def _layer(seed=0, dtype=torch.float32, device="cpu", gate=True, sizes=(H, F, FS), **kw):
    torch.manual_seed(seed)
    h, f, fs = sizes
    return qmoe.nn.MoELayer(h, f, E, K, shared_expert_ffn_hidden_size=fs, shared_expert_gate=gate,
                            aux_loss_coeff=1e-2, params_dtype=dtype, device=device, **kw)


def _step(layer, x, recipe=None, fn=None):
    """Output and every gradient (input first) of a forward + backward with a fixed upstream gradient."""
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
        y = (fn or layer)(x)
    g = torch.randn(y.shape, generator=torch.Generator(y.device).manual_seed(7), device=y.device, dtype=y.dtype)
    torch.autograd.backward([y, layer.aux_loss], [g, None])
    return y.detach(), [x.grad] + [p.grad.clone() for p in layer.parameters()]


def _assert_same_bits(a, b):
    (ya, ga), (yb, gb) = a, b
    assert torch.equal(ya, yb)
    assert len(ga) == len(gb)
    for i, (p, q) in enumerate(zip(ga, gb)):
        assert torch.equal(p, q), f"gradient {i}: max |diff| {(p.float() - q.float()).abs().max().item():.3g}"


# --- CPU ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [None, DelayedScaling(amax_history_len=4)], ids=["fp32", "delayed"])
def test_cpu_output_and_gradients_equal_with_overlap_on_and_off(recipe):
    x = torch.randn(2, 24, H)
    off, on = _layer(), _layer(overlap_shared_experts=True)
    for _ in range(2):  # twice: delayed scaling's second step uses the first step's scales
        _assert_same_bits(_step(on, x, recipe), _step(off, x, recipe))


def test_cpu_never_touches_cuda_streams(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a CUDA stream call on the CPU")
    monkeypatch.setattr(torch.cuda, "Stream", refuse)
    monkeypatch.setattr(torch.cuda, "current_stream", refuse)
    monkeypatch.setattr(torch.Tensor, "record_stream", refuse)
    assert side_stream_for(torch.device("cpu")) is None
    layer = _layer(overlap_shared_experts=True)
    _step(layer, torch.randn(16, H))


class _FakeSide:
    """Stands in for qmoe.nn.side_stream.SideStream and logs the fork, the work and the join."""

    def __init__(self, log):
        self.log, self.output = log, None

    def run(self, fn, *inputs):
        self.log.append("fork")
        self.output = fn(*inputs)
        self.log.append("side done")
        return self.output

    def join(self, output):
        assert output is self.output
        self.log.append("join")
        return output


def test_overlap_forks_before_the_router_and_joins_before_the_sum(monkeypatch):
    log, devices = [], []

    def fake_side_stream_for(device):
        devices.append(device)
        return _FakeSide(log)
    monkeypatch.setattr(moe_module, "side_stream_for", fake_side_stream_for)
    layer = _layer(overlap_shared_experts=True)
    for name, module in (("shared", layer.shared_experts), ("router", layer.router), ("experts", layer.experts)):
        module.register_forward_pre_hook(lambda m, a, name=name: log.append(name))
    x = torch.randn(16, H)
    got = _step(layer, x)
    # the shared experts (and only they) between fork and side done; the routed work after the fork
    assert log == ["fork", "shared", "side done", "router", "experts", "join"]
    assert devices == [torch.device("cpu")]
    # the sum itself is unchanged
    layer.overlap_shared_experts = False
    log.clear()
    _assert_same_bits(got, _step(layer, x))
    assert log == ["shared", "router", "experts"]  # no side stream asked for


def test_overlap_option_validation_and_toggle():
    with pytest.raises(ValueError, match="overlap_shared_experts=True needs shared experts"):
        qmoe.nn.MoELayer(H, F, E, K, overlap_shared_experts=True)
    with pytest.raises(TypeError, match="overlap_shared_experts must be True or False"):
        _layer(overlap_shared_experts="yes")
    layer = _layer()
    assert layer.overlap_shared_experts is False
    layer.overlap_shared_experts = True
    assert layer.overlap_shared_experts is True
    with pytest.raises(TypeError, match="overlap_shared_experts"):
        layer.overlap_shared_experts = 1
    plain = qmoe.nn.MoELayer(H, F, E, K)
    plain.overlap_shared_experts = False  # off is always fine
    with pytest.raises(ValueError, match="needs shared experts"):
        plain.overlap_shared_experts = True


def test_layer_with_overlap_pickles_and_copies():
    layer = _layer(overlap_shared_experts=True)
    x = torch.randn(8, H)
    y, _ = _step(layer, x)
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    for other in (copy.deepcopy(layer), torch.load(buf, weights_only=False)):
        assert other.overlap_shared_experts is True
        assert torch.equal(_step(other, x)[0], y)
    assert set(layer.state_dict()) == set(_layer().state_dict())  # an option, not state


# --- GPU ---------------------------------------------------------------------------------------

GPU_RECIPES = [
    pytest.param(None, id="bf16"),
    pytest.param(DelayedScaling(), id="delayed"),
    pytest.param(Float8BlockScaling(), id="block"),
    pytest.param(MXFP8BlockScaling(), id="mxfp8"),
]
T, GPU_SIZES = 512, (256, 256, 512)  # whole blocks for every recipe


def _gpu_pair(gate=True):
    off = _layer(dtype=torch.bfloat16, device="cuda", gate=gate, sizes=GPU_SIZES)
    on = copy.deepcopy(off)
    on.overlap_shared_experts = True
    return off, on


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_RECIPES)
@pytest.mark.parametrize("gate", [False, True], ids=["ungated", "gated"])
def test_gpu_overlap_gives_the_same_bits_eager(recipe, gate):
    off, on = _gpu_pair(gate)
    x = torch.randn(T, GPU_SIZES[0], device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # delayed scaling: the second step runs on the first step's scales
        _assert_same_bits(_step(on, x, recipe), _step(off, x, recipe))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_overlap_gives_the_same_bits_in_a_captured_graph(recipe):
    off, on = _gpu_pair()
    sample = torch.randn(T, GPU_SIZES[0], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
        graphed_off = qmoe.graph.capture(off, (sample,))
        graphed_on = qmoe.graph.capture(on, (sample,))
    for scale in (1.0, 3.0):  # new data, new routing, each replay
        x = torch.randn(T, GPU_SIZES[0], device="cuda", dtype=torch.bfloat16) * scale
        got = _step(on, x, recipe, graphed_on)
        _assert_same_bits(got, _step(off, x, recipe, graphed_off))
    if recipe is None:  # and the replay equals eager (delayed: the replays moved the scales)
        _assert_same_bits(got, _step(on, x, recipe))


@pytest.mark.gpu
def test_gpu_shared_experts_run_on_the_side_stream_forward_and_backward():
    _, on = _gpu_pair()
    seen = {}

    def note(key):
        def hook(*args):
            seen[key] = torch.cuda.current_stream()
        return hook
    on.shared_experts.register_forward_pre_hook(note("shared forward"))
    on.shared_experts.fc1.register_full_backward_hook(note("shared backward"))
    on.router.register_forward_pre_hook(note("router forward"))
    main = torch.cuda.current_stream()
    _step(on, torch.randn(T, GPU_SIZES[0], device="cuda", dtype=torch.bfloat16), DelayedScaling())
    side = side_stream_for(torch.device("cuda"))
    assert seen["router forward"] == main
    assert seen["shared forward"] == side.stream != main
    assert seen["shared backward"] == side.stream


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_overlap_has_no_host_sync(recipe):
    _, on = _gpu_pair()
    x = torch.randn(T, GPU_SIZES[0], device="cuda", dtype=torch.bfloat16)
    _step(on, x, recipe)  # warm up: autotuning and lazy state may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(on, x, recipe)
    finally:
        torch.cuda.set_sync_debug_mode("default")
