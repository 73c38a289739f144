"""The plain PyTorch bf16 dropless MoE that BASELINES.md measures qmoe's MoELayer against.

What a careful engineer writes without qmoe: an fp32 softmax top-k router, an argsort
permutation, SwiGLU experts on `torch._grouped_mm` (int32 end offsets, one launch per GEMM)
when it can run, else a loop over experts, and an `index_add_` unpermute. Forward and backward
are plain autograd. No imports from qmoe, so it is an independent peer; `tests/test_compare.py`
checks that it equals `qmoe.nn.MoELayer` in fp32 for the same weights.

Dimensions: T tokens, H hidden, F ffn, E experts, K top-k, R = T*K routed rows.

    >>> moe = PlainMoE(hidden_size=256, ffn_hidden_size=512, num_experts=8, top_k=2)
    >>> y = moe(torch.randn(64, 256))            # [64, 256]
    >>> y.square().mean().backward()
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def grouped_mm_available(device) -> bool:
    """`torch._grouped_mm` on this device: bf16 on CUDA GPUs of sm90 and newer (its fast path)."""
    device = torch.device(device)
    return (hasattr(torch, "_grouped_mm") and device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (9, 0))


class PlainMoE(nn.Module):
    """Dropless top-k MoE with SwiGLU experts, parameters laid out like qmoe's MoELayer.

    router_weight [E, H] fp32; fc1_weight [E, 2F, H] (gate rows first, then linear rows:
    `silu(gate) * linear`); fc2_weight [E, H, F]. forward(x [T, H] or [..., H]) -> same shape.

    pre_softmax=False (qmoe's default, Mixtral's): rank the logits, softmax over the K chosen.
    pre_softmax=True: softmax over all E, keep the K largest probabilities as they are.
    use_grouped_mm: None picks `torch._grouped_mm` where `grouped_mm_available`, else the loop.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                 pre_softmax: bool = False, use_grouped_mm: bool | None = None, dtype=torch.bfloat16, device=None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k, self.pre_softmax = num_experts, top_k, pre_softmax
        e, h, f = num_experts, hidden_size, ffn_hidden_size
        self.router_weight = nn.Parameter(torch.randn(e, h, device=device) * h ** -0.5)  # fp32 always
        self.fc1_weight = nn.Parameter(torch.empty(e, 2 * f, h, dtype=dtype, device=device).uniform_(
            -1 / math.sqrt(h), 1 / math.sqrt(h)))
        self.fc2_weight = nn.Parameter(torch.empty(e, h, f, dtype=dtype, device=device).uniform_(
            -1 / math.sqrt(f), 1 / math.sqrt(f)))
        dev = self.fc1_weight.device
        self.use_grouped_mm = grouped_mm_available(dev) if use_grouped_mm is None else use_grouped_mm

    @classmethod
    def from_moe_layer(cls, layer, dtype=torch.bfloat16, use_grouped_mm: bool | None = None) -> "PlainMoE":
        """The same weights as a qmoe MoELayer (SwiGLU, no biases), read from its logical state_dict."""
        sd = layer.state_dict()
        fc1, fc2 = sd["experts.fc1.weight"], sd["experts.fc2.weight"]
        e, f2, h = fc1.shape
        moe = cls(h, f2 // 2, e, layer.top_k, pre_softmax=layer.router.pre_softmax, use_grouped_mm=use_grouped_mm,
                  dtype=dtype, device=fc1.device)
        with torch.no_grad():
            moe.router_weight.copy_(sd["router.weight"].float())
            moe.fc1_weight.copy_(fc1)
            moe.fc2_weight.copy_(fc2)
        return moe

    def route(self, tokens: torch.Tensor):
        """(probs [T, K] fp32, experts [T, K] int64) from fp32 logits."""
        logits = tokens.float() @ self.router_weight.t()
        if self.pre_softmax:
            return torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        top, experts = logits.topk(self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts

    def experts(self, x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """SwiGLU experts over rows grouped by expert: x [R, H], counts [E], probs [R] -> [R, H]."""
        w1, w2 = self.fc1_weight.to(x.dtype), self.fc2_weight.to(x.dtype)
        if self.use_grouped_mm:
            offs = counts.cumsum(0).to(torch.int32)  # end offset of each expert's rows, on the device
            h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        else:
            bounds = [0, *counts.cumsum(0).tolist()]  # the loop needs the sizes on the host
            h = torch.cat([x[bounds[g]:bounds[g + 1]] @ w1[g].t() for g in range(self.num_experts)])
        gate, linear = h.chunk(2, dim=-1)
        a = F.silu(gate) * linear * probs.to(h.dtype)[:, None]
        if self.use_grouped_mm:
            return torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
        return torch.cat([a[bounds[g]:bounds[g + 1]] @ w2[g].t() for g in range(self.num_experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, self.hidden_size)
        probs, experts = self.route(tokens)
        flat = experts.flatten()                                        # [R]: token t's k-th choice at t*K + k
        order = flat.argsort(stable=True)                               # rows grouped by expert, token order kept
        token_of_row = order // self.top_k
        # scatter_add_, not bincount: CUDA's bincount reads the max back to the host (a sync)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        y = self.experts(tokens[token_of_row], counts, probs.flatten()[order])
        out = torch.zeros_like(tokens).index_add_(0, token_of_row, y.to(tokens.dtype))
        return out.reshape(shape)
