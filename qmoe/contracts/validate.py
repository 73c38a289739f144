"""One validator per concept, shared by the public ops, the kernels and their reference twins.

Validators check types, shapes and devices before any work runs and raise TypeError /
ValueError naming the argument. They never read tensor values from a device (no host sync),
except `check_split_sizes(..., read="always")`, which says so.
"""
from __future__ import annotations

import math

import torch

from qmoe.contracts.carriers import is_glu
from qmoe.contracts.enums import ScoreFunction, parse_activation, parse_score_function

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what a grouped GEMM may write


# ---------------------------------------------------------------- numbers

def check_positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


def check_coeff(coeff, name: str = "coeff") -> None:
    """A loss coefficient: a finite Python number (a tensor would be read on the host)."""
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not math.isfinite(coeff):
        raise TypeError(f"{name} must be a finite Python number, got {coeff!r}")


def check_out_dtype(out_dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")


def check_size(name: str, v, owner: str = "") -> None:
    """A positive int size (hidden_size, num_experts, ...): ValueError naming `owner name`."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{owner + ' ' if owner else ''}{name} must be a positive integer, got {v!r}")


def check_flag(name: str, v, owner: str = "") -> None:
    """A bool option: a string such as 'no' is truthy, so anything but True/False is refused."""
    if not isinstance(v, bool):
        raise TypeError(f"{owner + ' ' if owner else ''}{name} must be True or False, got {v!r}")


def check_number(name: str, v, owner: str = "", *, minimum: float = 0.0, positive: bool = False) -> None:
    """A finite Python number >= minimum (> minimum with positive=True), not a bool, NaN or inf."""
    what = f"{owner + ' ' if owner else ''}{name}"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{what} must be a Python number, got {type(v).__name__} {v!r}")
    if not math.isfinite(v) or v < minimum or (positive and v == minimum):
        bound = f"> {minimum:g}" if positive else f">= {minimum:g}"
        raise ValueError(f"{what} must be a finite number {bound}, got {v!r}")


PARAMS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_params_dtype(params_dtype, owner: str = "") -> None:
    """None (torch's default dtype) or a floating dtype parameters can be trained in."""
    if params_dtype is not None and params_dtype not in PARAMS_DTYPES:
        raise TypeError(f"{owner + ' ' if owner else ''}params_dtype must be None, torch.float32, torch.bfloat16 "
                        f"or torch.float16, got {params_dtype!r}")


def check_layer_input(owner: str, x, width: int, layout: str = "[..., H]", float64: bool = False) -> None:
    """A module's activation input: a float32/bfloat16/float16 tensor whose last dimension is `width`
    (`layout` "[R, K]" also asks for 2-D); TypeError for the type or dtype, ValueError for the shape.
    float64: the module's weights are float64 (cast with `.double()`), so float64 inputs are its own."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{owner} input x must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dtype not in PARAMS_DTYPES and not (float64 and x.dtype == torch.float64):
        raise TypeError(f"{owner} input x must be float32, bfloat16 or float16 (float64 once the module is cast "
                        f"with .double()), got {x.dtype}")
    if x.dim() < 1 or (layout.count(",") == 1 and "..." not in layout and x.dim() != 2) or x.shape[-1] != width:
        raise ValueError(f"{owner} expects x {layout} with last dimension {width}, got shape {tuple(x.shape)}")


def check_dequantize_dtype(dtype) -> None:
    """The dtype `dequantize` returns: a floating dtype (an int would truncate the values)."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dequantize dtype must be torch.float32, torch.bfloat16, torch.float16 or "
                        f"torch.float64, got {dtype!r}")


def check_device(device, name: str = "device") -> torch.device | None:
    """None or something torch.device accepts ('cpu', 'cuda:0', a torch.device); the parsed device."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device, int)) or isinstance(device, bool):
        raise TypeError(f"{name} must be None, a string such as 'cpu' or 'cuda:0', or a torch.device, got "
                        f"{type(device).__name__} {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{name}={device!r} is not a device torch knows ({e})") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"{name}={device!r}: no such CUDA device here ({torch.cuda.device_count()} visible)")
    return dev


def cuda_index(device: torch.device) -> int:
    """The index of the CUDA device `device` names: an index-less "cuda" (as torch.Generator and
    tensors made on "cuda" may report it) is the current device."""
    return device.index if device.index is not None else torch.cuda.current_device()


def check_process_group(name: str, group) -> None:
    """None or a torch.distributed process group."""
    if group is None:
        return
    import torch.distributed as dist

    if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be None or a torch.distributed process group (dist.new_group(...)), got "
                        f"{type(group).__name__} {group!r}")


# ---------------------------------------------------------------- split sizes

def host_readable(split_sizes) -> bool:
    """Whether split sizes can be read on the host for free: lists and CPU tensors, except while
    torch.compile traces (a read would break the graph; such sizes are trusted like device ones)."""
    if not isinstance(split_sizes, torch.Tensor):
        return True
    return split_sizes.device.type == "cpu" and not torch.compiler.is_compiling()


def check_split_sizes(split_sizes, *, device: torch.device, num_rows: int | None = None,
                      num_groups: int | None = None, read: str = "host", on_device: bool = False,
                      max_rows: bool = False) -> list[int] | None:
    """The one check of split sizes (rows per group), for every op that takes them.

    split_sizes: a non-empty 1-D int32/int64 tensor, on the CPU or on `device` (exactly on
    `device` with `on_device=True`), or (unless `on_device`) a list/tuple of Python ints.
    num_groups: the number of entries it must have, if known.
    read: when the values are read and checked (non-negative, sum == num_rows; <= num_rows with
    `max_rows`, for static buffers whose tail rows belong to no group): "host" reads lists and
    host-readable tensors (`host_readable`) and trusts device tensors; "always" also reads device
    tensors (a host sync); "never" checks the type and shape only.

    Returns the values when they were read, else None.
    """
    if read not in ("host", "always", "never"):
        raise ValueError(f"read={read!r} must be 'host', 'always' or 'never'")
    if isinstance(split_sizes, (list, tuple)) and not on_device:
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in split_sizes):
            raise TypeError(f"split_sizes must hold Python ints, got {split_sizes!r}")
        n = len(split_sizes)
    elif isinstance(split_sizes, torch.Tensor):
        if split_sizes.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"split_sizes must have dtype int32 or int64, got {split_sizes.dtype}")
        if split_sizes.dim() != 1:
            raise ValueError(f"split_sizes must be a 1-D tensor [G], got shape {tuple(split_sizes.shape)}")
        device = torch.device(device)
        if on_device and split_sizes.device != device:
            raise ValueError(f"split_sizes is on {split_sizes.device} but the input is on {device}; "
                             f"keep them on the same device")
        if split_sizes.device.type != "cpu" and split_sizes.device != device:
            raise ValueError(f"split_sizes is on {split_sizes.device} but the input is on {device}; "
                             f"keep them on the same device")
        n = split_sizes.numel()
    else:
        what = "an int32/int64 tensor [G] on the input's device" if on_device else \
            "a list of ints or an integer tensor"
        raise TypeError(f"split_sizes must be {what}, got {type(split_sizes).__name__}")
    if n == 0:
        raise ValueError("split_sizes must be non-empty: one entry per group")
    if num_groups is not None and n != num_groups:
        raise ValueError(f"split_sizes has {n} entries but there are {num_groups} groups (experts); "
                         f"it must have shape [{num_groups}]")
    if read == "never" or (read == "host" and not host_readable(split_sizes)):
        return None
    host = [int(s) for s in (split_sizes.tolist() if isinstance(split_sizes, torch.Tensor) else split_sizes)]
    if any(s < 0 for s in host):
        raise ValueError(f"split_sizes must be non-negative, got {host}")
    if num_rows is not None:
        total = sum(host)
        if max_rows and total > num_rows:
            raise ValueError(f"split_sizes sum to {total}, more than the {num_rows} rows of the input")
        if not max_rows and total != num_rows:
            raise ValueError(f"split_sizes sum to {total} but the input has {num_rows} rows")
    return host


# ---------------------------------------------------------------- activation

def check_activation(activation) -> str:
    """The activation's name, checked against `Activation` (a plain str, whatever was passed)."""
    return parse_activation(activation).value


def check_scaled_activation_args(h, probs, activation, glu_interleave_size, da=None) -> int:
    """Validate the arguments of a scaled activation (forward, or backward with `da`); returns F."""
    check_activation(activation)
    if not isinstance(h, torch.Tensor) or h.dtype not in FLOAT_DTYPES:
        raise TypeError(f"h must be a float32, bfloat16, float16 or float64 tensor, got "
                        f"{getattr(h, 'dtype', type(h).__name__)}")
    if h.dim() != 2:
        raise ValueError(f"h must be 2-D [R, 2F] (GLU) or [R, F], got shape {tuple(h.shape)}")
    rows, width = h.shape
    glu = is_glu(activation)
    if glu and width % 2:
        raise ValueError(f"{activation} takes h [R, 2F] (gate and linear halves), got an odd width {width}")
    f = width // 2 if glu else width
    k = glu_interleave_size
    if glu and k is not None and k != 0:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0 or f % k:
            raise ValueError(f"glu_interleave_size={k!r} must be a positive divisor of the FFN size F={f}")
    for name, t, shape in (("probs", probs, (rows,)), ("da", da, (rows, f))):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} for h of shape {list(h.shape)} and "
                             f"activation {activation!r}, got {list(t.shape)}")
        if t.device != h.device:
            raise ValueError(f"{name} is on {t.device} but h is on {h.device}; put both on one device")
    return f


# ---------------------------------------------------------------- routing

def check_topk_route_args(logits, top_k, score_function, pre_softmax, num_groups, group_topk,
                          scaling_factor, expert_bias, group_score_topk=None,
                          normalize_topk_probs=None) -> ScoreFunction:
    """Validate `topk_route` arguments (shapes and dtypes only: never reads values)."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor [T, E], got "
                        f"{getattr(logits, 'dtype', type(logits).__name__)}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [T, E], got shape {tuple(logits.shape)}; "
                         "flatten leading dimensions with logits.reshape(-1, num_experts)")
    num_experts = logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    fn = parse_score_function(score_function)
    if pre_softmax and fn is not ScoreFunction.SOFTMAX:
        raise ValueError(f"pre_softmax=True only applies to score_function='softmax', got {fn.value!r}")
    if (num_groups is None) != (group_topk is None):
        raise ValueError("group-limited routing needs both num_groups and group_topk "
                         f"(got num_groups={num_groups!r}, group_topk={group_topk!r})")
    if num_groups is not None:
        if not isinstance(num_groups, int) or num_groups < 1 or num_experts % num_groups:
            raise ValueError(f"num_groups={num_groups!r} must be a positive int dividing "
                             f"num_experts={num_experts}")
        if not isinstance(group_topk, int) or not 1 <= group_topk <= num_groups:
            raise ValueError(f"group_topk={group_topk!r} must be an int in [1, num_groups={num_groups}]")
        per_group = num_experts // num_groups
        if group_score_topk is None and top_k % group_topk:
            raise ValueError(f"top_k={top_k} must be a multiple of group_topk={group_topk}: a group's "
                             "score is the sum of its top (top_k // group_topk) experts; or set "
                             "group_score_topk")
        if group_score_topk is not None and (isinstance(group_score_topk, bool) or not isinstance(
                group_score_topk, int) or not 1 <= group_score_topk <= per_group):
            raise ValueError(f"group_score_topk={group_score_topk!r} must be an int in [1, experts per "
                             f"group={per_group}] (or None for top_k // group_topk)")
        if group_topk * per_group < top_k:
            raise ValueError(f"group_topk={group_topk} groups of {per_group} experts "
                             f"hold fewer than top_k={top_k} experts; raise group_topk")
    elif group_score_topk is not None:
        raise ValueError(f"group_score_topk={group_score_topk!r} applies to group-limited routing only; "
                         "set num_groups and group_topk too, or leave it None")
    if normalize_topk_probs is not None and not isinstance(normalize_topk_probs, bool):
        raise TypeError(f"normalize_topk_probs must be True, False or None, got {normalize_topk_probs!r}")
    if normalize_topk_probs is False and fn is ScoreFunction.SOFTMAX and not pre_softmax:
        raise ValueError("normalize_topk_probs=False needs pre_softmax=True with score_function='softmax': "
                         "a softmax over the chosen experts sums to 1 by construction")
    if scaling_factor is not None:
        check_number("scaling_factor", scaling_factor, positive=True)
    if expert_bias is not None:
        if not isinstance(expert_bias, torch.Tensor) or not expert_bias.is_floating_point():
            raise TypeError("expert_bias must be a floating-point tensor [E] (fp32 recommended)")
        if tuple(expert_bias.shape) != (num_experts,):
            raise ValueError(f"expert_bias must have shape [E]=({num_experts},), got {tuple(expert_bias.shape)}")
        if expert_bias.device != logits.device:
            raise ValueError(f"expert_bias is on {expert_bias.device} but logits on {logits.device}; "
                             "move them to the same device")
    return fn


def resolve_normalize(fn: ScoreFunction, pre_softmax: bool, top_k: int, normalize_topk_probs) -> bool:
    """Whether the chosen experts' probabilities are divided by their sum (before scaling_factor).

    None keeps each score function's rule: softmax after top-k is normalised by construction
    (True), a full softmax before top-k is not, sigmoid and sqrtsoftplus are when top_k > 1.
    """
    if fn is ScoreFunction.SOFTMAX and not pre_softmax:
        return True
    if normalize_topk_probs is None:
        return fn is not ScoreFunction.SOFTMAX and top_k > 1
    return bool(normalize_topk_probs)


def group_score_count(top_k: int, group_topk: int | None, group_score_topk: int | None) -> int:
    """How many of a group's highest scores make its score: `group_score_topk`, or Megatron's
    top_k // group_topk when None (DeepSeek-V3 and Hugging Face use 2)."""
    if group_score_topk is not None:
        return group_score_topk
    return top_k // group_topk if group_topk else 1


def check_capacity_factor(capacity_factor) -> None:
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) \
            or not capacity_factor > 0 or not math.isfinite(capacity_factor):
        raise ValueError(f"capacity_factor must be a positive finite number (or None for dropless), "
                         f"got {capacity_factor!r}")


# ---------------------------------------------------------------- auxiliary losses

def check_scores(name: str, t, *, dims: int = 2) -> None:
    """A floating-point score tensor of `dims` dimensions ([T, E] by default)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D [T, E], got shape {tuple(t.shape)}")


def check_moe_aux_loss_args(probs, tokens_per_expert, num_tokens, num_experts, top_k, coeff) -> None:
    check_scores("probs", probs)
    if not isinstance(tokens_per_expert, torch.Tensor) or tuple(tokens_per_expert.shape) != (probs.shape[1],):
        raise ValueError(f"tokens_per_expert must be a tensor of shape [E]=({probs.shape[1]},), got "
                         f"{getattr(tokens_per_expert, 'shape', type(tokens_per_expert).__name__)}")
    if tokens_per_expert.device != probs.device:
        raise ValueError(f"tokens_per_expert is on {tokens_per_expert.device} but probs on {probs.device}")
    if isinstance(num_tokens, torch.Tensor):
        if num_tokens.dim() != 0 or num_tokens.device != probs.device:
            raise ValueError("num_tokens as a tensor must be 0-dim and on the device of probs, got "
                             f"shape {tuple(num_tokens.shape)} on {num_tokens.device}")
    elif not (num_tokens == 0 and probs.shape[0] == 0 and not isinstance(num_tokens, bool)):
        check_positive_int("num_tokens", num_tokens)  # 0 only for an empty batch, whose loss is 0
    check_positive_int("num_experts", num_experts)
    check_positive_int("top_k", top_k)
    check_coeff(coeff)


def check_seq_aux_loss_args(probs, routing_map, seq_length, top_k, coeff) -> None:
    check_scores("probs", probs)
    if not isinstance(routing_map, torch.Tensor) or routing_map.dtype != torch.bool:
        raise TypeError("routing_map must be a torch.bool tensor [T, E]")
    if routing_map.shape != probs.shape or routing_map.device != probs.device:
        raise ValueError(f"routing_map {tuple(routing_map.shape)} on {routing_map.device} must match "
                         f"probs {tuple(probs.shape)} on {probs.device}")
    check_positive_int("seq_length", seq_length)
    if probs.shape[0] % seq_length:
        raise ValueError(f"T={probs.shape[0]} tokens is not a whole number of sequences of "
                         f"seq_length={seq_length}; tokens must be laid out [B * L, E], batch-major")
    check_positive_int("top_k", top_k)
    check_coeff(coeff)


def check_update_expert_bias_args(bias, tokens_per_expert, rate) -> None:
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or bias.dim() != 1:
        raise TypeError("expert bias must be a 1-D floating-point tensor [E] (fp32 recommended)")
    if not isinstance(tokens_per_expert, torch.Tensor) or tokens_per_expert.shape != bias.shape:
        raise ValueError(f"tokens_per_expert must have the shape of the bias {tuple(bias.shape)}")
    if tokens_per_expert.device != bias.device:
        raise ValueError(f"tokens_per_expert is on {tokens_per_expert.device} but bias on {bias.device}")
    if not bias.is_contiguous():
        raise ValueError("expert bias must be contiguous: it is updated in place")
    check_coeff(rate, "rate")


# ---------------------------------------------------------------- permutation

def check_permute_index_args(routing_map, top_k, align_size) -> None:
    if not isinstance(routing_map, torch.Tensor) or routing_map.dtype != torch.bool or routing_map.dim() != 2:
        raise TypeError("routing_map must be a 2-D torch.bool tensor [T, E], got "
                        f"{getattr(routing_map, 'dtype', type(routing_map).__name__)} "
                        f"{tuple(getattr(routing_map, 'shape', ()))}")
    e = routing_map.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(f"top_k must be an int in [1, num_experts={e}], got {top_k!r}")
    if isinstance(align_size, bool) or not isinstance(align_size, int) or align_size < 1:
        raise ValueError(f"align_size must be a positive int (ask the recipe: recipe.align_size), "
                         f"got {align_size!r}")


def check_routing_top_k(routing_map, top_k) -> None:
    """No token chose more than top_k experts (R = T * top_k + ... holds every copy). Read only where
    the map is host-readable (`host_readable`); a device map is trusted, as device split sizes are."""
    if top_k is None or not host_readable(routing_map) or routing_map.numel() == 0:
        return
    most = int(routing_map.sum(dim=1).max())
    if most > top_k:
        raise ValueError(f"top_k={top_k} but a token of routing_map chose {most} experts; pass the top_k the "
                         f"map was routed with")


def check_rows(name: str, t, num_rows: int, device) -> None:
    """A per-row tensor [num_rows, N] (or [num_rows]) of any dtype, on `device`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() not in (1, 2) or t.shape[0] != num_rows:
        raise ValueError(f"{name} must be [{num_rows}, N] (one row per token/permuted row), "
                         f"got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the routing is on {device}; move it there")


def check_merging_probs(merging_probs, row_id_map) -> None:
    t = row_id_map.rows.shape[0]
    e = row_id_map.counts.shape[0]
    if not isinstance(merging_probs, torch.Tensor) or not merging_probs.is_floating_point():
        raise TypeError("merging_probs must be a floating-point tensor [T, E]")
    if tuple(merging_probs.shape) != (t, e) or merging_probs.device != row_id_map.rows.device:
        raise ValueError(f"merging_probs must be [T, E]=({t}, {e}) on {row_id_map.rows.device}, got "
                         f"{tuple(merging_probs.shape)} on {merging_probs.device}")


_AMAX_ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_amax_rows(name: str, t, option: str = "with_amax") -> None:
    """Rows whose producer also reduces their amax (`RowsWithAmax`), or that a quantizer reads as
    they are gathered (`option` "gather"): a 2-D bf16 / fp16 / fp32 tensor, the dtypes a quantizer
    reads (its amax is taken on those values, exactly)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in _AMAX_ROW_DTYPES:
        raise ValueError(f"{option} needs {name} as a 2-D float32, bfloat16 or float16 tensor, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} of shape {tuple(getattr(t, 'shape', ()))}")


def check_gather_index(index, source) -> None:
    """A `GatheredRows` index: int32 / int64 [R] on the source's device (values are trusted: reading
    them would sync with the host; `moe_permute(..., gather=True)` makes them in range)."""
    if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int32, torch.int64) or index.dim() != 1:
        raise ValueError(f"a GatheredRows index must be an int32 or int64 tensor [R], got "
                         f"{getattr(index, 'dtype', type(index).__name__)} {tuple(getattr(index, 'shape', ()))}")
    if index.device != source.device:
        raise ValueError(f"the GatheredRows index is on {index.device} but its source rows are on {source.device}")
    if source.dim() != 2:
        raise ValueError(f"GatheredRows' source must be 2-D [T, K], got shape {tuple(source.shape)}")


def check_group_amax(name: str, amax, num_groups: int, device) -> None:
    """A producer's per-group amax (`RowsWithAmax.amax`): fp32 [num_groups] on `device`."""
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32 or tuple(amax.shape) != (num_groups,):
        raise ValueError(f"{name} must be a float32 tensor [{num_groups}] (one amax per group), got "
                         f"{getattr(amax, 'dtype', type(amax).__name__)} {tuple(getattr(amax, 'shape', ()))}")
    if amax.device != device:
        raise ValueError(f"{name} is on {amax.device} but its rows are on {device}")
