"""A small decoder-only language model whose every block's feed-forward is a `qmoe.nn.MoELayer`.

The model exists to ask one question: does a recipe train as well as bf16? So it is the plainest
modern decoder: pre-norm RMSNorm, rotary positions, causal attention through
`torch.nn.functional.scaled_dot_product_attention`, an MoE feed-forward, untied input and output
embeddings. Only the experts' GEMMs are quantized (qmoe.autocast reaches the MoE layers and
nothing else), so a loss gap is the experts' arithmetic, not the attention's.

Dimension legend: B batch, S sequence, H hidden, V vocabulary (256 bytes), E experts.

    >>> cfg = ModelConfig(layers=2, hidden=64, heads=4, experts=8, top_k=2, ffn=64)
    >>> model = MoETransformer(cfg)
    >>> logits = model(torch.zeros(2, 16, dtype=torch.long))   # [B, S, V]
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from qmoe.nn import MoELayer

SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape and router options (config file section `model`)."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    experts: int = 8
    top_k: int = 2
    ffn: int = 64  # each routed expert's hidden size
    vocab_size: int = 256  # bytes
    score_function: str = "softmax"
    num_groups: int | None = None  # group-limited routing (DeepSeek-V3): experts split into groups...
    group_topk: int | None = None  # ...and only the best `group_topk` groups are eligible
    expert_bias: bool = False  # aux-loss-free balancing: a selection-only bias updated every step
    scaling_factor: float | None = None  # routed-output scale (DeepSeek-V3 uses 2.5)
    aux_loss_coeff: float = 0.0  # load-balancing loss, added to the LM loss (not to the reported loss)
    shared_expert_ffn: int | None = None  # one always-on expert, when MoELayer supports it
    rope_theta: float = 10000.0
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "experts", "top_k", "ffn", "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {v!r}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"model.hidden={self.hidden} must split into model.heads={self.heads} heads of an "
                             f"even size (rotary positions rotate pairs)")
        if self.top_k > self.experts:
            raise ValueError(f"model.top_k={self.top_k} exceeds model.experts={self.experts}")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"model.score_function must be one of {', '.join(SCORE_FUNCTIONS)}, "
                             f"got {self.score_function!r}")
        if self.shared_expert_ffn is not None and (isinstance(self.shared_expert_ffn, bool)
                                                   or not isinstance(self.shared_expert_ffn, int)
                                                   or self.shared_expert_ffn < 1):
            raise ValueError(f"model.shared_expert_ffn must be a positive integer or null, "
                             f"got {self.shared_expert_ffn!r}")
        for name in ("aux_loss_coeff", "init_std", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"model.{name} must be a number >= 0, got {v!r}")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 whatever the activation dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rotary_tables(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [S, head_dim / 2] fp32 for rotating pairs (x[..., :d/2], x[..., d/2:])."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, S, head_dim]; rotates each (first half, second half) pair by the position's angle."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.hidden // cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.out = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


def moe_layer_kwargs(cfg: ModelConfig) -> dict:
    """MoELayer arguments for this config; the shared expert only where this qmoe's MoELayer has one."""
    kwargs = dict(score_function=cfg.score_function, num_groups=cfg.num_groups, group_topk=cfg.group_topk,
                  expert_bias=cfg.expert_bias, scaling_factor=cfg.scaling_factor,
                  aux_loss_coeff=float(cfg.aux_loss_coeff))
    if cfg.shared_expert_ffn is not None:
        if "shared_expert_ffn_hidden_size" not in inspect.signature(MoELayer).parameters:
            raise ValueError("model.shared_expert_ffn needs a qmoe whose MoELayer takes "
                             "shared_expert_ffn_hidden_size; set it to null")
        kwargs["shared_expert_ffn_hidden_size"] = cfg.shared_expert_ffn
    return kwargs


def supports_shared_expert() -> bool:
    return "shared_expert_ffn_hidden_size" in inspect.signature(MoELayer).parameters


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm, self.moe_norm = RMSNorm(cfg.hidden), RMSNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.moe = MoELayer(cfg.hidden, cfg.ffn, cfg.experts, cfg.top_k, **moe_layer_kwargs(cfg))

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.moe(self.moe_norm(x))


class MoETransformer(nn.Module):
    """forward(tokens [B, S] int64) -> logits [B, S, V]; `aux_loss()` sums the blocks' router losses."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2's scheme for the dense parts: N(0, std), residual projections shrunk by the depth so
        # the residual stream's variance does not grow with the layer count. The MoE layers keep
        # their own initialisation (qmoe's, the same under every recipe).
        std = self.cfg.init_std
        nn.init.normal_(self.embed.weight, std=std)
        nn.init.normal_(self.head.weight, std=std)
        for block in self.blocks:
            nn.init.normal_(block.attn.qkv.weight, std=std)
            nn.init.normal_(block.attn.out.weight, std=std / math.sqrt(2 * self.cfg.layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be [B, S] int64, got {tuple(tokens.shape)} {tokens.dtype}")
        cos, sin = rotary_tables(tokens.shape[1], self.cfg.hidden // self.cfg.heads, self.cfg.rope_theta,
                                 tokens.device)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    def aux_loss(self) -> torch.Tensor:
        """The routers' auxiliary losses of the last forward (0 when disabled)."""
        return sum(block.moe.aux_loss.to(self.head.weight.device) for block in self.blocks)

    def num_parameters(self) -> dict:
        total = sum(p.numel() for p in self.parameters())
        experts = sum(p.numel() for b in self.blocks for p in b.moe.experts.parameters())
        # active: what one token touches, top_k of the E experts
        active = total - experts + experts * self.cfg.top_k // self.cfg.experts
        return {"total": total, "experts": experts, "active": active}
