"""A plain PyTorch Mixture-of-Experts, written from scratch as the oracle for qmoe's MoELayer.

Nothing here imports qmoe: routing, capacity, activations, the expert loop and the auxiliary
losses are re-derived from their descriptions (issue 6, `qmoe/reference/activation.py`'s
docstring, `qmoe.ops.topk_route`'s and the aux losses' docstrings), the slow and obvious way.

Dimensions: T tokens, H hidden, F ffn, E experts, K top-k.

Selection reads fp32 scores back to the host and ranks them with Python's sort (ties to the
lower index); the probabilities are then recomputed with differentiable torch ops from the
chosen logits, so autograd of this module gives the gradients every MoELayer test compares.
"""
from __future__ import annotations

import math

import torch

GLU = ("swiglu", "geglu", "clamped_qgeglu")
QGEGLU_LIMIT, QGEGLU_ALPHA = 7.0, 1.702


# ------------------------------------------------------------------ routing

def _scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """Per-expert scores [T, E] fp32 before any normalisation over the chosen experts."""
    x = logits.float()
    if score_function == "softmax":
        e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
        return e / e.sum(dim=-1, keepdim=True)
    if score_function == "sigmoid":
        return 1 / (1 + torch.exp(-x))
    if score_function == "sqrtsoftplus":
        return torch.log1p(torch.exp(-x.abs())).add(x.clamp(min=0)).sqrt()
    raise ValueError(score_function)


def _best(values: list[float], k: int) -> list[int]:
    """Indices of the k largest values, the lower index first among equals."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


def plain_route(logits, top_k, score_function="softmax", pre_softmax=False, num_groups=None, group_topk=None,
                scaling_factor=None, expert_bias=None, group_score_topk=None, normalize_topk_probs=None):
    """(probs [T, E] fp32 differentiable in logits, zero where not chosen; chosen [T, E] bool).

    softmax: rank the logits, softmax over the K chosen (pre_softmax: softmax over all E, rank
    that, keep those values). sigmoid / sqrtsoftplus: rank the scores, normalise the chosen to
    sum 1 when K > 1. normalize_topk_probs=True / False overrides that rule (and normalises a
    pre_softmax selection when True). expert_bias is added to the ranked values for selection
    only. Group-limited routing ranks groups by the sum of their top group_score_topk (default
    K // group_topk) biased values and only chooses inside the best group_topk groups.
    """
    t, e = logits.shape
    full_softmax = score_function == "softmax" and pre_softmax
    if score_function == "softmax" and not pre_softmax:
        ranked = logits.detach().float()
    else:
        ranked = _scores(logits.detach(), score_function)
    if expert_bias is not None:
        ranked = ranked + expert_bias.detach().float()
    chosen = torch.zeros(t, e, dtype=torch.bool)
    for i in range(t):
        row = ranked[i]
        allowed = list(range(e))
        if num_groups is not None:
            size, per_group = e // num_groups, group_score_topk or top_k // group_topk
            group_scores = []
            for g in range(num_groups):
                top = sorted(row[g * size:(g + 1) * size].tolist(), reverse=True)[:per_group]
                acc = torch.tensor(top[0], dtype=torch.float32)
                for v in top[1:]:  # fp32 sum, largest first
                    acc = acc + torch.tensor(v, dtype=torch.float32)
                group_scores.append(acc.item())
            groups = _best(group_scores, group_topk)
            allowed = [j for g in sorted(groups) for j in range(g * size, (g + 1) * size)]
        vals = row.tolist()
        picks = sorted(allowed, key=lambda j: (-vals[j], j))[:top_k]
        chosen[i, picks] = True
    chosen = chosen.to(logits.device)
    x = logits.float()
    if score_function == "softmax":
        if full_softmax:
            probs = _scores(x, "softmax") * chosen
            if normalize_topk_probs:
                probs = probs / probs.sum(dim=-1, keepdim=True)
        else:
            masked = x.masked_fill(~chosen, float("-inf"))
            probs = torch.exp(masked - masked.max(dim=-1, keepdim=True).values)
            probs = probs / probs.sum(dim=-1, keepdim=True)
            probs = torch.where(chosen, probs, torch.zeros_like(probs))
    else:
        s = torch.where(chosen, _scores(torch.where(chosen, x, torch.zeros_like(x)), score_function),
                        torch.zeros_like(x))
        normalize = top_k > 1 if normalize_topk_probs is None else normalize_topk_probs
        probs = s / s.sum(dim=-1, keepdim=True) if normalize else s
    if scaling_factor is not None:
        probs = probs * scaling_factor
    return probs, chosen


def plain_capacity(probs, chosen, capacity_factor):
    """Each expert keeps its ceil(T*K*factor / E) highest-prob assignments (lower token on ties)."""
    t, e = chosen.shape
    capacity = math.ceil(int(chosen.sum()) * capacity_factor / e)
    kept = torch.zeros_like(chosen)
    p = probs.detach()
    for j in range(e):
        rows = [i for i in range(t) if chosen[i, j]]
        rows.sort(key=lambda i: (-p[i, j].item(), i))
        kept[rows[:capacity], j] = True
    return probs * kept, kept


# ------------------------------------------------------------------ experts

def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def plain_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """act(h) for h [n, 2F] (GLU: gate columns first, then linear) or [n, F]."""
    if activation == "relu2":
        return torch.clamp(h, min=0) ** 2
    if activation == "gelu":
        return _gelu_tanh(h)
    f = h.shape[-1] // 2
    gate, linear = h[:, :f], h[:, f:]
    if activation == "swiglu":
        return gate / (1 + torch.exp(-gate)) * linear
    if activation == "geglu":
        return _gelu_tanh(gate) * linear
    if activation == "clamped_qgeglu":
        gate = torch.clamp(gate, max=QGEGLU_LIMIT)
        linear = torch.clamp(linear, -QGEGLU_LIMIT, QGEGLU_LIMIT)
        return (linear + 1) * gate / (1 + torch.exp(-QGEGLU_ALPHA * gate))
    raise ValueError(activation)


def plain_experts(x, probs, chosen, w1, w2, b1=None, b2=None, activation="swiglu"):
    """sum over chosen experts e of probs[t, e] * (act(x W1_e^T + b1_e) W2_e^T + b2_e), per expert."""
    parts = [[] for _ in range(x.shape[0])]  # each token's weighted expert outputs
    for e in range(w1.shape[0]):
        rows = chosen[:, e].nonzero().flatten()
        if rows.numel() == 0:
            continue
        h = x[rows] @ w1[e].t()
        if b1 is not None:
            h = h + b1[e]
        y = plain_activation(h, activation) @ w2[e].t()
        if b2 is not None:
            y = y + b2[e]
        for j, t in enumerate(rows.tolist()):
            parts[t].append(probs[t, e] * y[j])
    zero = x.new_zeros(x.shape[-1])
    return torch.stack([sum(p, zero) for p in parts]) if parts else torch.zeros_like(x)


# ------------------------------------------------------------------ auxiliary losses

def balance_scores(logits, score_function):
    """What the balance losses see: every expert's score, normalised to sum 1 per token."""
    s = _scores(logits, score_function)
    return s if score_function == "softmax" else s / s.sum(dim=-1, keepdim=True)


def plain_aux_loss(scores, chosen, top_k, coeff):
    """Switch balance loss: coeff * E / K * sum_e mean_t(scores[t, e]) * (count_e / T)."""
    t, e = scores.shape
    frac_tokens = chosen.float().sum(0) / t
    mean_prob = scores.sum(0) / t
    return coeff * e / top_k * (frac_tokens * mean_prob).sum()


def plain_seq_aux_loss(scores, chosen, seq_length, top_k, coeff):
    """DeepSeek sequence loss, mean over sequences b of sum_e f[b, e] * P[b, e] with
    f = E / (K * L) * count in b and P = mean over b's tokens of the scores."""
    t, e = scores.shape
    total = scores.new_zeros(())
    b = t // seq_length
    for i in range(b):
        s = slice(i * seq_length, (i + 1) * seq_length)
        f = chosen[s].float().sum(0) * e / (top_k * seq_length)
        total = total + (f * scores[s].mean(0)).sum()
    return coeff * total / b


def plain_z_loss(logits, coeff):
    m = logits.max(dim=-1, keepdim=True).values
    lse = (m + torch.log(torch.exp(logits - m).sum(dim=-1, keepdim=True))).squeeze(-1)
    return coeff * (lse ** 2).mean()


# ------------------------------------------------------------------ the layer

def plain_moe(x, params, top_k, activation="swiglu", score_function="softmax", pre_softmax=False,
              num_groups=None, group_topk=None, scaling_factor=None, expert_bias=None, aux_loss_coeff=0.0,
              seq_aux_loss_coeff=0.0, z_loss_coeff=0.0, capacity_factor=None, record=None,
              group_score_topk=None, normalize_topk_probs=None):
    """x [..., H] -> (y [..., H], aux loss scalar, chosen [T, E] bool after capacity).

    params: {"router": [E, H], "w1": [E, 2F or F, H], "w2": [E, H, F], "b1"/"b2" or None}, in
    the logical layout (gate rows first), and optionally "router_bias" [E] (added to the logits),
    "shared_w1" [2Fs or Fs, H] / "shared_w2" [H, Fs] (a dense MLP on every token, added to the
    output) and "shared_gate" [1, H] (the shared MLP's output times sigmoid(x @ gate^T)).
    A 3-D x is [B, S, H]: S tokens a sequence.
    record: an optional dict that receives the intermediate "logits" and "probs" [T, E].
    """
    shape = x.shape
    tokens = x.reshape(-1, shape[-1])
    logits = tokens.float() @ params["router"].t()
    if params.get("router_bias") is not None:
        logits = logits + params["router_bias"]
    probs, chosen = plain_route(logits, top_k, score_function, pre_softmax, num_groups, group_topk,
                                scaling_factor, expert_bias, group_score_topk, normalize_topk_probs)
    if capacity_factor is not None:
        probs, chosen = plain_capacity(probs, chosen, capacity_factor)
    y = plain_experts(tokens, probs, chosen, params["w1"], params["w2"], params.get("b1"), params.get("b2"),
                      activation)
    if params.get("shared_w1") is not None:
        shared = plain_activation(tokens @ params["shared_w1"].t(), activation) @ params["shared_w2"].t()
        if params.get("shared_gate") is not None:
            shared = shared / (1 + torch.exp(-(tokens @ params["shared_gate"].t())))
        y = y + shared
    aux = logits.new_zeros(())
    if aux_loss_coeff or seq_aux_loss_coeff:
        scores = balance_scores(logits, score_function)
    if aux_loss_coeff:
        aux = aux + plain_aux_loss(scores, chosen, top_k, aux_loss_coeff)
    if seq_aux_loss_coeff:
        seq = shape[-2] if x.dim() >= 3 else tokens.shape[0]
        aux = aux + plain_seq_aux_loss(scores, chosen, seq, top_k, seq_aux_loss_coeff)
    if z_loss_coeff:
        aux = aux + plain_z_loss(logits, z_loss_coeff)
    if record is not None:
        record.update(logits=logits, probs=probs)
    return y.reshape(shape), aux, chosen


def params_of(layer, requires_grad=True) -> dict:
    """Fresh leaf copies of a qmoe MoELayer's parameters in the logical layout (its state_dict)."""
    sd = layer.state_dict()

    def leaf(t):
        return t.detach().clone().float().requires_grad_(requires_grad)

    e = layer.num_experts

    def stacked(name):
        if f"experts.{name}" in sd:
            return leaf(sd[f"experts.{name}"])
        if f"experts.{name}0" in sd:
            return leaf(torch.stack([sd[f"experts.{name}{g}"] for g in range(e)]))
        return None

    def optional(key):
        return leaf(sd[key]) if key in sd else None

    return {"router": leaf(sd["router.weight"]), "w1": stacked("fc1.weight"), "w2": stacked("fc2.weight"),
            "b1": stacked("fc1.bias"), "b2": stacked("fc2.bias"), "router_bias": optional("router.bias"),
            "shared_w1": optional("shared_experts.fc1.weight"), "shared_w2": optional("shared_experts.fc2.weight"),
            "shared_gate": optional("shared_expert_gate.weight")}
