"""One Hugging Face MoE block <-> one `qmoe.nn.MoELayer`: options read from the block, weights copied.

Dimension legend: H hidden, F expert ffn, Fs shared-expert ffn, E experts.

Blocks are recognised by class name, so this module never imports transformers. Both expert
layouts are read and written: the fused 3-D parameters of transformers 5.x (`experts.gate_up_proj
[E, 2F, H]`, gate rows first, and `experts.down_proj [E, H, F]`; gpt-oss stores `[E, H, 2F]` with
gate and linear columns interleaved, and `[E, F, H]`) and the per-expert `ModuleList` of 4.x
(`w1`/`w3`/`w2` for Mixtral, `gate_proj`/`up_proj`/`down_proj` elsewhere).

Routing rules per family (transformers' own code is the spec):
    Mixtral, Qwen3-MoE, Qwen2-MoE   softmax over all experts, top-k, renormalised when norm_topk_prob
                                   (Mixtral always): softmax after top-k, or pre_softmax without it
    DeepSeek-V3                    sigmoid, e_score_correction_bias for selection (expert_bias),
                                   groups scored by their top 2, norm_topk_prob, routed_scaling_factor
    gpt-oss                        logits + router bias, top-k on the logits, softmax over the chosen;
                                   clamped swiglu (alpha 1.702, limit 7): qmoe's "clamped_qgeglu"
Qwen2-MoE's shared expert is gated by sigmoid(x @ shared_expert_gate^T); DeepSeek-V3's is not.
transformers 4.x DeepSeek-V3 masks the scores of other groups with 0 where 5.x (and qmoe) use -inf:
the two agree whenever every sigmoid score + e_score_correction_bias is positive.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qmoe.contracts.carriers import QGEGLU_ALPHA, QGEGLU_LIMIT
from qmoe.contracts.errors import UnsupportedError
from qmoe.nn.moe import MoELayer


def unsupported(what: str, why: str, fix: str = "") -> UnsupportedError:
    """The error for a block, config or layout that qmoe.hf cannot convert."""
    return UnsupportedError(f"qmoe.hf conversion of {what}", why=why, fix=fix)

# class name -> (family, attribute holding the router)
FAMILIES = {
    "MixtralSparseMoeBlock": ("mixtral", "gate"),
    "Qwen2MoeSparseMoeBlock": ("qwen2_moe", "gate"),
    "Qwen3MoeSparseMoeBlock": ("qwen3_moe", "gate"),
    "DeepseekV3MoE": ("deepseek_v3", "gate"),
    "GptOssMLP": ("gpt_oss", "router"),
}


def family_of(block) -> str:
    """The family name of a supported block; UnsupportedError naming the class otherwise."""
    name = type(block).__name__
    if name not in FAMILIES:
        raise unsupported(name, "not a supported MoE block", f"convert one of {', '.join(FAMILIES)}")
    return FAMILIES[name][0]


def router_of(block):
    return getattr(block, FAMILIES[type(block).__name__][1])


def _get(what: str, *owners, default=None):
    """The first owner's attribute `what` (transformers moved router settings between versions)."""
    for owner in owners:
        if hasattr(owner, what):
            return getattr(owner, what)
    if default is not None:
        return default
    raise unsupported(type(owners[0]).__name__, f"no attribute {what!r}: an unknown transformers layout")


def _glu_activation(act_fn, where: str) -> str:
    """qmoe's GLU activation equal to the block's act_fn, found by evaluating it (names vary by version)."""
    x = torch.linspace(-8.0, 8.0, 161)
    y = act_fn(x)
    if torch.allclose(y, F.silu(x), rtol=1e-6, atol=1e-6):
        return "swiglu"
    if torch.allclose(y, F.gelu(x, approximate="tanh"), rtol=1e-6, atol=1e-6):
        return "geglu"
    raise unsupported(where, f"activation {type(act_fn).__name__} has no qmoe equivalent",
                      "qmoe's GLU activations are silu (swiglu) and tanh-approximate gelu (geglu)")


def _shared_of(block):
    """The block's shared-expert MLP (Qwen2-MoE: shared_expert, DeepSeek-V3: shared_experts) or None."""
    shared = getattr(block, "shared_expert", None)
    return shared if shared is not None else getattr(block, "shared_experts", None)


def _fused(experts) -> bool:
    return isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)


def _expert_act_fn(experts):
    return experts.act_fn if hasattr(experts, "act_fn") else experts[0].act_fn


def _mlp_triplet(mlp):
    """(gate [F, H], up [F, H], down [H, F]) parameters of one HF dense MLP (4.x expert or shared expert)."""
    if hasattr(mlp, "w1"):
        return mlp.w1.weight, mlp.w3.weight, mlp.w2.weight
    return mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight


def layer_options(block) -> dict:
    """MoELayer keyword arguments equal to the block's routing and shapes."""
    family = family_of(block)
    name = type(block).__name__
    router = router_of(block)
    num_experts, hidden = router.weight.shape
    experts = block.experts
    top_k = _get("top_k", router, block)
    opts = dict(hidden_size=hidden, num_experts=num_experts, top_k=top_k)
    if family == "gpt_oss":
        alpha, limit = float(_get("alpha", experts)), float(_get("limit", experts))
        if alpha != QGEGLU_ALPHA or limit != QGEGLU_LIMIT:
            raise unsupported(name, f"swiglu_alpha={alpha}, swiglu_limit={limit}",
                              f"qmoe's clamped_qgeglu has alpha {QGEGLU_ALPHA} and limit {QGEGLU_LIMIT}")
        return dict(opts, ffn_hidden_size=experts.gate_up_proj.shape[-1] // 2, activation="clamped_qgeglu",
                    router_bias=True, bias=True)
    activation = _glu_activation(_expert_act_fn(experts), name)
    ffn = experts.gate_up_proj.shape[1] // 2 if _fused(experts) else _mlp_triplet(experts[0])[0].shape[0]
    opts.update(ffn_hidden_size=ffn, activation=activation)
    if family == "mixtral":
        if float(_get("jitter_noise", block, default=0.0)) > 0:
            raise unsupported(name, "router_jitter_noise > 0", "set config.router_jitter_noise = 0")
    elif family in ("qwen2_moe", "qwen3_moe"):
        # softmax over all, top-k, optional renormalisation: renormalised it is a softmax after top-k
        opts["pre_softmax"] = not bool(_get("norm_topk_prob", router, block))
    else:  # deepseek_v3
        groups = int(_get("num_group", router, default=0) or _get("n_group", router, block))
        opts.update(score_function="sigmoid", expert_bias=True,
                    normalize_topk_probs=bool(_get("norm_topk_prob", router, block)),
                    scaling_factor=float(_get("routed_scaling_factor", router, block)))
        if groups > 1:
            if num_experts // groups < 2:
                raise unsupported(name, f"n_group={groups} leaves fewer than 2 experts per group")
            opts.update(num_groups=groups, group_topk=int(_get("topk_group", router, block)), group_score_topk=2)
    shared = _shared_of(block)
    if shared is not None:
        opts["shared_expert_ffn_hidden_size"] = _mlp_triplet(shared)[0].shape[0]
        if _glu_activation(shared.act_fn, f"{name}.shared_expert") != activation:
            raise unsupported(name, "the shared expert's activation differs from the experts'")
        opts["shared_expert_gate"] = getattr(block, "shared_expert_gate", None) is not None
    return opts


def _hf_tensors(block) -> dict:
    """The block's weights by qmoe state_dict key (logical layout), as views of the HF tensors where
    possible. Values are callables (read) paired with writers, so from_hf and to_hf share one map."""
    family = family_of(block)
    router, experts = router_of(block), block.experts
    out = {"router.weight": router.weight}
    if family == "gpt_oss":
        out["router.bias"] = router.bias
    if family == "deepseek_v3":
        out["router.expert_bias"] = router.e_score_correction_bias
    shared = _shared_of(block)
    if shared is not None:
        gate, up, down = _mlp_triplet(shared)
        out["shared_experts.fc1.weight"] = (gate, up)  # concatenated along rows
        out["shared_experts.fc2.weight"] = down
        if getattr(block, "shared_expert_gate", None) is not None:
            out["shared_expert_gate.weight"] = block.shared_expert_gate.weight
    if family == "gpt_oss":
        out["experts.fc1.weight"] = ("gpt_oss_fc1", experts.gate_up_proj)
        out["experts.fc1.bias"] = ("gpt_oss_fc1_bias", experts.gate_up_proj_bias)
        out["experts.fc2.weight"] = ("transpose", experts.down_proj)
        out["experts.fc2.bias"] = experts.down_proj_bias
    elif _fused(experts):
        out["experts.fc1.weight"] = experts.gate_up_proj
        out["experts.fc2.weight"] = experts.down_proj
    else:
        triplets = [_mlp_triplet(e) for e in experts]
        out["experts.fc1.weight"] = ("stack_cat", [(g, u) for g, u, _ in triplets])
        out["experts.fc2.weight"] = ("stack", [d for _, _, d in triplets])
    return out


def _read(spec, grad: bool = False) -> torch.Tensor:
    """The logical-layout tensor of `spec` (or of its gradients with grad=True)."""
    if isinstance(spec, torch.Tensor):
        if grad and spec.grad is None:  # a 4.x expert that got no token
            return torch.zeros_like(spec)
        return (spec.grad if grad else spec).detach()
    if isinstance(spec[0], torch.Tensor):  # (gate, up)
        return torch.cat([_read(t, grad) for t in spec], dim=0)
    kind, src = spec
    if kind == "gpt_oss_fc1":  # [E, H, 2F] interleaved columns -> [E, 2F, H], gate rows first
        w = _read(src, grad)
        return torch.cat((w[..., ::2], w[..., 1::2]), dim=-1).transpose(1, 2)
    if kind == "gpt_oss_fc1_bias":
        b = _read(src, grad)
        return torch.cat((b[..., ::2], b[..., 1::2]), dim=-1)
    if kind == "transpose":
        return _read(src, grad).transpose(1, 2)
    return torch.stack([_read(item, grad) for item in src])  # "stack" and "stack_cat"


def hf_state_dict(block, grad: bool = False) -> dict:
    """The block's weights (or their gradients) under the qmoe layer's state_dict keys, in the
    layer's logical layout: what `from_hf` loads and what tests compare gradients with."""
    return {key: _read(spec, grad) for key, spec in _hf_tensors(block).items()
            if not grad or key != "router.expert_bias"}


@torch.no_grad()
def _write(spec, value: torch.Tensor) -> list[torch.Tensor]:
    """Copy `value` (logical layout) into the HF tensors of `spec`; returns the tensors written."""
    if isinstance(spec, torch.Tensor):
        spec.copy_(value)
        return [spec]
    if isinstance(spec[0], torch.Tensor):
        gate, up = spec
        gate.copy_(value[:gate.shape[0]])
        up.copy_(value[gate.shape[0]:])
        return [gate, up]
    kind, dst = spec
    if kind in ("gpt_oss_fc1", "gpt_oss_fc1_bias"):
        v = value.transpose(1, 2) if kind == "gpt_oss_fc1" else value
        f = v.shape[-1] // 2
        dst[..., ::2] = v[..., :f]
        dst[..., 1::2] = v[..., f:]
        return [dst]
    if kind == "transpose":
        dst.copy_(value.transpose(1, 2))
        return [dst]
    written = []
    for g, item in enumerate(dst):
        written += _write(item, value[g])
    return written


def from_hf(block) -> MoELayer:
    """A `qmoe.nn.MoELayer` equal to a Hugging Face MoE block, with its weights, device and dtype.

    block: a `MixtralSparseMoeBlock`, `Qwen2MoeSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`,
    `DeepseekV3MoE` or `GptOssMLP` (transformers 4.x or 5.x layout). The router is fp32 as always
    in qmoe; DeepSeek-V3's e_score_correction_bias becomes `router.expert_bias`, kept fixed
    (`router.expert_bias_update_rate = 0`, as transformers does; raise it to train the bias).
    An unsupported block or config raises `qmoe.UnsupportedError` naming it.

    >>> layer = qmoe.hf.from_hf(model.model.layers[0].mlp)
    >>> y = layer(hidden_states)            # == the block's output
    """
    opts = layer_options(block)
    ref = _read(_hf_tensors(block)["experts.fc2.weight"])
    layer = MoELayer(**opts, params_dtype=ref.dtype, device=ref.device)
    layer.router.expert_bias_update_rate = 0.0
    state = layer.state_dict()
    for key, spec in _hf_tensors(block).items():
        if state[key].shape != _read(spec).shape:
            raise unsupported(type(block).__name__, f"{key} has shape {tuple(_read(spec).shape)}, expected "
                              f"{tuple(state[key].shape)}")
        state[key] = _read(spec)
    layer.load_state_dict(state)
    layer.train(block.training)
    return layer


def to_hf(layer: MoELayer, block) -> None:
    """Write `layer`'s weights into the Hugging Face block (in place, in the block's dtypes).

    Every parameter and buffer of the block is written; the layer must have the block's options
    (as `from_hf` builds it) and hold all experts (not an expert-parallel shard).
    """
    if layer.dispatcher is not None:
        raise unsupported("an expert-parallel layer", "to_hf needs all experts in one layer",
                          "gather the shards into one MoELayer first")
    want = layer_options(block)
    for key, value in want.items():
        have = getattr(layer, key, None) if key in ("hidden_size", "num_experts", "top_k") else None
        if have is not None and have != value:
            raise ValueError(f"layer {key}={have} does not match the block's {value}")
    state = layer.state_dict()
    written = set()
    for key, spec in _hf_tensors(block).items():
        if key not in state:
            raise ValueError(f"the layer has no {key!r}; was it built by qmoe.hf.from_hf for this block?")
        written |= {id(t) for t in _write(spec, state[key])}
    missing = [n for n, t in list(block.named_parameters()) + list(block.named_buffers()) if id(t) not in written]
    if missing:
        raise unsupported(type(block).__name__, f"qmoe.hf does not know where {missing} come from")
