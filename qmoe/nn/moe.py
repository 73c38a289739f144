"""`qmoe.nn.MoELayer`: router -> permute (padded to the recipe's alignment) -> experts -> unpermute.

Dimension legend: T tokens, H hidden, F ffn, E experts, K top-k, R = T*K + E*(align-1) rows.
The whole layer is dropless by default, uses static shapes (R depends only on T, K, E and the
recipe) and keeps split sizes on the device, so forward and backward run without a host sync
on the grouped path and can be captured in one CUDA graph.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from qmoe import ops
from qmoe.autocast import RecipeState, autocast_state
from qmoe.nn.grouped_mlp import GroupedMLP
from qmoe.nn.mlp import MLP
from qmoe.nn.router import TopKRouter, detach_at_backward, detached_results
from qmoe.nn.side_stream import side_stream_for
from qmoe.contracts.carriers import AmaxSlot, num_permuted_rows
from qmoe.contracts.validate import check_flag, check_layer_input, check_params_dtype, check_process_group, check_size
from qmoe.ops.amp import cast_for_autocast, torch_autocast_off
from qmoe.quant.replay import active_log


# qmoe.parallel sits above qmoe.nn (DESIGN.md) and builds on its modules; it registers its
# dispatcher here when imported (`import qmoe` imports it), so MoELayer(ep_group=...) can build
# one without importing upward.
_expert_parallel_dispatcher = None
# "0" turns off the permute fused into FC1's input quantization (`moe_permute(..., gather=True)`):
# the permuted rows are then written and read back, with the same results
GATHER_SWITCH = "QMOE_PERMUTE_GATHER"
# "0" turns off the unpermute run inside FC2 (`GroupedMLP(..., unpermute=)`): FC2's output rows
# are then written and the unpermute's backward writes their gradient's [R, H] copy, same results
UNPERMUTE_SWITCH = "QMOE_UNPERMUTE_INSIDE"


def register_expert_parallel_dispatcher(factory) -> None:
    """Set the class MoELayer(ep_group=...) builds its dispatcher with (qmoe.parallel's)."""
    global _expert_parallel_dispatcher
    _expert_parallel_dispatcher = factory


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward layer whose expert GEMMs follow the active recipe.

    forward(x [..., H]) -> [..., H]. After each forward `layer.aux_loss` is the sum of the enabled
    auxiliary losses (a scalar with autograd; zero when all coefficients are 0): add it to the loss.
    The backward detaches it (and the router's kept logits), so the layer holds no graph past it.
    For the sequence-level loss a 3-D input is read as [B, S, H] (batch-major).

    Parameters: `router.weight [E, H]` (fp32), `experts.fc1.weight [E, 2F, H]` for GLU activations
    (gate rows first), `experts.fc2.weight [E, H, F]`, biases `[E, 2F]` / `[E, H]` with bias=True;
    `router.bias [E]` with router_bias=True.

    Routing options (`qmoe.ops.topk_route`): group_score_topk, normalize_topk_probs, router_bias.
    Shared experts (`shared_expert_ffn_hidden_size=Fs`): `shared_experts`, a dense `qmoe.nn.mlp.MLP`
    with the layer's activation (`shared_experts.fc1.weight [2Fs, H]`, `shared_experts.fc2.weight
    [H, Fs]`), quantized under the active recipe, runs on every token and adds to the routed output;
    with `shared_expert_gate=True` its output is scaled by `sigmoid(x @ shared_expert_gate.weight.T)`
    (`shared_expert_gate.weight [1, H]`, Qwen2-MoE), computed in fp32 and never quantized.
    overlap_shared_experts=True runs the shared experts (forward, and so their backward) on a side
    CUDA stream while the current stream routes and runs the routed experts, joined before the
    sum (`qmoe.nn.side_stream`): the same bits, captured by CUDA graphs too; CPU runs in line.

    Expert parallelism (`ep_group`, a torch.distributed group of ep ranks; `qmoe.parallel`): each
    rank holds L = E / ep experts, rank r the global experts r*L .. r*L+L-1, and exchanges tokens
    with all-to-all (shared experts are replicated and run on the rank's own tokens). `experts` then
    holds the local slice only: parameter and state_dict names
    are as above with E replaced by L (`experts.fc1.weight [L, 2F, H]`; per-expert keys numbered
    0..L-1 locally); `qmoe.parallel.shard_expert_state_dict` cuts a full state_dict into a rank's.
    The router is replicated and routes (and computes the auxiliary losses of) this rank's own
    tokens: reduce its gradient over the group as data parallelism does, but never the experts'
    (different experts on every rank: keep them out of a DDP spanning ep_group). The expert
    GEMMs keep their amaxes local (never reduced over `amax_reduction_group`).
    quantized_dispatch: send tokens quantized (1 byte per element plus scales) where the recipe
    allows it; see `qmoe.parallel.ExpertParallelDispatcher`. With capacity_factor the dispatch
    uses static buffers (no host sync); without, it reads split sizes on the host once per layer.
    recompute_activation: the expert activation (FC2's input, quantized for FC2's weight gradient
    under a recipe) is recomputed in the backward from FC1's output instead of saved
    (`GroupedMLP`): less activation memory, the same gradients bit for bit; composes with
    `qmoe.checkpoint`.
    cache_quantized_weights: every expert and shared-expert weight is quantized once and reused
    by the following forwards (gradient-accumulation micro-batches, checkpoint recomputes) while
    it, the recipe and its scales are unchanged: the same bits, the quantized copies held between
    steps (`qmoe.nn.GroupedLinear`, `qmoe.quant.weight_cache`). Delayed scaling's scales move at
    every region exit, so its weights are reused only within one `qmoe.autocast` region. Not for
    weights written behind autograd's version counter (FSDP2's resharding, `.data` writes)
    unless `qmoe.quant.clear_weight_caches(model)` runs after each such write.
    recompute_weight_columnwise: the experts keep no quantized columnwise weight copy for the
    backward, which quantizes it again (`qmoe.nn.GroupedLinear`): less memory, the same bits.

    >>> layer = qmoe.nn.MoELayer(hidden_size=256, ffn_hidden_size=512, num_experts=8, top_k=2)
    >>> with qmoe.autocast(recipe=MXFP8BlockScaling()):
    ...     y = layer(torch.randn(4, 64, 256))
    >>> (y.square().mean() + layer.aux_loss).backward()
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                 activation: str = "swiglu", score_function: str = "softmax", pre_softmax: bool = False,
                 num_groups: int | None = None, group_topk: int | None = None, group_score_topk: int | None = None,
                 normalize_topk_probs: bool | None = None, router_bias: bool = False,
                 scaling_factor: float | None = None,
                 expert_bias: bool = False, aux_loss_coeff: float = 0.0, seq_aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float = 0.0, capacity_factor: float | None = None, bias: bool = False,
                 shared_expert_ffn_hidden_size: int | None = None, shared_expert_gate: bool = False,
                 params_dtype=None, device=None, glu_interleave_size: int | None = None,
                 grouped_path: str = "auto", delay_wgrad_compute: bool = False, ep_group=None,
                 quantized_dispatch: bool = True, recompute_activation: bool = False,
                 overlap_shared_experts: bool = False,
                 cache_quantized_weights: bool = False, recompute_weight_columnwise: bool = False):
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size),
                        ("num_experts", num_experts), ("top_k", top_k)):
            check_size(name, v, "MoELayer")
        for name, v in (("pre_softmax", pre_softmax), ("expert_bias", expert_bias), ("bias", bias),
                        ("delay_wgrad_compute", delay_wgrad_compute), ("quantized_dispatch", quantized_dispatch),
                        ("recompute_activation", recompute_activation),
                        ("overlap_shared_experts", overlap_shared_experts),
                        ("cache_quantized_weights", cache_quantized_weights),
                        ("recompute_weight_columnwise", recompute_weight_columnwise)):
            check_flag(name, v, "MoELayer")
        check_params_dtype(params_dtype, "MoELayer")
        check_process_group("ep_group", ep_group)
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.router = TopKRouter(hidden_size, num_experts, top_k, score_function=score_function,
                                 pre_softmax=pre_softmax, num_groups=num_groups, group_topk=group_topk,
                                 scaling_factor=scaling_factor, expert_bias=expert_bias,
                                 aux_loss_coeff=aux_loss_coeff, seq_aux_loss_coeff=seq_aux_loss_coeff,
                                 z_loss_coeff=z_loss_coeff, capacity_factor=capacity_factor,
                                 group_score_topk=group_score_topk, normalize_topk_probs=normalize_topk_probs,
                                 router_bias=router_bias, device=device)
        self.dispatcher = None
        if ep_group is not None:
            if _expert_parallel_dispatcher is None:
                raise RuntimeError("ep_group needs qmoe.parallel: import qmoe (or qmoe.parallel) first")
            self.dispatcher = _expert_parallel_dispatcher(ep_group, num_experts, top_k,
                                                          capacity_factor=capacity_factor, quantized=quantized_dispatch)
        local_experts = num_experts if self.dispatcher is None else self.dispatcher.num_local_experts
        self.experts = GroupedMLP(local_experts, hidden_size, ffn_hidden_size, activation=activation,
                                  glu_interleave_size=glu_interleave_size, bias=bias, grouped_path=grouped_path,
                                  delay_wgrad_compute=delay_wgrad_compute, params_dtype=params_dtype,
                                  device=device, recompute_activation=recompute_activation,
                                  cache_quantized_weights=cache_quantized_weights,
                                  recompute_weight_columnwise=recompute_weight_columnwise)
        if self.dispatcher is not None:
            for fc in (self.experts.fc1, self.experts.fc2):
                fc.recipe_state = RecipeState(local_amax=True)  # local slot g is a different expert on each rank
        self.shared_experts = self.shared_expert_gate = None
        if shared_expert_ffn_hidden_size is not None:
            if isinstance(shared_expert_ffn_hidden_size, bool) or not isinstance(shared_expert_ffn_hidden_size, int) \
                    or shared_expert_ffn_hidden_size < 1:
                raise ValueError(f"shared_expert_ffn_hidden_size must be a positive int or None, got "
                                 f"{shared_expert_ffn_hidden_size!r}")
            self.shared_experts = MLP(hidden_size, shared_expert_ffn_hidden_size, activation=activation, bias=bias,
                                      params_dtype=params_dtype, device=device,
                                      cache_quantized_weights=cache_quantized_weights)
            if shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, dtype=torch.float32, device=device)
        elif shared_expert_gate:
            raise ValueError("shared_expert_gate=True needs shared experts: set shared_expert_ffn_hidden_size")
        self.overlap_shared_experts = overlap_shared_experts
        self.aux_loss: torch.Tensor = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_layer_input("MoELayer", x, self.hidden_size, f"[..., {self.hidden_size}]",
                          float64=self.experts.fc1.weights()[0].dtype == torch.float64)
        shape = x.shape
        tokens = cast_for_autocast(x.reshape(-1, self.hidden_size))  # permute moves torch.autocast's dtype
        seq_length = shape[-2] if x.dim() >= 3 else None
        shared, side = None, None
        if self.shared_experts is not None:
            side = side_stream_for(tokens.device) if self.overlap_shared_experts else None
            shared = self._shared_experts(tokens) if side is None else side.run(self._shared_experts, tokens)
        probs, routing_map = self.router(tokens, seq_length=seq_length)
        recipe = autocast_state().active_recipe
        align = recipe.align_size if recipe is not None else 1
        if self.dispatcher is not None:
            out = self.dispatcher(tokens, probs, routing_map, self.experts, align)
            self._set_aux_loss()
            return self._add_shared(out, shared, side).reshape(shape)
        # R rounded up to whole blocks: the zero tail joins the last expert's group (absorb_tail)
        # without breaking any block a recipe needs (NVFP4's 16-row Hadamard runs, say)
        rows = -(-num_permuted_rows(tokens.shape[0], self.top_k, self.num_experts, align) // align) * align
        # under current scaling the permute (and the unpermute's backward, or FC2 where the unpermute
        # runs inside it) also reduce the amaxes of the experts' input and output gradient, so those
        # quantizers only cast
        with_amax = self.experts.takes_amax("input", tokens)
        # under a recipe FC1's quantize kernels read the permuted rows straight from the tokens, and
        # FC2 sums its rows back to the tokens itself, so its output gradient's quantize kernels read
        # them from the tokens' gradient
        gather = (recipe is not None and tokens.dtype in (torch.bfloat16, torch.float16, torch.float32)
                  and os.environ.get(GATHER_SWITCH, "") != "0")
        inside = os.environ.get(UNPERMUTE_SWITCH, "") != "0"
        grad_slot = AmaxSlot() if not inside and self.experts.takes_amax("grad_output", tokens) else None
        permuted, row_probs, row_id_map, split_sizes = ops.moe_permute(
            tokens, routing_map, probs, align_size=align, top_k=self.top_k, num_rows=rows, with_amax=with_amax,
            gather=gather)
        permuted, input_amax = permuted if with_amax else (permuted, None)
        if inside:
            out = self.experts(permuted, split_sizes.to(torch.int64), row_probs, input_amax=input_amax,
                               unpermute=row_id_map)
        else:
            y = self.experts(permuted, split_sizes.to(torch.int64), row_probs, input_amax=input_amax,
                             grad_output_amax=grad_slot)
            out = ops.moe_unpermute(y, row_id_map, grad_amax=grad_slot)
        self._set_aux_loss()
        return self._add_shared(out, shared, side).reshape(shape)

    @staticmethod
    def _add_shared(out: torch.Tensor, shared: torch.Tensor | None, side) -> torch.Tensor:
        if shared is None:
            return out
        return out + (shared if side is None else side.join(shared))

    def _shared_experts(self, tokens: torch.Tensor) -> torch.Tensor:
        """Shared experts' output [T, H] in the tokens' dtype, times the sigmoid gate if there is one."""
        out = self.shared_experts(tokens)
        if self.shared_expert_gate is not None:
            with torch_autocast_off():  # fp32 under torch.autocast too, as the router
                gate = torch.sigmoid(tokens.float() @ self.shared_expert_gate.weight.float().t())
            out = (out.float() * gate).to(out.dtype)
        return out.to(tokens.dtype)

    @property
    def overlap_shared_experts(self) -> bool:
        return self.__dict__.get("_overlap_shared_experts", False)  # False in layers pickled before the option

    @overlap_shared_experts.setter
    def overlap_shared_experts(self, value: bool) -> None:
        check_flag("overlap_shared_experts", value, "MoELayer")
        if value and self.shared_experts is None:
            raise ValueError("overlap_shared_experts=True needs shared experts: set shared_expert_ffn_hidden_size")
        self._overlap_shared_experts = value

    @property
    def recompute_activation(self) -> bool:
        return self.experts.recompute_activation

    @recompute_activation.setter
    def recompute_activation(self, value: bool) -> None:
        check_flag("recompute_activation", value, "MoELayer")
        self.experts.recompute_activation = value

    @property
    def cache_quantized_weights(self) -> bool:
        return self.experts.cache_quantized_weights

    @cache_quantized_weights.setter
    def cache_quantized_weights(self, value: bool) -> None:
        check_flag("cache_quantized_weights", value, "MoELayer")
        self.experts.cache_quantized_weights = value
        if self.shared_experts is not None:
            self.shared_experts.cache_quantized_weights = value

    @property
    def recompute_weight_columnwise(self) -> bool:
        return self.experts.recompute_weight_columnwise

    @recompute_weight_columnwise.setter
    def recompute_weight_columnwise(self, value: bool) -> None:
        check_flag("recompute_weight_columnwise", value, "MoELayer")
        self.experts.recompute_weight_columnwise = value

    def __getstate__(self):
        # aux_loss holds the last forward's graph: a copied or saved layer keeps its value
        return detached_results(super().__getstate__(), ("aux_loss",))

    def _set_aux_loss(self) -> None:
        self.aux_loss = self.router.aux_loss
        if self.router.logits is not None:
            detach_at_backward(self.router.logits, self, ("aux_loss",))
        log = active_log()
        if log is not None:  # qmoe.checkpoint(use_reentrant=True) passes the loss out with the output
            log.note_side_output(self)
            log.note_side_output(self.router)

    def backward_dw(self) -> None:
        """Deferred expert weight gradients (with delay_wgrad_compute=True)."""
        self.experts.backward_dw()
