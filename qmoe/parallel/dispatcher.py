"""Expert parallelism: experts split over the ranks of a group, tokens sent to them by all-to-all.

Dimension legend: T local tokens, H hidden, E experts (all ranks), L = E / ep local experts,
K top-k, S = T * K token copies, C capacity rows per (source rank, expert), R rows.

One MoE layer forward on every rank of the group (`MoELayer(..., ep_group=group)`):

    route locally (full router, replicated)          probs [T, E], routing_map [T, E]
    group token copies by global expert              [S, H]: rank j's experts are contiguous
    (quantized dispatch: quantize rowwise first, send FP8 codes + scales as bytes)
    exchange per-expert counts, all-to-all rows      [rows from every rank, H] + their probs
    sort received rows by local expert, pad groups   [R, H], split sizes [L]
    local GroupedMLP (probs applied as in MoELayer)
    undo the sort, all-to-all back, unpermute        [T, H]

Backward mirrors it: every all-to-all is an autograd Function whose backward sends the
gradients back along the reverse splits. Expert e lives on rank e // L as local expert e % L.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from qmoe import ops
from qmoe.autocast import autocast_state
from qmoe.nn.moe import register_expert_parallel_dispatcher
from qmoe.parallel.comm import AllToAll, Exchange, all_to_all, exchange_counts
from qmoe.parallel.payload import PackedRows


class _QuantizedDispatch(torch.autograd.Function):
    """Send quantized rows and their probs; the rows' gradient goes back in high precision.

    Forward value: the received rows dequantized (`carrier`, what FC1's GEMM multiplies) and
    their bytes. Backward: a straight-through estimator, as quantization inside a GEMM is
    elsewhere in qmoe: the carrier's gradient is sent back and summed over each token's copies.
    """

    @staticmethod
    def forward(ctx, tokens, send_probs, send_bytes, exchange, packed, grad_to_tokens):
        recv_bytes = all_to_all(send_bytes, exchange)
        recv_probs = all_to_all(send_probs, exchange)
        ctx.exchange, ctx.grad_to_tokens = exchange, grad_to_tokens
        ctx.mark_non_differentiable(recv_bytes)
        return packed.dequantize(recv_bytes, tokens.dtype), recv_probs, recv_bytes

    @staticmethod
    def backward(ctx, grad_rows, grad_probs, _):
        back = ctx.exchange.reverse()
        rows = all_to_all(grad_rows.contiguous(), back)  # both collectives always run, in this order
        probs = all_to_all(grad_probs.contiguous(), back)
        return ctx.grad_to_tokens(rows), probs, None, None, None, None


class _DroplessRoute:
    """Every token copy is delivered: split sizes are exchanged and read on the host (one sync)."""

    def __init__(self, d: "ExpertParallelDispatcher", row_id_map, align_size: int):
        self.d, self.align = d, align_size
        counts = row_id_map.counts.to(torch.int64)  # [E] copies this rank sends to each expert
        self.recv_counts = exchange_counts(counts, d.group)  # [ep, L]
        # the one host synchronisation of the layer: all-to-all split sizes live on the host
        sizes = torch.cat((counts.view(d.ep_size, -1).sum(1), self.recv_counts.sum(1))).tolist()
        send, recv = tuple(sizes[:d.ep_size]), tuple(sizes[d.ep_size:])
        self.exchange = Exchange(d.group, send, recv, sum(recv), sum(send))
        self.num_rows = row_id_map.num_rows

    def to_send(self, rows: torch.Tensor) -> torch.Tensor:
        """Permuted rows [S', ...] -> the send buffer (the used rows)."""
        return rows[:self.exchange.send_rows]

    def from_send(self, buf: torch.Tensor) -> torch.Tensor:
        """The send buffer's layout back to permuted rows (zeros for unused ones): to_send's adjoint."""
        pad = self.num_rows - buf.shape[0]
        return torch.cat((buf, buf.new_zeros((pad, *buf.shape[1:])))) if pad else buf

    def sort(self, recv, recv_probs, recv_bytes):
        """Received rows (source-major) -> grouped by local expert, each group padded to align_size."""
        n, l, align = self.exchange.recv_rows, self.d.num_local_experts, self.align
        local = torch.arange(l, device=recv.device).repeat(self.d.ep_size)
        local = torch.repeat_interleave(local, self.recv_counts.flatten(), output_size=n)
        routing_map = local.unsqueeze(1) == torch.arange(l, device=recv.device)  # [n, L] (one_hot would sync)
        probs = recv_probs.unsqueeze(1) * routing_map
        # static rows as MoELayer counts them, and at least one (zero) row for a rank that got no tokens
        rows = max(-(-(n + l * (align - 1)) // align) * align, align)
        out = ops.moe_permute(recv, routing_map, probs, align_size=align, top_k=1, num_rows=rows,
                              row_scales=recv_bytes)
        self.sort_map = out[2]
        return out[0], out[1], out[3].to(torch.int64), (out[4] if recv_bytes is not None else None)

    def unsort(self, y: torch.Tensor) -> torch.Tensor:
        return ops.moe_unpermute(y, self.sort_map)


class _FixedCapacityRoute:
    """At most C copies per (source rank, expert), in static zero-padded buffers: the all-to-all
    splits are equal and nothing is read on the host, so the layer can be captured in a CUDA graph."""

    def __init__(self, d: "ExpertParallelDispatcher", row_id_map, align_size: int, capacity: int):
        self.d, self.capacity = d, capacity
        e, c = d.num_experts, capacity
        rows = e * c
        self.exchange = Exchange(d.group, None, None, rows, rows)
        offsets = row_id_map.offsets.to(torch.int64)
        i = torch.arange(row_id_map.num_rows, device=offsets.device)
        expert = torch.searchsorted(offsets[1:], i, right=True).clamp(max=e - 1)
        pos = i - offsets[expert]
        used = (i < offsets[-1]) & (pos < c)
        self.slots = torch.where(used, expert * c + pos, rows)  # unused rows go to a dump slot

    def to_send(self, rows: torch.Tensor) -> torch.Tensor:
        buf = rows.new_zeros((self.exchange.send_rows + 1, *rows.shape[1:]))
        return buf.index_copy(0, self.slots, rows)[:-1]

    def from_send(self, buf: torch.Tensor) -> torch.Tensor:
        padded = torch.cat((buf, buf.new_zeros((1, *buf.shape[1:]))))
        return padded.index_select(0, self.slots)

    def _by_expert(self, t, ep, l):
        return t.view(ep, l, self.capacity, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    def sort(self, recv, recv_probs, recv_bytes):
        ep, l = self.d.ep_size, self.d.num_local_experts
        split_sizes = torch.full((l,), ep * self.capacity, dtype=torch.int64, device=recv.device)
        by_expert = [self._by_expert(t, ep, l) if t is not None else None for t in (recv, recv_probs, recv_bytes)]
        return by_expert[0], by_expert[1], split_sizes, by_expert[2]

    def unsort(self, y: torch.Tensor) -> torch.Tensor:
        ep, l = self.d.ep_size, self.d.num_local_experts
        return y.view(l, ep, self.capacity, y.shape[1]).transpose(0, 1).reshape(y.shape)


class ExpertParallelDispatcher:
    """Runs an MoE layer's experts split evenly over the ranks of `group` (used by `MoELayer(ep_group=)`).

    group: a torch.distributed process group (ep = its size); num_experts % ep must be 0.
    Rank r holds experts r*L .. r*L+L-1 (L = num_experts / ep) as its local experts 0..L-1.
    capacity_factor: None (dropless, default) or the router's capacity factor: fixed-capacity
    mode, see below.
    quantized: send tokens quantized when the active recipe's input format allows it.

    Dropless mode (default) syncs the host once per layer forward: after the per-expert counts
    are exchanged, the all-to-all split sizes are read on the host, so it is not CUDA-graph
    capturable. Fixed-capacity mode (capacity_factor set; the router drops copies beyond
    C = ceil(T*K*capacity_factor/E) per expert) sends static buffers of C rows (rounded up to the
    recipe's align_size) per (rank, expert), zero-padded: equal all-to-all splits, no host sync.
    It moves ep*L*C rows whatever the routing: more bytes, no waiting on the host.

    Quantized dispatch (default on): with a recipe whose input quantizer's rows stand alone
    (`Quantizer.quantize_for_dispatch`: FP8 current scaling, whose amax is then all-reduced
    over `group` so every rank uses one scale; FP8 1x128 blocks; MXFP8), tokens are quantized
    rowwise once before the all-to-all, the wire carries 1 byte per element plus the row scales,
    and FC1's forward GEMM multiplies the received codes as they are (no re-quantization).
    FC1's weight gradient quantizes its columnwise copy from the dequantized received rows (a
    second rounding the single-process layer does not have), and gradients travel back in the
    activations' precision. Other recipes (delayed scaling, NVFP4) and no recipe send the
    activations' dtype.

    After each forward, `last_stats` holds the bytes this rank sent in the dispatch (rows and
    probs) and combine all-to-alls, the rows sent and received and whether the dispatch was
    quantized; `last_exchange` the dispatch's `Exchange` (split sizes). Backward sends the
    same rows back in the activations' dtype.
    """

    def __init__(self, group, num_experts: int, top_k: int, capacity_factor: float | None = None,
                 quantized: bool = True):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("ep_group needs torch.distributed initialised (torch.distributed.init_process_group)")
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
        self.group = group
        self.ep_size, self.ep_rank = dist.get_world_size(group), dist.get_rank(group)
        if self.ep_rank < 0:
            raise ValueError("this rank is not a member of ep_group; build the layer on the group's ranks only")
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} must be divisible by the expert-parallel group size "
                             f"{self.ep_size}: every rank holds num_experts / ep_size experts")
        if not isinstance(quantized, bool):
            raise TypeError(f"quantized_dispatch must be True or False, got {quantized!r}")
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local_experts = num_experts // self.ep_size
        self.first_expert = self.ep_rank * self.num_local_experts
        self.capacity_factor, self.quantized = capacity_factor, quantized
        self._recipe, self._quantizer = None, None
        self._uniform_tokens: set[int] = set()
        self.last_stats: dict = {}
        self.last_exchange: Exchange | None = None

    def capacity(self, num_tokens: int, align_size: int, device) -> int:
        """Rows per (source rank, expert) in fixed-capacity mode: the router's bound, rounded to align_size.

        The buffers must be alike on every rank, so every rank must route the same number of
        tokens: checked once per token count (a host sync then, none afterwards, so warm-up
        steps before a CUDA-graph capture pay it).
        """
        if num_tokens not in self._uniform_tokens:
            t = torch.tensor([num_tokens, -num_tokens], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            most, neg_least = t.tolist()
            least = -neg_least
            if most != least:
                raise ValueError(f"fixed-capacity expert parallelism (capacity_factor={self.capacity_factor}) needs "
                                 f"the same token count on every rank of ep_group, got {least}..{most}; pad the "
                                 f"batches to one size or use the dropless mode (capacity_factor=None)")
            self._uniform_tokens.add(num_tokens)
        cap = math.ceil(num_tokens * self.top_k * self.capacity_factor / self.num_experts)
        cap = max(min(cap, num_tokens), 1)  # a token reaches an expert at most once
        return -(-cap // align_size) * align_size

    def _dispatch_quantizer(self):
        recipe = autocast_state().active_recipe
        if not self.quantized or recipe is None:
            return None
        if recipe != self._recipe or type(recipe) is not type(self._recipe):
            self._recipe, self._quantizer = recipe, recipe.quantizer("input")
        return self._quantizer

    def __call__(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, experts,
                 align_size: int) -> torch.Tensor:
        """tokens [T, H] float, probs [T, E] fp32, routing_map [T, E] bool (this rank's routing);
        experts: the local GroupedMLP (L experts). Returns [T, H] in tokens' dtype."""
        t, h = tokens.shape
        q = self._dispatch_quantizer()
        qt = q.quantize_for_dispatch(tokens, self.group) if q is not None else None
        packed = PackedRows(qt) if qt is not None else None
        source = tokens if packed is None else packed.pack(qt)
        send, send_probs, row_id_map, _ = ops.moe_permute(source, routing_map, probs, align_size=1, top_k=self.top_k)
        route = (_DroplessRoute(self, row_id_map, align_size) if self.capacity_factor is None
                 else _FixedCapacityRoute(self, row_id_map, align_size, self.capacity(t, align_size, tokens.device)))
        if packed is None:
            recv, recv_probs = AllToAll.apply(route.exchange, route.to_send(send), route.to_send(send_probs))
            recv_bytes = None
        else:
            def grad_to_tokens(grad_rows):  # the high-precision dispatch's adjoint
                return ops.moe_unpermute(route.from_send(grad_rows), row_id_map)

            recv, recv_probs, recv_bytes = _QuantizedDispatch.apply(
                tokens, route.to_send(send_probs), route.to_send(send), route.exchange, packed, grad_to_tokens)
        x, x_probs, split_sizes, x_bytes = route.sort(recv, recv_probs, recv_bytes)
        quantized_input = packed.unpack(x_bytes) if packed is not None else None
        y = experts(x, split_sizes, x_probs, quantized_input=quantized_input)
        (back,) = AllToAll.apply(route.exchange.reverse(), route.unsort(y))
        row_bytes = packed.row_bytes if packed is not None else h * tokens.element_size()
        sent = route.exchange.send_rows
        self.last_exchange = route.exchange
        self.last_stats = dict(quantized=packed is not None, dispatch_bytes=sent * (row_bytes + probs.element_size()),
                               combine_bytes=sent * h * y.element_size(), rows_sent=sent,
                               rows_received=route.exchange.recv_rows, row_bytes=row_bytes)
        return ops.moe_unpermute(route.from_send(back), row_id_map)

    def shard_state_dict(self, state_dict: dict, prefix: str = "") -> dict:
        """This rank's slice of a full MoELayer state_dict (all E experts): see `shard_expert_state_dict`."""
        return shard_expert_state_dict(state_dict, self.num_experts, self.ep_rank, self.ep_size, prefix)


def shard_expert_state_dict(state_dict: dict, num_experts: int, ep_rank: int, ep_size: int,
                            prefix: str = "") -> dict:
    """The expert-parallel rank's view of a full MoELayer state_dict, ready for its load_state_dict.

    Keys under `{prefix}experts.` keep their names: single-grouped tensors ([E, ...]) are sliced
    to this rank's [L, ...]; per-expert keys (`weight{g}`, `bias{g}`) of this rank's experts are
    renumbered 0..L-1 and the others dropped. Everything else (the router) is replicated as is.
    """
    local = num_experts // ep_size
    first = ep_rank * local
    out = {}
    for key, value in state_dict.items():
        if not key.startswith(prefix + "experts."):
            out[key] = value
            continue
        head, _, name = key.rpartition(".")
        base = name.rstrip("0123456789")
        if base != name:  # per-expert parameter
            g = int(name[len(base):])
            if first <= g < first + local:
                out[f"{head}.{base}{g - first}"] = value
        elif isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == num_experts:
            out[key] = value[first:first + local].clone()
        elif name == "_extra_state" and isinstance(value, dict):
            out[key] = _shard_recipe_state(value, num_experts, first, local)
        else:
            out[key] = value
    return out


def _shard_recipe_state(state: dict, num_experts: int, first: int, local: int) -> dict:
    """A grouped layer's recipe state (`RecipeState.state_dict`) cut to experts first..first+local-1:
    per-expert scales [E] and histories [L, E] are sliced along E."""
    def cut(t):
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == num_experts:
            return t[..., first:first + local].clone()
        return t

    return {**state, "recipes": [{**e, "quantizers": {role: {k: cut(v) for k, v in q.items()}
                                                        for role, q in e["quantizers"].items()}}
                                 for e in state.get("recipes", [])]}


register_expert_parallel_dispatcher(ExpertParallelDispatcher)
