"""Small qmoe modules and their inputs for the training-loop tests (autocast, casts, checkpointing).

Each case builds a module and a call on given inputs, so a test can run the same step twice
(plain and checkpointed, fp32 and autocast, ...) on identical copies.
"""
import pytest
import torch

import qmoe

H, F, E, K = 32, 64, 4, 2
GPU_H, GPU_F = 128, 256
SPLITS = (32, 0, 64, 32)  # one empty expert; multiples of every recipe's row block


def sizes(device):
    return (H, F) if torch.device(device).type == "cpu" else (GPU_H, GPU_F)


def make(kind: str, device="cpu", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    h, f = sizes(device)
    if kind == "linear":
        return qmoe.nn.Linear(h, f, device=device)
    if kind == "grouped_linear":
        return qmoe.nn.GroupedLinear(E, h, f, device=device)
    if kind == "grouped_mlp":
        return qmoe.nn.GroupedMLP(E, h, f, bias=True, device=device)
    if kind == "moe":
        return qmoe.nn.MoELayer(h, f, E, K, device=device)
    raise ValueError(kind)


def inputs(kind: str, device="cpu", seed: int = 1, dtype=torch.float32) -> tuple:
    """(x, extra args): x is the differentiable activation input."""
    g = torch.Generator().manual_seed(seed)
    h, _ = sizes(device)
    rows = sum(SPLITS)
    if kind in ("linear", "moe"):
        x = torch.randn(2, rows // 4, h, generator=g)
        return x.to(device, dtype), ()
    x = torch.randn(rows, h, generator=g).to(device, dtype)
    splits = torch.tensor(SPLITS, dtype=torch.int64, device=device)
    if kind == "grouped_mlp":
        probs = torch.rand(rows, generator=g).to(device)
        return x, (splits, probs)
    return x, (splits,)


def gemms_in_series(kind: str) -> int:
    return 1 if kind in ("linear", "grouped_linear") else 2


KINDS = ["linear", "grouped_linear", "grouped_mlp", "moe"]
# torch.autocast device types and dtypes: CPU bf16 here, CUDA bf16 and fp16 on the GPU
AMP = [pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
       pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu),
       pytest.param("cuda", torch.float16, id="cuda-fp16", marks=pytest.mark.gpu)]


class TinyModel(torch.nn.Module):
    """An MoE block and a dense head: every qmoe module kind a training loop holds, in small."""

    def __init__(self, device="cpu", seed: int = 0, expert_bias: bool = True, aux_loss_coeff: float = 1e-2):
        super().__init__()
        torch.manual_seed(seed)
        h, f = sizes(device)
        self.moe = qmoe.nn.MoELayer(h, f, E, K, expert_bias=expert_bias, aux_loss_coeff=aux_loss_coeff,
                                    device=device)
        self.head = qmoe.nn.Linear(h, h, device=device)

    def forward(self, x):
        return self.head(self.moe(x) + x)


def batch(step: int, device="cpu", rows: int = 32, rank_slice: slice | None = None):
    """The step's (x [2, rows/2, H], target): the same on every run, sliceable along the batch."""
    g = torch.Generator().manual_seed(1000 + step)
    h, _ = sizes(device)
    x = torch.randn(2, rows // 2, h, generator=g)
    target = torch.randn(2, rows // 2, h, generator=g)
    if rank_slice is not None:
        x, target = x[rank_slice], target[rank_slice]
    return x.to(device), target.to(device)


def loss_of(model, x, target):
    return torch.nn.functional.mse_loss(model(x).float(), target) + model.moe.aux_loss
