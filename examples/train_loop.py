"""A training loop with qmoe: torch.autocast, qmoe.autocast, qmoe.checkpoint, save and resume, DDP.

    python examples/train_loop.py                                  # CPU, one process
    torchrun --nproc-per-node 2 examples/train_loop.py             # data parallel (gloo on CPU, NCCL on GPUs)

Trains a small stack of MoE blocks for --steps steps, saving a checkpoint (model with its
recipe state, optimizer, RNG) after --save-at steps; then resumes from it in a fresh model and
checks that the resumed steps repeat the uninterrupted run's losses bit for bit. Every
--eval-every steps it evaluates under another recipe, which leaves the training recipe's
delayed-scaling state alone.
"""
from __future__ import annotations

import argparse
import io
import os

import torch
import torch.distributed as dist

import qmoe
from qmoe.recipes import DelayedScaling, MXFP8BlockScaling, recipe_from_config


class Block(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.moe = qmoe.nn.MoELayer(hidden, ffn, experts, top_k, aux_loss_coeff=1e-2, expert_bias=True)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class Model(torch.nn.Module):
    def __init__(self, hidden=64, ffn=128, experts=8, top_k=2, layers=2):
        super().__init__()
        self.proj = qmoe.nn.Linear(hidden, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, ffn, experts, top_k)
                                          for _ in range(layers))
        self.head = qmoe.nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.proj(x)
        for block in self.blocks:
            h = qmoe.checkpoint(block, h)  # recomputed in the backward under the same recipe and scales
        return self.head(h), sum(block.moe.aux_loss for block in self.blocks)


def batch(step: int, rank: int, world: int, device, hidden=64):
    """This rank's share of the step's batch [4, 32, hidden] (the same data on every run)."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(2, 4, 32, hidden, generator=g)
    share = slice(rank * 4 // world, (rank + 1) * 4 // world)
    return x[share].to(device), y[share].to(device)


def train(steps: range, recipe, device, group=None, resume: bytes | None = None, save_at: int | None = None,
          eval_every: int = 0):
    """Runs `steps`; returns (losses, the checkpoint saved after step `save_at`, if any)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if group is not None else (0, 1)
    torch.manual_seed(0)
    model = Model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if resume is not None:
        ckpt = torch.load(io.BytesIO(resume), weights_only=False)
        model.load_state_dict(ckpt["model"])  # parameters, buffers (expert biases) and the recipe state
        opt.load_state_dict(ckpt["optim"])
        torch.set_rng_state(ckpt["rng"])
        if ckpt["cuda_rng"] is not None:  # NVFP4's stochastic rounding draws from the device's generator
            torch.cuda.set_rng_state_all(ckpt["cuda_rng"])
    ddp = torch.nn.parallel.DistributedDataParallel(model) if group is not None else model
    losses, saved = [], None
    for step in steps:
        x, y = batch(step, rank, world, device)
        with torch.autocast(device.type, dtype=torch.bfloat16), \
                qmoe.autocast(recipe=recipe, amax_reduction_group=group):
            out, aux_loss = ddp(x)
            loss = torch.nn.functional.mse_loss(out.float(), y) + aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if eval_every and (step + 1) % eval_every == 0:
            model.eval()
            with torch.no_grad(), qmoe.autocast(recipe=MXFP8BlockScaling()):
                model(x)  # another recipe for a while: the training recipe's state is kept apart
            model.train()
        if step + 1 == save_at:
            buf = io.BytesIO()
            cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "rng": torch.get_rng_state(),
                        "cuda_rng": cuda_rng}, buf)
            saved = buf.getvalue()
    return losses, saved


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--recipe", default="delayed", help="delayed, current, block, mxfp8 or nvfp4")
    args = parser.parse_args(argv)
    recipe = DelayedScaling() if args.recipe == "delayed" else recipe_from_config({"name": args.recipe})
    group, device = None, torch.device("cpu")
    if "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        group = dist.group.WORLD
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    try:
        want, blob = train(range(args.steps), recipe, device, group, save_at=args.save_at,
                           eval_every=args.eval_every)
        got, _ = train(range(args.save_at, args.steps), recipe, device, group, resume=blob,
                       eval_every=args.eval_every)
        same = all(torch.equal(a, b) for a, b in zip(got, want[args.save_at:]))
        if group is None or dist.get_rank() == 0:
            print("losses:", " ".join(f"{float(v):.5f}" for v in want))
            print(f"resumed after step {args.save_at}:", " ".join(f"{float(v):.5f}" for v in got),
                  "(bit for bit)" if same else "(DIFFERENT)")
        if not same:
            raise SystemExit("resumed losses differ from the uninterrupted run")
    finally:
        if group is not None:
            dist.destroy_process_group()
    return want, got


if __name__ == "__main__":
    main()
