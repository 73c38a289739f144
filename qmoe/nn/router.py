"""`qmoe.nn.TopKRouter`: fp32 router logits, top-k selection, capacity and the auxiliary losses."""
from __future__ import annotations

import torch
from torch import nn

from qmoe import ops
from qmoe.autocast import refuse_foreign_recompute
from qmoe.contracts.enums import parse_score_function
from qmoe.contracts.validate import (check_capacity_factor, check_device, check_flag, check_number, check_size,
                                     check_topk_route_args)
from qmoe.ops.amp import torch_autocast_off
from qmoe.ops.router import balance_scores
from qmoe.quant.replay import active_log, recomputing


class TopKRouter(nn.Module):
    """Routes each token to `top_k` of `num_experts` experts.

    forward(x [T, H]) -> (probs [T, E] fp32, zero where not chosen; routing_map [T, E] bool).
    The router computes its logits, probabilities and losses in fp32 whatever the input's and
    its own parameters' dtype (`weight [E, H]` starts in fp32; `.to(torch.bfloat16)` casts it
    like any parameter, and the logits are still fp32 products), and torch.autocast does not
    reach inside it, so selection does not flip with the activation precision. `expert_bias`
    stays fp32 through `.to(dtype)` / `.half()` / `.bfloat16()`: its updates (1e-3 steps) would
    vanish in a 16-bit buffer. After a forward, `self.aux_loss` holds the sum of the enabled
    auxiliary losses (0 when all coefficients are 0), `self.tokens_per_expert` the counts and
    `self.logits` the fp32 logits [T, E] (with autograd, for losses computed outside, such as
    Hugging Face's load-balancing loss); the backward through the logits detaches `aux_loss` and
    `logits` so the module does not hold the step's graph into the next one. With
    `expert_bias=True` the bias shifts selection only and is updated in place after every training
    forward (aux-loss-free balancing).

    Routing options of real models (see `qmoe.ops.topk_route`): `group_score_topk` (DeepSeek-V3
    scores a group by its top 2), `normalize_topk_probs` (Qwen's and DeepSeek's norm_topk_prob),
    `router_bias=True`: a learned `bias [E]` (fp32) added to the logits (gpt-oss).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, score_function="softmax",
                 pre_softmax: bool = False, num_groups: int | None = None, group_topk: int | None = None,
                 scaling_factor: float | None = None, expert_bias: bool = False,
                 expert_bias_update_rate: float = 1e-3, aux_loss_coeff: float = 0.0,
                 seq_aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                 capacity_factor: float | None = None, group_score_topk: int | None = None,
                 normalize_topk_probs: bool | None = None, router_bias: bool = False, device=None):
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("num_experts", num_experts), ("top_k", top_k)):
            check_size(name, v, "TopKRouter")
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
        for name, v in (("aux_loss_coeff", aux_loss_coeff), ("seq_aux_loss_coeff", seq_aux_loss_coeff),
                        ("z_loss_coeff", z_loss_coeff), ("expert_bias_update_rate", expert_bias_update_rate)):
            check_number(name, v, "TopKRouter")
        check_flag("pre_softmax", pre_softmax, "TopKRouter")
        check_flag("expert_bias", expert_bias, "TopKRouter")
        check_flag("router_bias", router_bias, "TopKRouter")
        if capacity_factor is not None:
            check_capacity_factor(capacity_factor)
        device = check_device(device)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_function = parse_score_function(score_function)
        # the routing options are checked here, so a bad combination fails at construction
        check_topk_route_args(torch.empty(0, num_experts, device="meta"), top_k, score_function, pre_softmax,
                              num_groups, group_topk, scaling_factor, None, group_score_topk, normalize_topk_probs)
        self.group_score_topk, self.normalize_topk_probs = group_score_topk, normalize_topk_probs
        self.pre_softmax, self.num_groups, self.group_topk = pre_softmax, num_groups, group_topk
        self.scaling_factor, self.capacity_factor = scaling_factor, capacity_factor
        self.aux_loss_coeff, self.seq_aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, seq_aux_loss_coeff, \
            z_loss_coeff
        self.expert_bias_update_rate = expert_bias_update_rate
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32, device=device))
        nn.init.normal_(self.weight, std=hidden_size ** -0.5)
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32, device=device)) if router_bias else None
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
        else:
            self.expert_bias = None
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None

    def _apply(self, fn, *args, **kwargs):
        bias = self.expert_bias
        out = super()._apply(fn, *args, **kwargs)
        if bias is not None and self.expert_bias.dtype != torch.float32:
            # a dtype cast: keep the fp32 values (moved wherever the cast put the buffer)
            self.expert_bias = bias.to(self.expert_bias.device)
        return out

    def __getstate__(self):
        # the last forward's results hold its autograd graph, which neither copy.deepcopy nor
        # pickle can take: a copied or saved router keeps their values
        return detached_results(super().__getstate__(), ("aux_loss", "tokens_per_expert", "logits"))

    def forward(self, x: torch.Tensor, seq_length: int | None = None):
        """x: [T, H] any float dtype; seq_length: tokens per sequence for the sequence-level loss
        (T must be a multiple; default: all T tokens form one sequence)."""
        refuse_foreign_recompute("qmoe.nn.TopKRouter")
        with torch_autocast_off():
            return self._route(x, seq_length)

    def _route(self, x, seq_length):
        logits = ops.router_logits(x, self.weight, self.bias)
        expert_bias = self.expert_bias
        log = active_log()
        if expert_bias is not None and log is not None:
            # qmoe.checkpoint: the recompute routes with the bias the first run used (updated since)
            expert_bias = log.keep(self, expert_bias.clone)
        probs, routing_map = ops.topk_route(
            logits, self.top_k, score_function=self.score_function.value, pre_softmax=self.pre_softmax,
            num_groups=self.num_groups, group_topk=self.group_topk, scaling_factor=self.scaling_factor,
            expert_bias=expert_bias, group_score_topk=self.group_score_topk,
            normalize_topk_probs=self.normalize_topk_probs)
        if self.capacity_factor is not None:
            probs, routing_map = ops.apply_capacity(probs, routing_map, self.capacity_factor)
        tokens_per_expert = routing_map.sum(dim=0)
        self.tokens_per_expert = tokens_per_expert
        self.logits = logits
        self.aux_loss = self._aux_losses(logits, routing_map, tokens_per_expert, seq_length)
        detach_at_backward(logits, self, ("logits", "aux_loss"))
        if self.expert_bias is not None and self.training and not recomputing():
            ops.update_expert_bias(self.expert_bias, tokens_per_expert, self.expert_bias_update_rate)
        return probs, routing_map

    def _aux_losses(self, logits, routing_map, tokens_per_expert, seq_length):
        loss = logits.new_zeros(())
        if not (self.aux_loss_coeff or self.seq_aux_loss_coeff or self.z_loss_coeff):
            return loss
        num_tokens = logits.shape[0]
        if self.aux_loss_coeff or self.seq_aux_loss_coeff:
            # balance losses see every expert's score (normalised), not only the chosen ones
            scores = balance_scores(logits, self.score_function)
        if self.aux_loss_coeff:
            loss = loss + ops.moe_aux_loss(scores, tokens_per_expert, num_tokens, self.num_experts, self.top_k,
                                           self.aux_loss_coeff)
        if self.seq_aux_loss_coeff:
            loss = loss + ops.seq_aux_loss(scores, routing_map, seq_length or max(num_tokens, 1), self.top_k,
                                           self.seq_aux_loss_coeff)
        if self.z_loss_coeff:
            loss = loss + ops.z_loss(logits, self.z_loss_coeff)
        return loss


def detach_at_backward(anchor: torch.Tensor, owner: nn.Module, names: tuple[str, ...]) -> None:
    """Once the backward has passed `anchor`, replace `owner`'s named results by detached tensors.

    A result kept with its graph keeps the whole forward's autograd graph alive into the next step,
    the parameters' gradient-accumulation nodes included. Those nodes remember the stream they were
    made on, so steps run on another stream (a CUDA-graph capture, whose warm-up runs on a side
    stream) would synchronise with that stream, and a capture fails. Compiled code keeps them.
    """
    if not anchor.requires_grad or torch.compiler.is_compiling():
        return

    def release(grad):
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                setattr(owner, name, value.detach())
    anchor.register_hook(release)


def detached_results(state: dict, names: tuple[str, ...]) -> dict:
    """A module's `__getstate__` with its per-forward result tensors detached (values kept)."""
    for name in names:
        value = state.get(name)
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            state[name] = value.detach()
    return state
