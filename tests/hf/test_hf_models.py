"""qmoe.hf.convert / restore on whole tiny random Hugging Face models (fp32, CPU, no downloads).

Converted, a MixtralForCausalLM and a DeepseekV3ForCausalLM give the original's logits, loss
(with Mixtral's load-balancing loss from the router logits qmoe hands to transformers) and
gradients; trained a few steps and restored, `save_pretrained` / `from_pretrained` reproduces the
trained model's logits.
"""
import copy
import subprocess
import sys

import pytest
import torch

import qmoe

import transformers  # noqa: E402  (the test extra installs it)
import qmoe.hf  # noqa: E402
from qmoe.hf.blocks import FAMILIES, router_of  # noqa: E402

COMMON = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=96, num_hidden_layers=2,
              max_position_embeddings=64, attn_implementation="eager")


def _mixtral():
    config = transformers.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                        output_router_logits=True, router_aux_loss_coef=0.05)
    return transformers.MixtralForCausalLM(config)


def _deepseek():
    config = transformers.DeepseekV3Config(
        **dict(COMMON, num_key_value_heads=4), intermediate_size=48, moe_intermediate_size=16, n_routed_experts=16,
        n_shared_experts=1, n_group=4, topk_group=2, num_experts_per_tok=6, first_k_dense_replace=1, q_lora_rank=16,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, head_dim=8, routed_scaling_factor=2.5)
    return transformers.DeepseekV3ForCausalLM(config)


MODELS = {"mixtral": _mixtral, "deepseek-v3": _deepseek}


def _model(name):
    torch.manual_seed(0)
    model = MODELS[name]().float()
    with torch.no_grad():  # clear-cut routing, and a non-zero DeepSeek selection bias
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.1)
    return model


def _batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (2, 11), generator=gen)


@pytest.mark.parametrize("name", list(MODELS))
def test_converted_model_equals_the_original(name):
    model = _model(name)
    ids = _batch()
    want = model(ids, labels=ids)
    want.loss.backward()
    converted = qmoe.hf.convert(copy.deepcopy(model))
    n_blocks = sum(isinstance(m, qmoe.hf.HFMoEBlock) for m in converted.modules())
    assert n_blocks == (2 if name == "mixtral" else 1)
    converted.zero_grad()
    got = converted(ids, labels=ids)
    got.loss.backward()
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    if name == "mixtral":  # the HF load-balancing loss, from the router logits qmoe handed over
        assert len(got.router_logits) == 2
        torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)
    # gradients of the parameters HF and qmoe share by name (attention, norms, embeddings)
    theirs = dict(model.named_parameters())
    for n, p in converted.named_parameters():
        if n in theirs:
            torch.testing.assert_close(p.grad, theirs[n].grad, rtol=1e-4, atol=1e-5, msg=n)
    # and the router of the first MoE block, through the qmoe layer
    block = next(m for m in converted.modules() if isinstance(m, qmoe.hf.HFMoEBlock))
    hf_block = next(m for m in model.modules() if type(m).__name__ in FAMILIES)
    torch.testing.assert_close(block.layer.router.weight.grad, router_of(hf_block).weight.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
def test_restore_after_training_round_trips_through_save_pretrained(name, tmp_path):
    model = qmoe.hf.convert(_model(name))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = _batch()
    losses = []
    for step in range(4):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    probe = _batch(seed=2)
    with torch.no_grad():
        trained = model(probe).logits
    restored = qmoe.hf.restore(model)
    assert not any(isinstance(m, qmoe.hf.HFMoEBlock) for m in restored.modules())
    with torch.no_grad():
        torch.testing.assert_close(restored(probe).logits, trained, rtol=1e-4, atol=1e-5)
    restored.save_pretrained(tmp_path)
    loaded = type(restored).from_pretrained(tmp_path, attn_implementation="eager").float()
    with torch.no_grad():
        torch.testing.assert_close(loaded(probe).logits, trained, rtol=1e-4, atol=1e-5)


def test_convert_after_a_forward_still_hands_router_logits_to_transformers():
    model = _model("mixtral")
    ids = _batch()
    want = model(ids, labels=ids)  # transformers installs its recording hooks here
    got = qmoe.hf.convert(model)(ids, labels=ids)
    assert len(got.router_logits) == 2
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)


def test_convert_rejects_a_model_without_moe_blocks():
    with pytest.raises(qmoe.UnsupportedError, match="no supported MoE block"):
        qmoe.hf.convert(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_importing_qmoe_does_not_import_transformers():
    code = "import sys, qmoe, qmoe.hf, qmoe.nn; assert 'transformers' not in sys.modules, 'transformers imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
