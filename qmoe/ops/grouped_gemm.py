"""The experts' grouped GEMMs: forward, dgrad and wgrad over GroupedTensors (NUMERICS.md contract).

Dimension legend: T tokens (rows of the packed activations), E experts (groups), N output
features, K input features. In NT form, every operand is quantized along the contraction:

    fprop  y  [T, N]    = m_grouped_gemm(x, W)                     x rowwise,  W rowwise
    dgrad  dx [T, K]    = m_grouped_gemm(dy, W, b_columnwise=True) dy rowwise, W columnwise
    wgrad  dW [E, N, K] = k_grouped_gemm(dy, x)                    dy, x columnwise

    >>> r = MXFP8BlockScaling()
    >>> x = GroupedTensor.quantize(torch.randn(96, 64), [32, 0, 64], r.quantizer("input"))
    >>> w = quantize_weights(torch.randn(3, 48, 64), r.quantizer("weight"))
    >>> m_grouped_gemm(x, w).shape            # bf16 [96, 48]
    torch.Size([96, 48])

Split sizes stay on the device in the grouped path: device tensors are trusted (rows past
their sum belong to no group and come out as zeros); host lists are checked. The kernels run
on sm90+ GPUs, the reference (qmoe/reference/grouped_gemm.py, the spec) elsewhere.
"""
from __future__ import annotations

import copy

import torch

from qmoe.backend import backend_override
from qmoe.contracts.enums import Scaling, scaling_of
from qmoe.contracts.errors import UnsupportedError
from qmoe.contracts.validate import OUT_DTYPES
from qmoe.dispatch import GROUPED_GEMM
from qmoe.quant import GroupedTensor, QuantizedTensor, Quantizer

GROUPED_PATHS = ("auto", "grouped", "split")
_PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_weights(w: torch.Tensor, quantizer: Quantizer, rowwise: bool = True,
                     columnwise: bool = False) -> GroupedTensor:
    """Quantize a weight stack w [E, N, K] expert by expert: a GroupedTensor of E groups of N rows.

    Every expert gets its own scales (per-tensor scale, amax, 2-D blocks never cross experts).
    rowwise holds W_g [N, K] (fprop); columnwise holds W_g^T [K, N] quantized along N (dgrad).
    """
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise ValueError(f"quantize_weights needs a weight stack [E, N, K], got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    e, n, k = w.shape
    if e == 0:
        raise ValueError("quantize_weights needs at least one expert (E >= 1)")
    splits = torch.full((e,), n, dtype=torch.int64, device=w.device)
    return GroupedTensor.quantize(w.reshape(e * n, k), splits, quantizer, rowwise=rowwise, columnwise=columnwise,
                                  validate=False)


# ---------------------------------------------------------------- validation

def host_readable(split_sizes: torch.Tensor) -> bool:
    """Whether split sizes can be checked on the host for free: CPU tensors, except while
    torch.compile traces (a read would break the graph; such sizes are trusted like device ones)."""
    return split_sizes.device.type == "cpu" and not torch.compiler.is_compiling()


def _check_out_dtype(out_dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")


def _check_host_splits(split_sizes, rows: int, groups: int, device: torch.device) -> None:
    """Split sizes for plain tensors: [groups] ints; host values are checked, device ones trusted."""
    if split_sizes is None:
        raise ValueError("plain (unquantized) tensors need split_sizes: [E] ints, one per expert")
    if isinstance(split_sizes, torch.Tensor):
        if split_sizes.dtype not in (torch.int32, torch.int64) or split_sizes.dim() != 1:
            raise TypeError(f"split_sizes must be a 1-D int32/int64 tensor, got {split_sizes.dtype} "
                            f"of shape {tuple(split_sizes.shape)}")
        if split_sizes.device.type != "cpu" and split_sizes.device != device:
            raise ValueError(f"split_sizes is on {split_sizes.device} but the operands are on {device}")
        n = split_sizes.numel()
        host = split_sizes.tolist() if host_readable(split_sizes) else None
    else:
        if not isinstance(split_sizes, (list, tuple)) or not all(
                isinstance(s, int) and not isinstance(s, bool) for s in split_sizes):
            raise TypeError(f"split_sizes must be a list of ints or an integer tensor, got {split_sizes!r}")
        n, host = len(split_sizes), list(split_sizes)
    if n != groups:
        raise ValueError(f"split_sizes has {n} entries but there are {groups} experts")
    if host is not None:
        if any(s < 0 for s in host):
            raise ValueError(f"split_sizes must be non-negative, got {host}")
        if sum(host) != rows:
            raise ValueError(f"split_sizes sum to {sum(host)} but the tokens operand has {rows} rows")


def _check_plain(t, name: str, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a GroupedTensor or a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _PLAIN_DTYPES:
        raise TypeError(f"{name} must be bf16, fp16 or fp32 when not quantized, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")


def _check_same_device(*tensors) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"operands are on different devices {sorted(map(str, devices))}; move them to one")


def _check_grouped_pair(a, b) -> Scaling:
    if not isinstance(a, GroupedTensor) or not isinstance(b, GroupedTensor):
        raise TypeError(f"pass two GroupedTensors or two plain tensors, got {type(a).__name__} and "
                        f"{type(b).__name__}")
    sa, sb = scaling_of(a), scaling_of(b)
    if sa is not sb:
        raise ValueError(f"operands were quantized by different recipes ({sa.value} and {sb.value}); quantize both "
                         f"with one recipe's quantizers")
    if a.num_groups != b.num_groups:
        raise ValueError(f"operands have {a.num_groups} and {b.num_groups} groups; they must both have one per expert")
    _check_same_device(a.split_sizes, b.split_sizes)
    if sa is Scaling.BLOCK and (a.quantizer.block[1] != 128 or b.quantizer.block[1] != 128):
        raise ValueError("FP8 block grouped GEMMs need 128-value blocks along the contraction (1x128 / 128x128)")
    return sa


def _tensors(gt, columnwise: bool):
    return [t for t in ((gt.columnwise_data, gt.columnwise_scale_inv) if columnwise
                        else (gt.rowwise_data, gt.rowwise_scale_inv)) if t is not None]


# ---------------------------------------------------------------- the ops

def m_grouped_gemm(a, b, split_sizes=None, *, b_columnwise: bool = False, out_dtype=torch.bfloat16) -> torch.Tensor:
    """Tokens grouped along M: out[rows of g] = dequant(a_g) @ dequant(b_g)^T, fprop and dgrad.

    a: GroupedTensor with rowwise data [T, K] (x for fprop, dy [T, N] for dgrad), or a plain
       [T, K] bf16/fp16/fp32 tensor with `split_sizes`.
    b: the weights: `quantize_weights(w [E, N, K], ...)`, or a plain [E, N, K] tensor;
       b_columnwise=True multiplies by W_g (dgrad) using the columnwise copy.
    split_sizes: [E] ints or int tensor, for plain tensors only.
    out_dtype: bf16 (default), fp16 or fp32. Returns [T, N] (fprop) or [T, K] (dgrad).
    """
    _check_out_dtype(out_dtype)
    if isinstance(a, GroupedTensor) or isinstance(b, GroupedTensor):
        scaling = _check_grouped_pair(a, b)
        if a.rowwise_data is None:
            raise ValueError("m_grouped_gemm reads a's rowwise data: quantize it with rowwise=True")
        if a.quantizer.block is not None and a.quantizer.block[0] != 1:
            raise ValueError(f"a is quantized with {a.quantizer.block[0]}x{a.quantizer.block[1]} blocks (a weight "
                             f"quantizer); quantize tokens with the recipe's input or grad_output quantizer")
        if (b.columnwise_data if b_columnwise else b.rowwise_data) is None:
            which = "columnwise" if b_columnwise else "rowwise"
            raise ValueError(f"b has no {which} data: quantize_weights(..., {which}=True)")
        e = b.num_groups
        if b.shape[0] % e:
            raise ValueError(f"b has {b.shape[0]} rows for {e} experts: build it with quantize_weights")
        n_w, k_w = b.shape[0] // e, b.shape[1]
        contraction = n_w if b_columnwise else k_w
        if a.shape[1] != contraction:
            raise ValueError(f"a has {a.shape[1]} features but b's {'N' if b_columnwise else 'K'} is {contraction}")
        if scaling is Scaling.NVFP4 and b_columnwise and n_w % 2:
            raise ValueError(f"NVFP4 dgrad reads packed columnwise weights: N={n_w} must be even")
        if host_readable(b.split_sizes) and any(s != n_w for s in b.split_sizes.tolist()):
            raise ValueError("b must hold N rows per expert: build it with quantize_weights")
        tensors = _tensors(a, False) + _tensors(b, b_columnwise)
        _check_same_device(*tensors)
        fn = GROUPED_GEMM.pick("m_grouped_gemm", *tensors)
        return fn(a, b, None, b_columnwise=b_columnwise, out_dtype=out_dtype)
    _check_plain(a, "a", 2)
    _check_plain(b, "b", 3)
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")
    _check_same_device(a, b)
    contraction = b.shape[1] if b_columnwise else b.shape[2]
    if a.shape[1] != contraction:
        raise ValueError(f"a has {a.shape[1]} features but b contracts over {contraction}")
    _check_host_splits(split_sizes, a.shape[0], b.shape[0], a.device)
    fn = GROUPED_GEMM.pick("m_grouped_gemm", a, b)
    return fn(a, b, split_sizes, b_columnwise=b_columnwise, out_dtype=out_dtype)


def k_grouped_gemm(a, b, split_sizes=None, *, out_dtype=torch.bfloat16, out: torch.Tensor | None = None,
                   accumulate: bool = False) -> torch.Tensor:
    """Grouped along the tokens: dW[g] = dequant(dy_g)^T @ dequant(x_g) -> [E, N, K] (wgrad).

    a: dy, a GroupedTensor with columnwise data, or a plain [T, N] tensor.
    b: x, a GroupedTensor with columnwise data and the same split sizes, or a plain [T, K].
    out: optional [E, N, K] output; accumulate=True adds into it (fp32 `main_grad`), summing
       in fp32. Experts without tokens get exact zeros (accumulating: out is left as it was).
    """
    if out is None:
        _check_out_dtype(out_dtype)
    elif not isinstance(out, torch.Tensor) or out.dtype not in OUT_DTYPES:
        raise TypeError(f"out must be a bf16, fp16 or fp32 tensor, got {getattr(out, 'dtype', type(out).__name__)}")
    if accumulate and out is None:
        raise ValueError("accumulate=True adds into `out`: pass out=[E, N, K] (e.g. the fp32 main_grad)")
    if isinstance(a, GroupedTensor) or isinstance(b, GroupedTensor):
        _check_grouped_pair(a, b)
        if a.columnwise_data is None or b.columnwise_data is None:
            raise ValueError("k_grouped_gemm reads columnwise data: quantize dy and x with columnwise=True")
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"dy has {a.shape[0]} rows but x has {b.shape[0]}: both must hold the same tokens")
        e, n, k = a.num_groups, a.shape[1], b.shape[1]
        tensors = _tensors(a, True) + _tensors(b, True)
    else:
        _check_plain(a, "a", 2)
        _check_plain(b, "b", 2)
        if a.dtype != b.dtype:
            raise TypeError(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"dy has {a.shape[0]} rows but x has {b.shape[0]}: both must hold the same tokens")
        e = split_sizes.numel() if isinstance(split_sizes, torch.Tensor) else len(split_sizes or ())
        _check_host_splits(split_sizes, a.shape[0], e, a.device)
        n, k = a.shape[1], b.shape[1]
        tensors = [a, b]
    if out is not None:
        if tuple(out.shape) != (e, n, k):
            raise ValueError(f"out must have shape [E, N, K] = {(e, n, k)}, got {tuple(out.shape)}")
        tensors.append(out)
    _check_same_device(*tensors)
    fn = GROUPED_GEMM.pick("k_grouped_gemm", *tensors)
    return fn(a, b, split_sizes, out_dtype=out_dtype, out=out, accumulate=accumulate)


# ---------------------------------------------------------------- grouped vs split path

def select_grouped_path(grouped_path: str, device) -> str:
    """Resolve "auto" | "grouped" | "split" for a device to "grouped" or "split".

    grouped: one quantize and one GEMM launch for all experts, split sizes on the device
    (Triton kernels on sm90+; on the CPU the reference computes the same thing). CUDA GPUs
    below sm90 have no grouped kernels: "auto" falls back to "split" there and "grouped" raises.
    """
    if grouped_path not in GROUPED_PATHS:
        raise ValueError(f"grouped_path must be one of {', '.join(GROUPED_PATHS)}, got {grouped_path!r}")
    device = torch.device(device)
    supported = (device.type != "cuda" or backend_override() == "reference"
                 or torch.cuda.get_device_capability(device) >= (9, 0))
    if grouped_path == "grouped" and not supported:
        raise UnsupportedError("the grouped GEMM path", device=device,
                               why="qmoe's grouped kernels need a GPU of compute capability 9.0 or newer",
                               fix='grouped_path="split" (or "auto"), or QMOE_BACKEND=reference')
    if grouped_path == "auto":
        return "grouped" if supported else "split"
    return grouped_path


def _host_sizes(split_sizes) -> list[int]:
    return [int(s) for s in (split_sizes.tolist() if isinstance(split_sizes, torch.Tensor) else split_sizes)]


def _group_quantizer(quantizer: Quantizer, g: int, num_groups: int, device) -> Quantizer:
    """The quantizer for group g alone: stateful (delayed-scaling) quantizers read and record
    group g's slot of the same per-group history the grouped path uses; others are shared."""
    state = getattr(quantizer, "state", None)
    if state is None or not hasattr(state, "slot"):
        return quantizer
    state.ensure(device, num_groups)
    q = copy.copy(quantizer)
    q.state = state.slot(g, num_groups)
    return q


def _one_group(qt: QuantizedTensor) -> GroupedTensor:
    """A QuantizedTensor as a one-group GroupedTensor (same data; per-tensor values as [1])."""
    def one(t):
        return t.reshape(1) if t is not None and t.dim() == 0 else t

    m = qt.shape_2d[0]
    return GroupedTensor(qt.quantizer, torch.Size(qt.shape_2d), qt.dtype, torch.tensor([m], device=qt.device),
                         rowwise_data=qt.rowwise_data, rowwise_scale_inv=one(qt.rowwise_scale_inv),
                         columnwise_data=qt.columnwise_data, columnwise_scale_inv=one(qt.columnwise_scale_inv),
                         amax=one(qt.amax), columnwise_amax=one(qt.columnwise_amax))


def linear_m_grouped(x: torch.Tensor, split_sizes, w: torch.Tensor, x_quantizer: Quantizer, w_quantizer: Quantizer,
                     *, b_columnwise: bool = False, out_dtype=torch.bfloat16, grouped_path: str = "auto"):
    """Quantize x [T, K] and w [E, N, K] with the recipe's quantizers, then m_grouped_gemm.

    grouped: one GroupedTensor each, split sizes may stay on the device. split: split sizes
    read on the host, every expert quantized and multiplied on its own (the cross-check, and
    what runs where grouped kernels do not). dgrad passes dy as x and b_columnwise=True.
    """
    path = select_grouped_path(grouped_path, x.device)
    if path == "grouped":
        xq = GroupedTensor.quantize(x, split_sizes, x_quantizer, rowwise=True, columnwise=False)
        wq = quantize_weights(w, w_quantizer, rowwise=not b_columnwise, columnwise=b_columnwise)
        return m_grouped_gemm(xq, wq, b_columnwise=b_columnwise, out_dtype=out_dtype)
    sizes = _host_sizes(split_sizes)
    e = w.shape[0]
    _check_host_splits(sizes, x.shape[0], e, x.device)
    n_out = w.shape[2] if b_columnwise else w.shape[1]
    parts, start = [], 0
    for g, m in enumerate(sizes):
        wg = _group_quantizer(w_quantizer, g, e, w.device).quantize(w[g], rowwise=not b_columnwise,
                                                                     columnwise=b_columnwise)
        if m == 0:
            parts.append(x.new_zeros((0, n_out), dtype=out_dtype))
            continue
        xg = _group_quantizer(x_quantizer, g, e, x.device).quantize(x[start:start + m], rowwise=True,
                                                                     columnwise=False)
        parts.append(m_grouped_gemm(_one_group(xg), _one_group(wg), b_columnwise=b_columnwise, out_dtype=out_dtype))
        start += m
    return torch.cat(parts, 0)


def linear_k_grouped(dy: torch.Tensor, x: torch.Tensor, split_sizes, dy_quantizer: Quantizer,
                     x_quantizer: Quantizer, *, out_dtype=torch.bfloat16, out: torch.Tensor | None = None,
                     accumulate: bool = False, grouped_path: str = "auto"):
    """Quantize dy [T, N] and x [T, K] columnwise, then k_grouped_gemm -> dW [E, N, K] (see above)."""
    path = select_grouped_path(grouped_path, x.device)
    if path == "grouped":
        dyq = GroupedTensor.quantize(dy, split_sizes, dy_quantizer, rowwise=False, columnwise=True)
        xq = GroupedTensor.quantize(x, split_sizes, x_quantizer, rowwise=False, columnwise=True)
        return k_grouped_gemm(dyq, xq, out_dtype=out_dtype, out=out, accumulate=accumulate)
    sizes = _host_sizes(split_sizes)
    e, n, k = len(sizes), dy.shape[1], x.shape[1]
    _check_host_splits(sizes, x.shape[0], e, x.device)
    if accumulate and out is None:
        raise ValueError("accumulate=True adds into `out`: pass out=[E, N, K] (e.g. the fp32 main_grad)")
    res = out if out is not None else torch.empty((e, n, k), dtype=out_dtype, device=x.device)
    start = 0
    for g, m in enumerate(sizes):
        if m == 0:
            if not accumulate:
                res[g].zero_()
            continue
        dyg = _group_quantizer(dy_quantizer, g, e, dy.device).quantize(dy[start:start + m], rowwise=False,
                                                                        columnwise=True)
        xg = _group_quantizer(x_quantizer, g, e, x.device).quantize(x[start:start + m], rowwise=False,
                                                                     columnwise=True)
        k_grouped_gemm(_one_group(dyg), _one_group(xg), out=res[g:g + 1], accumulate=accumulate)
        start += m
    return res
