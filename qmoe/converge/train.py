"""One training run: AdamW with warm-up and cosine decay, held-out evaluation, resumable checkpoints.

A run is a pure function of (config, run spec, corpus): the initial weights come from the run's
seed (drawn on the CPU, so every device starts from the same numbers), batch `s` is a pure
function of the data seed and `s` (data.py), and a checkpoint holds everything else that
evolves (weights, optimiser moments, the random generators used by stochastic rounding, the
step and the curves so far). A run stopped at step k and resumed therefore continues exactly
as the uninterrupted run would have.

Precision (`train.precision`): `bf16` keeps fp32 master weights and runs the forward under
`torch.autocast(dtype=bfloat16)`, with `qmoe.autocast(recipe)` inside it for quantized runs
(the experts' GEMMs follow the recipe, everything else bf16); `fp32` leaves torch.autocast off,
so the baseline computes in fp32 and recipes quantize the experts' fp32 GEMMs; `auto` is bf16
on CUDA and fp32 on the CPU (where bf16 matmuls are slow).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import qmoe
from qmoe.converge.config import ConvergeConfig, RunSpec
from qmoe.converge.data import Corpus, held_out_batches, train_batch
from qmoe.converge.model import ModelConfig, MoETransformer

CHECKPOINT_VERSION = 1


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def learning_rate(step: int, cfg) -> float:
    """Linear warm-up to cfg.lr over warmup_steps, then cosine decay to lr * min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_model(cfg: ModelConfig, seed: int, device: torch.device) -> MoETransformer:
    """The run's initial model: drawn on the CPU from `seed` (same numbers on every device), then moved."""
    torch.manual_seed(seed)
    return MoETransformer(cfg).to(device)


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    # matrices decay; norm gains, biases and the router's selection bias (a buffer) do not
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def compute_context(recipe, precision: str, device: torch.device) -> contextlib.ExitStack:
    """torch.autocast (bf16 precision) around qmoe.autocast (quantized runs)."""
    stack = contextlib.ExitStack()
    if precision == "bf16":
        stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
    if recipe is not None:
        stack.enter_context(qmoe.autocast(recipe=recipe))
    return stack


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def evaluate(model, batches, recipe, precision, device) -> float:
    """Mean loss over the fixed held-out batches, under the run's recipe (the model as trained)."""
    model.eval()
    total = torch.zeros((), device=device)
    for x, y in batches:
        with compute_context(recipe, precision, device):
            logits = model(x.to(device))
        total += lm_loss(logits, y.to(device))
    model.train()
    return (total / len(batches)).item()


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _identity(cfg: ConvergeConfig, spec: RunSpec) -> dict:
    """What a checkpoint must match to be resumed by this run."""
    return {"model": dataclasses.asdict(cfg.model), "train": dataclasses.asdict(cfg.train),
            "label": spec.label, "recipe": spec.recipe_config(), "seed": spec.seed}


def save_checkpoint(path: Path, model, optimizer, step: int, record: dict, identity: dict, device) -> None:
    """torch.save to a temporary file, then rename: a crash never leaves half a checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"version": CHECKPOINT_VERSION, "identity": identity, "step": step,
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": _rng_state(device), "record": record}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model, optimizer, identity: dict, device) -> tuple[int, dict]:
    ckpt = torch.load(path, map_location="cpu")
    if ckpt.get("version") != CHECKPOINT_VERSION or ckpt.get("identity") != identity:
        raise ValueError(f"checkpoint {str(path)!r} was written by a different run or config; delete it or "
                         f"use another --out")
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    _set_rng_state(ckpt["rng"], device)
    return ckpt["step"], ckpt["record"]


def _new_record(spec: RunSpec) -> dict:
    return {"label": spec.label, "recipe": spec.recipe_config(), "seed": spec.seed, "status": "running",
            "error": None, "steps_done": 0, "train": {"step": [], "loss": []},
            "held_out": {"step": [], "loss": []}, "tokens_per_s": None, "peak_memory_gib": None,
            "train_seconds": 0.0, "timed_steps": 0}


def train_run(cfg: ConvergeConfig, spec: RunSpec, corpus: Corpus, device, *, checkpoint: Path | None = None,
              resume: bool = False, stop_after: int | None = None, deadline: float | None = None,
              progress: bool = True) -> dict:
    """Train one run; returns its record (curves, throughput, status).

    checkpoint: file for resumable state, written every train.checkpoint_every steps and at
    `stop_after`, deleted when the run completes. resume: continue from that file when it exists.
    stop_after: stop (status "stopped") once this many steps are done, as an interruption would.
    deadline: a time.monotonic() value; the run stops (status "stopped", checkpoint written) at the
    first step boundary after it, so a job with a time limit ends cleanly instead of being killed.
    """
    from tqdm import tqdm

    device = torch.device(device)
    tc = cfg.train
    precision = resolve_precision(tc.precision, device)
    model = build_model(cfg.model, spec.seed, device)
    optimizer = build_optimizer(model, tc)
    identity = _identity(cfg, spec)
    record, start = _new_record(spec), 0
    if resume and checkpoint is not None and Path(checkpoint).is_file():
        start, record = load_checkpoint(Path(checkpoint), model, optimizer, identity, device)
    eval_set = held_out_batches(corpus, tc.eval_batches, tc.batch, tc.seq_len, tc.data_seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens_per_step = tc.batch * tc.seq_len
    end = tc.steps if stop_after is None else min(tc.steps, stop_after)
    bar = tqdm(total=tc.steps, initial=start, desc=spec.label, disable=not progress, unit="step", leave=False)
    # losses of the steps since the last log point; a checkpoint keeps them, so a resumed run logs
    # the same intervals as an uninterrupted one
    pending = [torch.tensor(v, device=device) for v in record.pop("pending", [])]
    tick, first_interval = time.perf_counter(), True
    try:
        for step in range(start, end):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, tc)
            x, y = train_batch(corpus, step, tc.batch, tc.seq_len, tc.data_seed)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with compute_context(spec.recipe, precision, device):
                logits = model(x)
            loss = lm_loss(logits, y)
            (loss + model.aux_loss()).backward()
            if tc.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pending.append(loss.detach())
            done = step + 1
            if done % tc.log_every == 0 or done == tc.steps:
                mean = torch.stack(pending).mean().item()  # the interval's one host sync
                elapsed = time.perf_counter() - tick
                if not first_interval:  # the first interval holds compilation and autotuning
                    record["train_seconds"] += elapsed
                    record["timed_steps"] += len(pending)
                first_interval = False
                record["train"]["step"].append(done)
                record["train"]["loss"].append(mean)
                pending = []
                bar.set_postfix(loss=f"{mean:.3f}")
                if not math.isfinite(mean):
                    record["status"], record["error"] = "diverged", f"non-finite training loss at step {done}"
                    record["steps_done"] = done
                    break
                tick = time.perf_counter()
            if done % tc.eval_every == 0 or done == tc.steps:
                record["held_out"]["step"].append(done)
                record["held_out"]["loss"].append(evaluate(model, eval_set, spec.recipe, precision, device))
                tick = time.perf_counter()
            record["steps_done"] = done
            bar.update(1)
            out_of_time = deadline is not None and time.monotonic() > deadline and done < end
            if checkpoint is not None and done < tc.steps and (
                    done == end or out_of_time or (tc.checkpoint_every and done % tc.checkpoint_every == 0)):
                state = dict(record, pending=[t.item() for t in pending])
                save_checkpoint(Path(checkpoint), model, optimizer, done, state, identity, device)
                tick = time.perf_counter()
            if out_of_time:
                break
    except Exception as e:  # a recipe that cannot run here is a result, not a crash of the whole job
        record["status"] = "failed"
        record["error"] = f"{type(e).__name__}: {e}"
        if precision == "bf16":
            record["error"] += " (precision bf16 runs qmoe layers under torch.autocast; if that is what " \
                               "failed, --precision fp32 runs without it)"
    finally:
        bar.close()
    if record["status"] == "running":
        record["status"] = "done" if record["steps_done"] >= tc.steps else "stopped"
    if record["timed_steps"]:
        record["tokens_per_s"] = record["timed_steps"] * tokens_per_step / record["train_seconds"]
    if device.type == "cuda":
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    record["precision"] = precision
    if record["status"] == "done" and checkpoint is not None and Path(checkpoint).is_file():
        Path(checkpoint).unlink()
    return record
