"""Triton building blocks shared by qmoe's quantize kernels (NUMERICS.md, exactly).

- Tile scheduling over groups: a launch covers `cdiv(M, BM) + G` virtual row tiles (a static
  bound on sum_g cdiv(M_g, BM)); `tile_rows` maps a tile to its group from the device split
  sizes, so no tile and no block crosses a group boundary and the host never reads the splits.
- Scale arithmetic: divisions are `div_rn` (Triton's `/` on fp32 is an approximate division),
  powers of two are built from bits (2^-127 is subnormal and must not flush), amaxes are
  maxima of |x|'s bit patterns (exact, and NaN, whose bits exceed inf's, wins).
- Casts: clamp with NaN propagation, then an RNE conversion (`cvt.rn.satfinite` on sm90).
- Launch helpers: autotune config generators, and the choice between the autotuned kernel
  (large problems) and one fixed config (small problems: no tuning runs, no host syncs);
  `KernelOp` (a launcher as an opaque torch op) and `FastLauncher` (repeat launches straight
  to Triton's compiled launcher).
- Arrival counters (`tickets`) for last-program-finishes reductions, shared without memsets.
"""
from __future__ import annotations

import os
import threading

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import _get_current_dispatch_mode
from triton.runtime.driver import driver as _driver
from triton.runtime.jit import JITFunction

from qmoe.contracts.formats import FLT_MAX, RHT_SIGNS

try:
    from triton import knobs
    from triton.knobs import HookChain
except ImportError:  # Triton < 3.4: no fast launches (see _fast_launch_supported)
    knobs = HookChain = None

_FLT_MAX = tl.constexpr(FLT_MAX)
_INF_BITS = tl.constexpr(0x7F800000)
_ABS_MASK = tl.constexpr(0x7FFFFFFF)
# Bit i set where the RHT sign vector s has s_i = -1.
RHT_SIGN_MASK = sum(1 << i for i, s in enumerate(RHT_SIGNS) if s < 0)

# Problems below this many elements run one fixed config: tuning them costs more than it gains,
# and a tuning run synchronises the host (no CUDA graph capture, no sync-debug mode).
AUTOTUNE_MIN_ELEMENTS = 1 << 22


# ---------------------------------------------------------------- scheduling

@triton.jit
def tile_rows(splits_ptr, M, G, pid, BM: tl.constexpr, SB: tl.constexpr, G_P2: tl.constexpr,
              GROUPED: tl.constexpr):
    """Rows of virtual row tile `pid`: (group, first row, group end row, first scale block, group start).

    Groups start their tiles (and their SB-row scale blocks) afresh; tiles past the last group
    get group index >= G. Ungrouped: one group of M rows.
    """
    if GROUPED:
        idx = tl.arange(0, G_P2)
        sizes = tl.load(splits_ptr + idx, mask=idx < G, other=0).to(tl.int32)
        tiles = (sizes + BM - 1) // BM
        tile_end = tl.cumsum(tiles, 0)
        g = tl.sum((tile_end <= pid).to(tl.int32), 0)
        sel = idx == g
        tile0 = tl.sum(tl.where(sel, tile_end - tiles, 0), 0)
        start = tl.sum(tl.where(sel, tl.cumsum(sizes, 0) - sizes, 0), 0)
        size = tl.sum(tl.where(sel, sizes, 0), 0)
        blocks = (sizes + SB - 1) // SB
        sblk = tl.sum(tl.where(sel, tl.cumsum(blocks, 0) - blocks, 0), 0)
        local = (pid - tile0) * BM
        return g, start + local, start + size, sblk + local // SB, start
    else:
        return 0, pid * BM, M, pid * (BM // SB), 0


@triton.jit
def tile_span(row0, row_end, K, BM: tl.constexpr, BK: tl.constexpr):
    """The [BM, BK] tile from row0 and column program_id(1) * BK: (rows, first column, columns,
    row mask (rows before row_end), column mask (columns before K))."""
    rows = row0 + tl.arange(0, BM)
    col0 = tl.program_id(1) * BK
    cols = col0 + tl.arange(0, BK)
    return rows, col0, cols, rows < row_end, cols < K


def group_pow2(num_groups: int) -> int:
    return max(2, triton.next_power_of_2(num_groups))


# ---------------------------------------------------------------- exact scalar arithmetic

@triton.jit
def abs_bits(x):
    """int32 pattern of |x| for fp32 x: orders like |x|, and NaN sorts above inf."""
    return x.to(tl.int32, bitcast=True) & _ABS_MASK


@triton.jit
def bits_to_float(b):
    return b.to(tl.float32, bitcast=True)


@triton.jit
def max_abs_bits(x, IGNORE_NAN: tl.constexpr):
    """max|x| of a 2-D fp32 tile as int32 bits (NaN propagates unless IGNORE_NAN)."""
    b = abs_bits(x)
    if IGNORE_NAN:
        b = tl.where(b > _INF_BITS, 0, b)
    return tl.max(tl.max(b, 1), 0)


@triton.jit
def atomic_max_bits(ptr, value):
    """atomic_max of a non-negative float's bits, skipped when the stored maximum is already >= value.

    One atomic per tile on one address serialises thousands of programs; the plain read lets
    all but the few tiles that raise the maximum skip it (a stale read only costs an atomic).
    """
    if value > tl.load(ptr):
        tl.atomic_max(ptr, value)


@triton.jit
def trans8(t):
    """Transpose a small 8-bit tile as uint8 bits through int32 (see cast_bits)."""
    return tl.trans(t.to(tl.uint8, bitcast=True).to(tl.int32)).to(tl.uint8)


@triton.jit
def is_nan(x):
    return abs_bits(x) > _INF_BITS


@triton.jit
def is_finite(x):
    return abs_bits(x) < _INF_BITS


@triton.jit
def clamp_nan(x, lo, hi):
    """min(max(x, lo), hi) with NaN kept (torch.clamp semantics)."""
    x = tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(x, hi, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def cast_satfinite(x, MAX: tl.constexpr, DTYPE: tl.constexpr):
    """RNE cast with saturation: clamp to +-MAX (NaN stays NaN), then round to nearest even."""
    return clamp_nan(x, -MAX, MAX).to(DTYPE, fp_downcast_rounding="rtne")


@triton.jit
def cast_bits(x, MAX: tl.constexpr, DTYPE: tl.constexpr):
    """cast_satfinite as raw uint8 bits. Kernels store codes as uint8: with both a tile and its
    transpose stored, fp8-typed tiles come out corrupted on Triton 3.6's bundled ptxas (12.9) on
    sm90 (triton-lang/triton#11111; the same conversion of 8-bit integers is clean)."""
    return cast_satfinite(x, MAX, DTYPE).to(tl.uint8, bitcast=True)


@triton.jit
def exp2_int(e):
    """Exact 2^e in fp32 for integer e in [-127, 127] (2^-127 is the subnormal 0x00400000)."""
    bits = tl.where(e >= -126, (e + 127) << 23, 0x00400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp8_scale_from_amax(amax, FMT_MAX: tl.constexpr, POW2: tl.constexpr, eps):
    """NUMERICS.md "FP8 scale from amax": fmt_max / max(amax, eps), 1 for 0 or non-finite amax."""
    amax = tl.where(eps > 0, tl.maximum(amax, eps, propagate_nan=tl.PropagateNan.ALL), amax)
    scale = tl.math.div_rn(tl.full(amax.shape, FMT_MAX, tl.float32), amax)
    scale = tl.where((amax == 0) | ~is_finite(amax), 1.0, scale)
    scale = tl.where(abs_bits(scale) == _INF_BITS, _FLT_MAX, scale)
    if POW2:  # zero the mantissa: round down to a power of two
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def reciprocal(x):
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), x)


@triton.jit
def mx_exponent(amax, FMT_MAX: tl.constexpr, EMAX: tl.constexpr, ROUND_UP: tl.constexpr):
    """Unbiased E8M0 exponent (int32) of each block amax; 128 marks a NaN block (byte 0xFF)."""
    if ROUND_UP:  # smallest k with 2^k >= amax / fmt_max
        v = tl.math.div_rn(amax, tl.full(amax.shape, FMT_MAX, tl.float32))
        bits = v.to(tl.int32, bitcast=True)
        field = (bits >> 23) & 0xFF
        man = bits & 0x7FFFFF
        b = tl.where(field == 0, tl.where(man > 0x400000, -126, -127), field - 127 + (man != 0).to(tl.int32))
    else:  # OCP MX: floor(log2(amax)) - emax; subnormal amax clamps to -127
        bits = amax.to(tl.int32, bitcast=True)
        field = (bits >> 23) & 0xFF
        b = tl.where(field == 0, -127, field - 127 - EMAX)
    b = tl.minimum(tl.maximum(b, -127), 127)
    b = tl.where(abs_bits(amax) == _INF_BITS, 127, b)
    return tl.where(is_nan(amax), 128, b)


# ---------------------------------------------------------------- block reductions on tiles

@triton.jit
def block_amax_last(x, R: tl.constexpr, C: tl.constexpr, B: tl.constexpr, IGNORE_NAN: tl.constexpr):
    """max|x| over runs of B along the last axis of a [R, C] fp32 tile -> [R, C // B]."""
    b = abs_bits(tl.reshape(x, (R, C // B, B)))
    if IGNORE_NAN:
        b = tl.where(b > _INF_BITS, 0, b)
    return bits_to_float(tl.max(b, 2))


@triton.jit
def scale_last(x, s, R: tl.constexpr, C: tl.constexpr, B: tl.constexpr):
    """x [R, C] times s [R, C // B] broadcast over runs of B along the last axis."""
    return tl.reshape(tl.reshape(x, (R, C // B, B)) * s[:, :, None], (R, C))


@triton.jit
def block_amax_first(x, R: tl.constexpr, C: tl.constexpr, B: tl.constexpr, IGNORE_NAN: tl.constexpr):
    """max|x| over runs of B along the first axis of a [R, C] fp32 tile -> [R // B, C]."""
    b = abs_bits(tl.reshape(x, (R // B, B, C)))
    if IGNORE_NAN:
        b = tl.where(b > _INF_BITS, 0, b)
    return bits_to_float(tl.max(b, 1))


@triton.jit
def scale_first(x, s, R: tl.constexpr, C: tl.constexpr, B: tl.constexpr):
    """x [R, C] times s [R // B, C] broadcast over runs of B along the first axis."""
    return tl.reshape(tl.reshape(x, (R // B, B, C)) * s[:, None, :], (R, C))


@triton.jit
def block_amax_2d(x, R: tl.constexpr, C: tl.constexpr, B: tl.constexpr):
    """max|x| over B x B blocks of a [R, C] fp32 tile -> [R // B, C // B] (NaN propagates)."""
    per_row = tl.max(abs_bits(tl.reshape(x, (R, C // B, B))), 2)  # [R, C/B]
    return bits_to_float(tl.max(tl.reshape(per_row, (R // B, B, C // B)), 1))


@triton.jit
def scale_2d(x, s, R: tl.constexpr, C: tl.constexpr, B: tl.constexpr):
    """x [R, C] times s [R // B, C // B] broadcast over B x B blocks."""
    rows = tl.reshape(tl.broadcast_to(s[:, None, :], (R // B, B, C // B)), (R, C // B))
    return scale_last(x, rows, R, C, B)


@triton.jit
def hadamard16(DTYPE: tl.constexpr, SIGN_MASK: tl.constexpr):
    """(diag(s) @ H16) / 4 as a [16, 16] tile: entry (i, j) = s_i (-1)^popcount(i & j) / 4."""
    i = tl.arange(0, 16)[:, None]
    j = tl.arange(0, 16)[None, :]
    v = i & j
    parity = (v ^ (v >> 1) ^ (v >> 2) ^ (v >> 3)) & 1
    neg = parity ^ ((SIGN_MASK >> i) & 1)
    return tl.where(neg == 1, -0.25, 0.25).to(DTYPE)


@triton.jit
def rht_last(x, R: tl.constexpr, C: tl.constexpr, SIGN_MASK: tl.constexpr):
    """Random Hadamard transform of every run of 16 along the last axis of x [R, C] -> fp32.

    One [R*C/16, 16] @ [16, 16] product; the +-1/4 entries are exact in x's dtype, so bf16 and
    fp16 tiles use tensor cores with fp32 accumulation and fp32 tiles an IEEE fp32 product.
    """
    h = hadamard16(x.dtype, SIGN_MASK)
    runs = tl.reshape(x, (R * C // 16, 16))
    if x.dtype == tl.float32:
        y = tl.dot(runs, h, input_precision="ieee", out_dtype=tl.float32)
    else:
        y = tl.dot(runs, h, out_dtype=tl.float32)
    return tl.reshape(y, (R, C))


@triton.jit
def pack4(vals, R: tl.constexpr, C: tl.constexpr):
    """An 8-bit tile [R, C] as int32 words [R, C // 4] (byte j of a word = column 4w + j)."""
    w = tl.reshape(vals.to(tl.uint8, bitcast=True).to(tl.int32), (R, C // 4, 4))
    return tl.sum(w << (tl.arange(0, 4) * 8)[None, None, :], 2)


@triton.jit
def store8(ptr, vals, row0, col0, stride, row_end, col_end, R: tl.constexpr, C: tl.constexpr):
    """Store an 8-bit tile vals [R, C] at ptr[(row0 + i) * stride + col0 + j], for rows < row_end and
    columns < col_end.

    Whole tiles starting 16-byte aligned are stored as int32 words packed in registers, so the
    layout conversion before a transposed store moves 32-bit words (see cast_bits), and grouped
    tiles, whose first row is only known at run time, still store 16 bytes at a time.
    """
    rows = row0 + tl.arange(0, R)
    if (row0 + R <= row_end) & (col0 + C <= col_end) & (col0 % 16 == 0) & (stride % 16 == 0):
        words = (col0 // 16) * 4 + tl.arange(0, C // 4)  # == col0 / 4 + j, visibly 16-byte aligned
        tl.store(ptr.to(tl.pointer_type(tl.int32)) + rows[:, None].to(tl.int64) * ((stride // 16) * 4)
                 + words[None, :], pack4(vals, R, C))
    else:
        cols = col0 + tl.arange(0, C)
        tl.store(ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], vals,
                 mask=(rows < row_end)[:, None] & (cols < col_end)[None, :])


@triton.jit
def uniform_tile(seed, offs, R: tl.constexpr, C: tl.constexpr):
    """[R, C] uniforms in [0, 1) (24-bit resolution) from one Philox call per 4 elements.

    offs [R, C // 4]: distinct Philox counters, one per run of 4 elements along the last axis.
    """
    r0, r1, r2, r3 = tl.randint4x(seed, offs)
    r = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (R, C))
    return (r >> 8).to(tl.float32) * (1.0 / 16777216.0)


# ---------------------------------------------------------------- launch helpers

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
    decomposes it into the raw launches, which Inductor then re-tunes with its own autotuner;
    measured on an H200, that ignored the block kernels' tile pruning and failed to compile
    them.) Eager calls on plain tensors call the function itself: the custom-op machinery (boxing,
    autograd fallthrough, dynamo-disable wrappers) costs more host time per call than the launch
    (benchmarks/results/profile_quantize.json), and a quantizer makes several such calls.
    """

    direct = True  # False: always through the dispatcher (profile_quantize compares the two)

    def __init__(self, name: str, fn):
        from torch._library.infer_schema import infer_schema

        self.name, self.fn = name, fn

        def shapes_only(*args):  # fake tensors: fn allocates its outputs; wrapped() launches nothing
            outer, _FAKE.on = getattr(_FAKE, "on", False), True
            try:
                return fn(*args)
            finally:
                _FAKE.on = outer

        def run(*args):  # the op calls self.fn, so a diagnostic can wrap it (benchmarks/diagnose_compile.py)
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


def rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t` when its last dimension is dense (the kernels take a row stride), else a dense copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


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


def wrapped(kernel):
    """The kernel to launch: a launcher that does nothing while a KernelOp's fake twin computes
    output shapes; the kernel itself while torch.compile traces (the aux losses' Functions are
    traced through); else, for a plain `@triton.jit` kernel, its `FastLauncher`."""
    if getattr(_FAKE, "on", False):
        return _NoLaunch()
    if _FAST_LAUNCH and type(kernel) is JITFunction and not torch.compiler.is_compiling():
        fast = _FAST_LAUNCHERS.get(kernel)
        if fast is None:
            fast = _FAST_LAUNCHERS[kernel] = FastLauncher(kernel)
        return fast
    return kernel


def _fast_launch_supported() -> bool:
    # JITFunction.run ends in `kernel.run(grid0, grid1, grid2, stream, function, packed_metadata,
    # launch_metadata, enter_hook, exit_hook, *args)` from Triton 3.6 (run on the GPU here)
    # through 3.9 (read); elsewhere launches go through JITFunction.run.
    if os.environ.get("QMOE_FAST_LAUNCH", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        version = tuple(int(v) for v in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return knobs is not None and (3, 6) <= version < (4, 0)


def _no_launch_hooks() -> bool:
    """No launch hook is registered (Triton 3.6+ keeps empty hook chains by default)."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and not (type(hook) is HookChain and not hook.calls):
            return False
    return True


_FAST_LAUNCH = _fast_launch_supported()
_FAST_LAUNCHERS: dict = {}
_I32_MIN, _I32_END, _U64_MIN = -(1 << 31), 1 << 31, 1 << 63


def _specialization(args, constexprs: frozenset) -> tuple | None:
    """What Triton may compile a launch differently for, per positional argument (a superset:
    a finer key only costs a slow-path launch): a constexpr's value; a tensor's dtype and
    16-byte alignment; an int's being 1, a multiple of 16, and its integer type; a float's or
    None's type. None for anything else (that launch takes JITFunction.run)."""
    key = []
    append = key.append
    for i, a in enumerate(args):
        t = type(a)
        if i in constexprs:
            append(a)
        elif t is torch.Tensor or t is torch.nn.Parameter:
            append((a.dtype, not (a.data_ptr() & 15)))
        elif t is int:
            append((a == 1, not (a & 15), _I32_MIN <= a < _I32_END, a >= _U64_MIN))
        elif t is float or t is bool or a is None:
            append(t)
        else:
            return None
    return tuple(key)


class FastLauncher:
    """`kernel[grid](*args, **meta)` with less host time than JITFunction.run.

    JITFunction.run binds and specializes every argument in Python on every launch: 19-21 us
    a launch on an H200 host, against 7-9 us for the compiled launcher it ends in and 12-18 us
    through this class (benchmarks/results/host_overhead.json). The first launch of each
    specialization (`_specialization`, the device, the keyword arguments) goes through
    JITFunction.run, which compiles it and returns the compiled kernel; later ones call that
    kernel's launcher directly. Launch hooks (profilers such as proton) and pre-run hooks send
    every launch through JITFunction.run.
    """

    __slots__ = ("kernel", "params", "constexprs", "compiled")

    def __init__(self, kernel: JITFunction):
        self.kernel = kernel
        self.params = list(kernel.signature.parameters.values())
        self.constexprs = frozenset(p.num for p in kernel.params if p.is_constexpr)
        self.compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        global _FAST_LAUNCH
        if not _FAST_LAUNCH or not _no_launch_hooks() or self.kernel.pre_run_hooks or callable(grid):
            return self.kernel[grid](*args, **kwargs)
        spec = _specialization(args, self.constexprs)
        if spec is None:
            return self.kernel[grid](*args, **kwargs)
        device = _driver.active.get_current_device()
        meta = tuple(kwargs.items())
        try:
            entry = self.compiled.get((spec, meta, device))
        except TypeError:  # an unhashable keyword value
            return self.kernel[grid](*args, **kwargs)
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if not any(isinstance(v, torch.Tensor) for v in kwargs.values()):  # keyed by value, kept
                tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in self.params[len(args):])
                self.compiled[(spec, meta, device)] = (compiled, tail)
            return compiled
        compiled, tail = entry
        g = tuple(grid) + (1, 1)
        try:
            compiled.run(g[0], g[1], g[2], _driver.active.get_current_stream(device), compiled.function,
                         compiled.packed_metadata, None, None, None, *args, *tail)
        except TypeError:  # this Triton's launcher takes other arguments: never again
            _FAST_LAUNCH = False
            return self.kernel[grid](*args, **kwargs)
        return compiled


def launch(kernel, grid, args: tuple, small: triton.Config, numel: int, **meta) -> None:
    """Run `kernel` (a triton.autotune Autotuner).

    Large problems use the autotuner; small ones run `small` directly, so they neither compile
    nor benchmark the other configs (and never synchronise the host).
    """
    if numel >= AUTOTUNE_MIN_ELEMENTS:
        wrapped(kernel)[grid](*args, **meta)
    else:
        wrapped(kernel.fn)[grid](*args, **meta, **small.kwargs, num_warps=small.num_warps,
                                 num_stages=small.num_stages)


# ---------------------------------------------------------------- arrival counters

# Counters handed to graph captures: allocated (zeroed) outside any capture, each captured launch
# keeps its own slice for the graph's lifetime. Per device index: [buffer, next free slot].
_CAPTURE_TICKETS: dict[int, list] = {}
_CAPTURE_TICKET_SLOTS = 1 << 14
# Counters for eager launches, one buffer per (device index, CUDA stream).
_STREAM_TICKETS: dict[tuple[int, int], torch.Tensor] = {}


def tickets(n: int, device: torch.device) -> torch.Tensor:
    """At least `n` zeroed int32 arrival counters for a last-program-finishes kernel, which
    draws from them with `is_last_to_arrive` (its last program sets each back to zero).

    Because the kernel leaves them zeroed, a launch needs no memset of its own (a launch, and
    8 us of host time, fewer per loss). Sharing is safe where launches cannot overlap: eager
    launches share one buffer per CUDA stream (a stream runs its kernels one after another),
    and a launch captured into a CUDA graph gets counters of its own, which it keeps zeroed
    for every replay, on any stream. A capture before any eager launch on that device, or one
    that has used up the capture slots, falls back to a captured memset of fresh counters.
    """
    if device.type != "cuda" or torch.compiler.is_compiling():
        # Triton's interpreter runs one launch at a time; a traced graph gets fresh counters
        # (what it does with a module-level buffer the kernel mutates is not ours to decide)
        return torch.zeros(n, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.is_current_stream_capturing():
        pool = _CAPTURE_TICKETS.get(index)
        if pool is None or pool[1] + n > pool[0].numel():
            return torch.zeros(n, dtype=torch.int32, device=device)
        start, pool[1] = pool[1], pool[1] + n
        return pool[0][start:start + n]
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    buf = _STREAM_TICKETS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
        _STREAM_TICKETS[key] = buf
        if index not in _CAPTURE_TICKETS:
            _CAPTURE_TICKETS[index] = [torch.zeros(_CAPTURE_TICKET_SLOTS, dtype=torch.int32,
                                                   device=device), 0]
    return buf


@triton.jit
def is_last_to_arrive(ticket_ptr, n):
    """True in the last of `n` programs to call this on a zeroed counter, which that program
    sets back to zero (`tickets` hands the counter to the next launch).

    The CUDA threadfence-reduction handshake: the barrier orders every thread's earlier
    stores before the ticket, the ticket's acq_rel makes them visible to the program that
    draws the last one (which then reads them with volatile loads, past the L1). All `n`
    have drawn by then, so nothing of this launch touches the counter after the reset.
    """
    tl.debug_barrier()
    last = tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == n - 1
    if last:
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed")
    return last


@triton.jit
def sum_partials(partial_ptr, n, BLOCK: tl.constexpr):
    """Sum of partial[0:n] in a fixed order (the same bits on every run)."""
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + idx, mask=idx < n, other=0.0, volatile=True)
    return tl.sum(acc, axis=0)


def device_splits(split_sizes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Split sizes as an int tensor on x's device (a no-op for device splits)."""
    if split_sizes.dim() != 1:
        raise ValueError(f"split_sizes must be 1-D [G], got shape {tuple(split_sizes.shape)}")
    if split_sizes.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"split_sizes must be int32 or int64, got {split_sizes.dtype}")
    return split_sizes.to(x.device) if split_sizes.device != x.device else split_sizes


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with unit stride along K (copies only when it has none)."""
    if x.dim() != 2:
        raise ValueError(f"quantize kernels take a 2-D tensor [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize kernels take float32, bfloat16 or float16 input, got {x.dtype}")
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()
