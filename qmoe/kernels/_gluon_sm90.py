"""What qmoe's Gluon kernels for sm90 share (private helper of `_block_gemm_ws.py`,
`_block_wgrad_ws.py`, `_tensor_gemm_ws.py` and `_cast_transpose_gl.py`): Gluon's Hopper API,
imported only where this Triton has it, the TMA copies under either Triton's names, the GEMMs'
stage-ring barriers, tensor descriptors (and the scratch
memory of those a kernel makes on the device), shared-memory bounds, whether a Gluon kernel can
run on a device, and the fallback to a Triton kernel when a Gluon compile fails.

Nothing here picks a kernel: each kernel module decides which calls it takes and falls back to
its Triton kernel through `gluon_unavailable` and `launch_once`.
"""
from __future__ import annotations

try:  # Gluon ships with triton >= 3.5; qmoe never needs it (the Triton kernels are the fallback)
    # the kernel modules import Gluon's names from here: one guard for all of them
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except (ImportError, AttributeError):  # pragma: no cover - older triton
    gluon = None

import contextvars
import functools
import os
import warnings

import torch

from qmoe.contracts.validate import cuda_index

from qmoe.kernels._launch import faking
from qmoe.kernels._layout import gemm_steps_major
from qmoe.kernels._transpose import transpose_into

GLUON_ERROR = None if gluon is not None else "triton.experimental.gluon is not available in this triton"
BLOCK_GEMM_SWITCH = "QMOE_BLOCK_GEMM"  # "triton" turns the Gluon FP8 block GEMMs (m- and k-grouped) off
TENSOR_GEMM_SWITCH = "QMOE_TENSOR_GEMM"  # "triton" turns the Gluon FP8 tensor-scaled GEMMs off
# sm90's shared memory per block (227 KiB) and what a kernel keeps besides its buffers (barriers)
SMEM_BYTES = 232448
SMEM_SPARE = 1024

if gluon is not None:  # names that moved between triton 3.6 (the GPU image's) and 3.9
    tma_load = getattr(tma, "async_load", tma.async_copy_global_to_shared)
    tma_store = getattr(tma, "async_store", tma.async_copy_shared_to_global)
    thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # 3.9: gl.barrier
    cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared  # 3.9: async_load

    if hasattr(gl.shared_memory_descriptor, "reinterpret"):
        @gluon.jit
        def reinterpret(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
            """smem viewed as `dtype` values of `shape` in `layout` (the same bytes)."""
            return smem.reinterpret(dtype, shape, layout)
    else:  # triton 3.6 names it _reinterpret
        @gluon.jit
        def reinterpret(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
            """smem viewed as `dtype` values of `shape` in `layout` (the same bytes)."""
            return smem._reinterpret(dtype, shape, layout)

    @gluon.jit
    def stage_barriers(STAGES: gl.constexpr):
        """The stage ring's barriers, initialised: `full` (a stage's TMA loads landed: the
        producer's one arrival and the bytes it expects) and `empty` (both consumer warpgroups
        released it)."""
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        return full, empty

    @gluon.jit
    def add(a, b):
        """The combine function of prefix sums (gl.associative_scan)."""
        return a + b


_GL_DTYPES = {}


def _gl_dtype(dtype: torch.dtype):
    if not _GL_DTYPES:
        _GL_DTYPES.update({torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5,
                           torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32})
    return _GL_DTYPES[dtype]


def desc(t: torch.Tensor, block: list[int]):
    """TMA descriptor of `t` in boxes of `block`, in the default MMA-ready shared layout."""
    layout = gl.NVMMASharedLayout.get_default_for(block, _gl_dtype(t.dtype))
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def steps_major_scales(scale: torch.Tensor, box: int = 128):
    """[rows, steps] fp32 scales as a [steps, rows] view of a copy whose rows are padded to 16 bytes,
    and its TMA descriptor in boxes of one step's `box` rows (rows past the end read as zeros): a
    step's scales become one contiguous box instead of a cache line per value. Scales the cast
    stored that way already (`_layout.steps_major`) are taken as they are."""
    view = gemm_steps_major(scale) if scale.dtype == torch.float32 else None
    if view is not None:
        return view, scale_rows_desc(view, box)
    rows, steps = scale.shape
    padded = torch.empty((steps, -(-rows // 4) * 4), dtype=torch.float32, device=scale.device)
    view = padded[:, :rows]
    if scale.is_cuda and scale.stride(-1) == 1:  # torch's copy_ from a transposed view reads a line per scale
        transpose_into(view, scale)
    else:
        view.copy_(scale.t())
    return view, scale_rows_desc(view, box)


def scale_rows_desc(steps_major: torch.Tensor, box: int = 128):
    """TMA descriptor of [steps, rows] fp32 scales (16-byte row stride): boxes of one step's `box` rows."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(steps_major, list(steps_major.shape), list(steps_major.stride()), [1, box], layout)


def stand_in_scale_desc(like: torch.Tensor, box: int = 128):
    """A scale_rows_desc for a kernel compiled without streamed scales, which never reads it."""
    return scale_rows_desc(like.new_empty((1, box), dtype=torch.float32), box)


def with_scratch(device: torch.device, launch):
    """launch()'s result, with Triton's allocator for the global scratch of kernels that make TMA
    descriptors on the device: torch's caching allocator (stream-ordered, so CUDA-graph capturable),
    set in a copy of the caller's context, so an allocator the caller set stays untouched."""
    import triton

    def run():
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))
        return launch()

    return contextvars.copy_context().run(run)


@functools.lru_cache(maxsize=None)
def is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def tma_aligned(t: torch.Tensor, base: bool = True) -> bool:
    """TMA: a 16-byte aligned base (unless `base` is False: not asked), unit last stride, 16-byte
    aligned row stride."""
    return (t.dim() == 2 and t.stride(1) == 1 and (not base or t.data_ptr() % 16 == 0)
            and (t.stride(0) * t.element_size()) % 16 == 0)


def gluon_unavailable(device: torch.device, switch: str | None = None, shapes_only: bool = False) -> str | None:
    """Why no sm90 Gluon kernel of qmoe runs on `device` now, whatever its operands (None: they
    can): the environment variable `switch` set to "triton", a fake-tensor pass (unless
    `shapes_only`: the question is what the real call will do), a Triton without Gluon, or not an
    sm90 GPU (TMA, warpgroup MMA)."""
    if switch is not None and os.environ.get(switch, "").strip().lower() == "triton":
        return f"{switch}=triton"
    if faking() and not shapes_only:
        return "a fake-tensor pass (shapes only)"
    if gluon is None:
        return GLUON_ERROR
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    if not is_sm90(cuda_index(device)):
        return "the kernel is written for sm90 (TMA, warpgroup MMA)"
    return None


def launch_once(failed: dict, key, what: str, launch):
    """launch()'s result, or None where a launch with this key failed to compile before or fails now
    (another Triton's Gluon; nothing was launched): the failure is recorded in `failed` and warned
    about once, and the caller runs its Triton kernel."""
    if key in failed:
        return None
    try:
        return launch()
    except Exception as err:  # noqa: BLE001 - a compile failure: the Triton kernel stands in
        failed[key] = f"{type(err).__name__}: {err}"
        warnings.warn(f"qmoe: the Gluon {what} did not compile ({failed[key][:300]}); using the Triton kernel",
                      RuntimeWarning, stacklevel=3)
        return None

