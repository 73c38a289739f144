"""Fine-tune a Hugging Face MoE model with qmoe's quantized experts, then save it as a plain HF model.

    python examples/finetune_hf_moe.py --recipe mxfp8 --steps 40 --out /tmp/tiny-moe
    python examples/finetune_hf_moe.py --model path/to/local/model --recipe nvfp4 --out ./tuned

Without --model it builds a tiny random Mixtral (or --family deepseek_v3 / qwen3_moe / qwen2_moe /
gpt_oss), so it runs anywhere, CPU included. The steps: `qmoe.hf.convert` swaps every MoE block
for a qmoe layer; the training loop runs under `qmoe.autocast(recipe=...)` (and `torch.autocast`
to bf16 with --bf16 on a GPU); `qmoe.hf.restore` puts the HF blocks back with the trained weights;
`save_pretrained` writes a model any transformers user can load. The data is random token
sequences with a repeating pattern: a stand-in for a real dataset, enough to see the loss fall.
"""
from __future__ import annotations

import argparse
import contextlib

import torch
from tqdm import tqdm

import qmoe
import qmoe.hf
from qmoe.recipes import recipe_from_config

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2, vocab_size=128,
            max_position_embeddings=128)


def tiny_model(family: str):
    """A small random-weight HF MoE causal LM of `family` (no download)."""
    import transformers

    if family == "mixtral":
        config = transformers.MixtralConfig(**TINY, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                                            output_router_logits=True)
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**TINY, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                             num_experts=8, num_experts_per_tok=2, output_router_logits=True)
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**TINY, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                             norm_topk_prob=True, output_router_logits=True)
    elif family == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            **TINY, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=16, n_shared_experts=1,
            n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1, q_lora_rank=32,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, head_dim=16)
    elif family == "gpt_oss":
        config = transformers.GptOssConfig(**TINY, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                                           head_dim=16, output_router_logits=True)
    else:
        raise ValueError(f"--family {family!r} is unknown")
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def batches(vocab: int, batch: int, seq: int, steps: int, device, seed: int = 0):
    """Random sequences that repeat a short random motif: learnable, so the loss visibly falls."""
    gen = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, vocab, (batch, 8), generator=gen)
    for _ in range(steps):
        noise = torch.randint(0, vocab, (batch, seq), generator=gen)
        ids = motif.repeat(1, -(-seq // 8))[:, :seq]
        keep = torch.rand(batch, seq, generator=gen) < 0.8
        yield torch.where(keep, ids, noise).to(device)


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a local HF model directory (default: a tiny random model)")
    p.add_argument("--family", default="mixtral", help="tiny model family without --model")
    p.add_argument("--recipe", default="mxfp8",
                   help="qmoe recipe: delayed, current, block, mxfp8, nvfp4 or none (high precision)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bf16", action="store_true", help="torch.autocast to bf16 around the forward (GPU)")
    p.add_argument("--out", help="save_pretrained here after restoring the HF blocks")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if args.model:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    else:
        model = tiny_model(args.family)
    model = qmoe.hf.convert(model.to(device))
    recipe = None if args.recipe == "none" else recipe_from_config({"name": args.recipe})
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()
    losses = []
    model.train()
    data = batches(model.config.vocab_size, args.batch, args.seq, args.steps, device)
    bar = tqdm(data, total=args.steps, disable=args.no_progress, desc=f"fine-tune ({args.recipe})")
    for ids in bar:
        with amp, qmoe.autocast(recipe=recipe, enabled=recipe is not None):
            loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps under {args.recipe}")
    model = qmoe.hf.restore(model)
    if args.out:
        model.save_pretrained(args.out)
        print(f"saved to {args.out}")
    return losses


if __name__ == "__main__":
    main()
