"""How qmoe launches its Triton kernels.

- `KernelOp` / `kernel_op`: a kernel's launcher (validate, allocate, grid, launch) registered as
  an opaque torch custom op, so torch.compile and fake tensors see one op with known output
  shapes while eager calls on plain tensors skip the dispatcher.
- `wrapped`: what a launcher launches through, `kernel[grid](...)`; nothing while a KernelOp's
  fake twin computes output shapes.
- `num_sms`: the device's SM count (persistent grids), read once per device.
- `launch`, `tile_configs`, `prune_oversized`: the choice between the autotuned kernel (large
  problems) and one fixed config (small problems: no tuning runs, no host syncs), and the
  autotune config lists.
"""
from __future__ import annotations

import functools
import threading

import torch
import triton
from torch.utils._python_dispatch import _get_current_dispatch_mode

from qmoe.contracts.validate import cuda_index

# Problems below this many elements run one fixed config: tuning them costs more than it gains,
# and a tuning run synchronises the host (no CUDA graph capture, no sync-debug mode).
AUTOTUNE_MIN_ELEMENTS = 1 << 22


def tile_configs(tiles, num_stages: int = 1) -> list[triton.Config]:
    """Autotune configs from (BM, BK, num_warps) tiles.

    The kernels are single-pass and memory-bound (no K loop), so stages barely matter; the lists
    per family are short on purpose: each config is one more compile per specialization.
    """
    return [triton.Config({"BM": bm, "BK": bk}, num_warps=w, num_stages=num_stages) for bm, bk, w in tiles]


def prune_oversized(configs, named_args, **kwargs):
    """Drop tiles far larger than the problem (keep at least the smallest config)."""
    m, k = named_args.get("M", 1 << 30), named_args.get("K", 1 << 30)
    keep = [c for c in configs if c.kwargs["BM"] <= max(32, 2 * m) and c.kwargs["BK"] <= max(64, 2 * k)]
    return keep or [min(configs, key=lambda c: c.kwargs["BM"] * c.kwargs["BK"])]


class KernelOp:
    """A kernel entry point registered as the opaque torch custom op `name`.

    torch.compile, fake tensors and other tensor subclasses go through the registered op: the
    compiled graph calls this very function (its fake twin gives the output shapes), so compiled
    code launches the kernels exactly as eager does. (torch.library.triton_op is not used: AOT
    decomposes it into the raw launches, which Inductor then re-tunes with its own autotuner,
    ignoring the block kernels' tile pruning, and those kernels fail to compile.)

    Eager calls on plain tensors call the function itself: the custom-op machinery (boxing,
    autograd fallthrough, dynamo-disable wrappers) costs more host time per call than the launch
    (benchmarks/results/sweeps/profile_quantize.json), and a quantizer makes several such calls.
    """

    direct = True  # False: always through the dispatcher (sweeps/profile_quantize.json compares the two)

    def __init__(self, name: str, fn):
        from torch._library.infer_schema import infer_schema

        self.name, self.fn = name, fn

        def shapes_only(*args):  # fake tensors: fn allocates its outputs; wrapped() launches nothing
            outer, _FAKE.on = getattr(_FAKE, "on", False), True
            try:
                return fn(*args)
            finally:
                _FAKE.on = outer

        def run(*args):  # the op calls self.fn, so a diagnostic can wrap it
            return self.fn(*args)

        op = torch.library.custom_op(name, run, mutates_args=(), schema=infer_schema(fn, mutates_args=()))
        op.register_fake(shapes_only)
        namespace, op_name = name.split("::")
        self.op = getattr(getattr(torch.ops, namespace), op_name)

    def __call__(self, *args):
        if self.direct and not torch.compiler.is_compiling() and _plain(args):
            return self.fn(*args)
        return self.op(*args)

    def __repr__(self) -> str:
        return f"KernelOp({self.name})"


def kernel_op(name: str):
    """Decorator: `fn` as a KernelOp registered under `name`."""
    return lambda fn: KernelOp(name, fn)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain(args) -> bool:
    """Only real tensors (parameters included), and no dispatch mode (fake, functional) active."""
    if _get_current_dispatch_mode() is not None:
        return False
    return all(type(a) in _PLAIN_TYPES for a in args if isinstance(a, torch.Tensor))


_FAKE = threading.local()  # set while a KernelOp computes output shapes for fake tensors


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def faking() -> bool:
    """True while a KernelOp's fake twin computes output shapes: launchers that build host-side
    objects from data pointers (TMA descriptors) return their allocated outputs at once."""
    return getattr(_FAKE, "on", False)


def wrapped(kernel):
    """The kernel to launch: a launcher that does nothing while a KernelOp's fake twin computes
    output shapes, else the kernel itself."""
    if getattr(_FAKE, "on", False):
        return _NoLaunch()
    return kernel


def launch(kernel, grid, args: tuple, small: triton.Config, numel: int, **meta) -> None:
    """Run `kernel` (a triton.autotune Autotuner).

    Large problems use the autotuner; small ones run `small` directly, so they neither compile
    nor benchmark the other configs (and never synchronise the host).
    """
    if numel >= AUTOTUNE_MIN_ELEMENTS:
        wrapped(kernel)[grid](*args, **meta)
    else:
        _check_config(kernel.fn, tuple(small.kwargs))  # the interpreter would ignore a name the kernel lacks
        wrapped(kernel.fn)[grid](*args, **meta, **small.kwargs, num_warps=small.num_warps,
                                 num_stages=small.num_stages)


@functools.lru_cache(maxsize=None)
def _check_config(fn, names: tuple[str, ...]) -> None:
    unknown = sorted(set(names) - set(fn.arg_names))
    if unknown:
        raise TypeError(f"{fn.__name__} has no parameters {unknown}: a config names only the kernel's own")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability (cached: launchers ask it on every call)."""
    return _capability(cuda_index(device))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (cached: the query is a driver call); 4 off CUDA, so
    Triton's interpreter still runs several programs through the multi-program paths."""
    if device.type != "cuda":
        return 4
    return _sm_count(cuda_index(device))
