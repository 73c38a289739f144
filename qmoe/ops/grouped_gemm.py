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

import torch

from qmoe.backend import backend_override
from qmoe.contracts.enums import GroupedPath, Scaling, parse_grouped_path, scaling_of
from qmoe.contracts.errors import UnsupportedError
from qmoe.contracts.scales import gemm_scale
from qmoe.contracts.validate import OUT_DTYPES, check_out_dtype, check_split_sizes, host_readable
from qmoe.dispatch import GROUPED_GEMM
from qmoe.quant import GroupedTensor, Quantizer

_PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_weights(w: torch.Tensor, quantizer: Quantizer, rowwise: bool = True,
                     columnwise: bool = False, values: tuple = ()) -> GroupedTensor:
    """Quantize a weight stack w [E, N, K] expert by expert: a GroupedTensor of E groups of N rows.

    Every expert gets its own scales (per-tensor scale, amax, 2-D blocks never cross experts).
    rowwise holds W_g [N, K] (fprop); columnwise holds W_g^T [K, N] quantized along N (dgrad).
    values: copies wanted as exact bf16 values (`GroupedTensor.quantize`).
    """
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise ValueError(f"quantize_weights needs a weight stack [E, N, K], got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    e, n, k = w.shape
    if e == 0:
        raise ValueError("quantize_weights needs at least one expert (E >= 1)")
    splits = torch.full((e,), n, dtype=torch.int64, device=w.device)
    return GroupedTensor.quantize(w.reshape(e * n, k), splits, quantizer, rowwise=rowwise, columnwise=columnwise,
                                  validate=False, values=values)


# ---------------------------------------------------------------- validation

def _check_plain_splits(split_sizes, rows: int, groups: int, device: torch.device) -> None:
    """Split sizes for plain tensors: [groups] ints; host values are checked, device ones trusted."""
    if split_sizes is None:
        raise ValueError("plain (unquantized) tensors need split_sizes: [E] ints, one per expert")
    check_split_sizes(split_sizes, device=device, num_rows=rows, num_groups=groups)


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
    held = gt.exact_values(columnwise)
    if held is not None:
        return [held]
    return [t for t in (gt.columnwise_data if columnwise else gt.rowwise_data, gemm_scale(gt, columnwise))
            if t is not None]


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
    check_out_dtype(out_dtype)
    if isinstance(a, GroupedTensor) or isinstance(b, GroupedTensor):
        scaling = _check_grouped_pair(a, b)
        if not a.has_copy(False):
            raise ValueError("m_grouped_gemm reads a's rowwise data: quantize it with rowwise=True")
        if a.quantizer.block is not None and a.quantizer.block[0] != 1:
            raise ValueError(f"a is quantized with {a.quantizer.block[0]}x{a.quantizer.block[1]} blocks (a weight "
                             f"quantizer); quantize tokens with the recipe's input or grad_output quantizer")
        if not b.has_copy(b_columnwise):
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
    _check_plain_splits(split_sizes, a.shape[0], b.shape[0], a.device)
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
        check_out_dtype(out_dtype)
    elif not isinstance(out, torch.Tensor) or out.dtype not in OUT_DTYPES:
        raise TypeError(f"out must be a bf16, fp16 or fp32 tensor, got {getattr(out, 'dtype', type(out).__name__)}")
    if accumulate and out is None:
        raise ValueError("accumulate=True adds into `out`: pass out=[E, N, K] (e.g. the fp32 main_grad)")
    if isinstance(a, GroupedTensor) or isinstance(b, GroupedTensor):
        _check_grouped_pair(a, b)
        if not (a.has_copy(True) and b.has_copy(True)):
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
        _check_plain_splits(split_sizes, a.shape[0], e, a.device)
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

def select_grouped_path(grouped_path: GroupedPath | str, device) -> GroupedPath:
    """Resolve "auto" | "grouped" | "split" for a device to GroupedPath.GROUPED or .SPLIT.

    grouped: one quantize and one GEMM launch for all experts, split sizes on the device
    (Triton kernels on sm90+; on the CPU the reference computes the same thing). CUDA GPUs
    below sm90 have no grouped kernels: "auto" falls back to "split" there and "grouped" raises.
    """
    grouped_path = parse_grouped_path(grouped_path)
    device = torch.device(device)
    supported = (device.type != "cuda" or backend_override() == "reference"
                 or torch.cuda.get_device_capability(device) >= (9, 0))
    if grouped_path is GroupedPath.GROUPED and not supported:
        raise UnsupportedError("the grouped GEMM path", device=device,
                               why="qmoe's grouped kernels need a GPU of compute capability 9.0 or newer",
                               fix='grouped_path="split" (or "auto"), or QMOE_BACKEND=reference')
    if grouped_path is GroupedPath.AUTO:
        return GroupedPath.GROUPED if supported else GroupedPath.SPLIT
    return grouped_path
