"""qmoe.hf.from_hf / to_hf against the Hugging Face blocks themselves, on tiny random configs.

fp32 with qmoe autocast disabled: the layer's output and every gradient (input, router, router
bias, experts, shared expert and its gate) equal the block's within rtol 1e-4 / atol 1e-5, and
routing is identical token for token. Under each recipe the output is within NUMERICS.md's
tolerance of the block's fp32 output. Nothing is downloaded.
"""
import math

import pytest
import torch

import qmoe
from qmoe.recipes import DelayedScaling
from tests.nn.recipe_cases import QUANTIZED
from tests.tolerances import assert_within_tolerance, recipe_tolerance

import transformers  # noqa: E402  (the test extra installs it)
import qmoe.hf  # noqa: E402
from qmoe.hf.blocks import hf_state_dict, router_of  # noqa: E402

H, F, FS = 32, 32, 48
COMMON = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, vocab_size=96, num_hidden_layers=2)


def _mixtral(**kw):
    c = transformers.MixtralConfig(**COMMON, intermediate_size=F, num_local_experts=8, num_experts_per_tok=2, **kw)
    return transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(c)


def _qwen2(norm):
    c = transformers.Qwen2MoeConfig(**COMMON, moe_intermediate_size=F, shared_expert_intermediate_size=FS,
                                    num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
    return transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(c)


def _qwen3(norm):
    c = transformers.Qwen3MoeConfig(**COMMON, moe_intermediate_size=F, num_experts=8, num_experts_per_tok=2,
                                    norm_topk_prob=norm)
    return transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(c)


def _deepseek(n_group, topk_group, top_k, norm=True):
    c = transformers.DeepseekV3Config(**COMMON, moe_intermediate_size=F, n_routed_experts=16, n_shared_experts=2,
                                      n_group=n_group, topk_group=topk_group, num_experts_per_tok=top_k,
                                      norm_topk_prob=norm, routed_scaling_factor=2.5)
    return transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(c)


def _gpt_oss():
    c = transformers.GptOssConfig(**COMMON, intermediate_size=F, num_local_experts=8, num_experts_per_tok=2)
    return transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(c)


CASES = {
    "mixtral": _mixtral,
    "qwen2-norm-gated": lambda: _qwen2(True),
    "qwen2-unnormalised-gated": lambda: _qwen2(False),
    "qwen3-norm": lambda: _qwen3(True),
    "qwen3-unnormalised": lambda: _qwen3(False),
    "deepseek-groups-top2-k4": lambda: _deepseek(4, 2, 4),
    "deepseek-groups-k6": lambda: _deepseek(4, 2, 6),  # top-2 group scores, unlike Megatron's top k/group_topk
    "deepseek-unnormalised": lambda: _deepseek(4, 2, 6, norm=False),
    "deepseek-one-group": lambda: _deepseek(1, 1, 4),  # its shared expert has no gate
    "gpt-oss-router-bias": _gpt_oss,
}


def _randomise(block, seed=0):
    """Random weights of a realistic spread (HF leaves expert weights uninitialised)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(block.named_parameters()) + list(block.named_buffers()):
            fan_in = t.shape[-1] if t.dim() > 1 else 1
            std = 0.5 if t.dim() == 1 else 1 / math.sqrt(fan_in)
            if name.endswith("gate.weight") or name.endswith("router.weight"):
                std *= 4  # clear-cut routing: selection never hinges on the last bit
            t.copy_(torch.randn(t.shape, generator=gen) * std)
            if name.endswith("e_score_correction_bias"):
                # non-negative: transformers 4.x masks other groups' scores with 0 (5.x: -inf), the
                # same choice only while every score + bias is positive
                t.abs_()
    return block.float()


def _block(case):
    torch.manual_seed(0)
    return _randomise(CASES[case]())


def _hf_forward(block, x):
    out = block(x)
    return out[0] if isinstance(out, tuple) else out


def _hf_routing(block, x):
    """(chosen [T, E] bool, probs [T, E] or None) of the HF block on x: the experts from the last
    `torch.topk(scores, top_k)` its forward calls (every family and version selects with it),
    the probabilities from the router where it returns them (5.x: logits, scores, indices)."""
    router = router_of(block)
    num_experts, top_k = router.weight.shape[0], qmoe.hf.from_hf(block).top_k
    calls, topk = [], torch.topk

    def recording_topk(t, k, *args, **kwargs):
        out = topk(t, k, *args, **kwargs)
        if t.dim() == 2 and t.shape[1] == num_experts and k == top_k:
            calls.append(out.indices)
        return out

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "topk", recording_topk)
        _hf_forward(block, x)
    idx = calls[-1]
    chosen = torch.zeros(idx.shape[0], num_experts, dtype=torch.bool, device=idx.device).scatter(1, idx, True)
    with torch.no_grad():
        out = router(x.reshape(-1, x.shape[-1]))
    if not (isinstance(out, tuple) and len(out) == 3 and out[1].shape == calls[-1].shape):
        return chosen, None
    return chosen, torch.zeros(chosen.shape, device=idx.device).scatter(1, out[2], out[1].float())


def _data(seed=1, shape=(2, 9)):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, H, generator=gen), torch.randn(*shape, H, generator=gen)


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_output_gradients_and_routing_equal_hf(case):
    block = _block(case)
    layer = qmoe.hf.from_hf(block)
    x, g = _data()
    xh, xq = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    yh = _hf_forward(block, xh)
    with qmoe.autocast(enabled=False):
        yq = layer(xq)
    torch.testing.assert_close(yq, yh, rtol=1e-4, atol=1e-5)
    (yh * g).sum().backward()
    (yq * g).sum().backward()
    torch.testing.assert_close(xq.grad, xh.grad, rtol=1e-4, atol=1e-5)
    hf_grads = hf_state_dict(block, grad=True)
    assert hf_grads.keys() >= {"router.weight", "experts.fc1.weight", "experts.fc2.weight"}
    for key, want in hf_grads.items():
        got = layer.get_parameter(key).grad
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=key)
    # routing: the same experts for every token, with the same probabilities
    chosen, probs = _hf_routing(block, x)
    with torch.no_grad():
        q_probs, q_map = layer.router(x.reshape(-1, H))
    assert chosen.sum() == x.shape[0] * x.shape[1] * layer.top_k
    assert torch.equal(q_map, chosen)
    if probs is not None:
        torch.testing.assert_close(q_probs, probs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recipe", QUANTIZED)
@pytest.mark.parametrize("case", ["mixtral", "qwen2-norm-gated", "deepseek-groups-k6", "gpt-oss-router-bias"])
def test_recipes_within_numerics_tolerance_of_hf(case, recipe):
    block = _block(case)
    layer = qmoe.hf.from_hf(block)
    x, _ = _data(shape=(4, 16))
    with torch.no_grad():
        want = _hf_forward(block, x)
        for _ in range(2 if isinstance(recipe, DelayedScaling) else 1):  # delayed: the 2nd step uses amaxes
            with qmoe.autocast(recipe=recipe):
                got = layer(x)
    rtol, atol = recipe_tolerance(recipe)
    assert_within_tolerance(got, want, rtol * math.sqrt(2), atol * math.sqrt(2), case)


@pytest.mark.parametrize("case", ["mixtral", "qwen2-norm-gated", "deepseek-groups-k6", "gpt-oss-router-bias"])
def test_to_hf_writes_the_trained_weights_back(case):
    block = _block(case)
    layer = qmoe.hf.from_hf(block)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.add_(0.2)
    other = _randomise(CASES[case](), seed=7)
    qmoe.hf.to_hf(layer, other)
    x, _ = _data()
    with torch.no_grad():
        torch.testing.assert_close(_hf_forward(other, x), layer(x), rtol=1e-4, atol=1e-5)
    for key, value in hf_state_dict(other).items():
        assert torch.equal(value, layer.state_dict()[key]), key


def test_from_hf_keeps_device_and_dtype_and_fixes_the_expert_bias():
    block = _block("deepseek-groups-k6").to(torch.bfloat16)
    layer = qmoe.hf.from_hf(block)
    assert layer.experts.fc1.weight.dtype == torch.bfloat16 and layer.router.weight.dtype == torch.float32
    assert layer.router.expert_bias_update_rate == 0.0
    bias = layer.router.expert_bias.clone()
    layer.train()(torch.randn(5, H, dtype=torch.bfloat16))
    assert torch.equal(layer.router.expert_bias, bias)


def test_unsupported_blocks_and_configs_raise_naming_them():
    with pytest.raises(qmoe.UnsupportedError, match="Linear"):
        qmoe.hf.from_hf(torch.nn.Linear(4, 4))
    with pytest.raises(qmoe.UnsupportedError, match="router_jitter_noise"):
        qmoe.hf.from_hf(_randomise(_mixtral(router_jitter_noise=0.1)))
    block = _block("gpt-oss-router-bias")
    block.experts.limit = 5.0
    with pytest.raises(qmoe.UnsupportedError, match="swiglu_limit=5.0"):
        qmoe.hf.from_hf(block)
    block = _block("mixtral")
    block.experts.act_fn = torch.nn.ReLU()
    with pytest.raises(qmoe.UnsupportedError, match="ReLU"):
        qmoe.hf.from_hf(block)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["mixtral", "qwen2-unnormalised-gated", "deepseek-groups-k6", "gpt-oss-router-bias"])
def test_on_the_gpu_kernels_route_alike_and_stay_within_tolerance(case):
    # The Triton router (group_score_topk, normalize_topk_probs, router bias) and grouped GEMMs: the
    # same routing as HF token for token; fp32 within the GEMM contract's tensor-core bound
    # (NUMERICS.md, 1e-3), MXFP8 within its end-to-end tolerance.
    from qmoe.recipes import MXFP8BlockScaling

    block = _block(case).cuda()
    layer = qmoe.hf.from_hf(block)
    assert layer.router.weight.is_cuda
    x, _ = _data(shape=(4, 16))
    x = x.cuda()
    chosen, _ = _hf_routing(block, x)
    with torch.no_grad():
        want = _hf_forward(block, x)
        _, q_map = layer.router(x.reshape(-1, H))
        got = layer(x)
        with qmoe.autocast(recipe=MXFP8BlockScaling()):
            quantized = layer(x)
    assert torch.equal(q_map, chosen)
    assert_within_tolerance(got, want, 1e-3, 1e-3, case)
    rtol, atol = recipe_tolerance(MXFP8BlockScaling())
    assert_within_tolerance(quantized, want, rtol * math.sqrt(2), atol * math.sqrt(2), case)
