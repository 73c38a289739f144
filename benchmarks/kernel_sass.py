"""What ptxas made of a Gluon kernel, without a GPU: compile one of qmoe's sm90 Gluon kernels for
sm_90a with the installed Triton, and report its shared memory, ptxas's spill bytes, and for each
loop of the SASS its instructions, tensor-core MMAs, local loads and stores, warpgroup barriers and
FP32 multiplies. A register budget that spills inside a step loop, or a barrier more per step,
shows here before it costs a device call.

    python -m benchmarks.kernel_sass wgrad --config '{"bn": 256, "pipe": 3, "stages": 3, "tail": "desc",
        "scales_tma": true, "consumer_regs": 240, "producer_regs": 24}'
    python -m benchmarks.kernel_sass wgrad --dispatched --sass /tmp/wgrad.sass
    python -m benchmarks.kernel_sass gemm --dispatched
    python -m benchmarks.kernel_sass cast --config '{"dtype": "float16", "mx": true}'
    python -m benchmarks.kernel_sass cast --config '{"activation": "swiglu"}'

Triton's driver is pointed at an sm90 target while the kernel compiles (`sm90_target`), and the
launcher's kernel is swapped for its `warmup` (`compile_launch`): nothing runs. ptxas and cuobjdump
are the ones bundled with Triton.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

KERNELS = ("wgrad", "gemm", "cast")


class Sm90Target:
    """The parts of Triton's active driver that compiling needs: an sm90 target."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def sm90_target():
    """Triton compiles for sm_90a inside the block (no GPU needed); its driver is put back after."""
    from triton.runtime import driver

    before = driver._active
    driver._active = Sm90Target()
    try:
        yield
    finally:
        driver._active = before


@contextlib.contextmanager
def compiling(module, name: str, compiled: list):
    """module.name[grid](...) compiles (its `warmup`) instead of launching, inside the block; each
    compiled kernel is appended to `compiled`."""
    kernel = getattr(module, name)

    class Compile:
        def __getitem__(self, grid):
            def warm(*args, **kwargs):
                compiled.append(kernel.warmup(*args, grid=grid, **kwargs))
                return compiled[-1]
            return warm

    setattr(module, name, Compile())
    try:
        yield compiled
    finally:
        setattr(module, name, kernel)


def wgrad_operands(k: int = 512, seed: int = 0):
    """Small block-scaled wgrad operands on the CPU, as the block wgrad launcher takes them: dy's
    and x's columnwise copies over three groups of 160, 0 and 96 tokens (dW [3, 256, k]), and the
    groups' offsets."""
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import grouped_gemm as gg
    from qmoe.quant import GroupedTensor
    from qmoe.recipes import Float8BlockScaling

    recipe = Float8BlockScaling()
    sizes = torch.tensor([160, 0, 96])
    g = torch.Generator().manual_seed(seed)
    dyq, xq = (GroupedTensor.quantize(torch.randn(256, c, generator=g), sizes, recipe.quantizer(role), rowwise=False,
                                      validate=False) for c, role in ((256, "grad_output"), (k, "input")))
    return gg.tokens_operand(dyq, Scaling.BLOCK), gg.tokens_operand(xq, Scaling.BLOCK), dyq.offsets


def _wgrad_launch(config: dict):
    from qmoe.kernels import _block_wgrad_ws as wg

    a, b, offsets = wgrad_operands()
    out = torch.empty(3, 256, 512, dtype=torch.bfloat16)
    return wg, "block_wgrad_ws_kernel", lambda: wg.launch_block_wgrad_ws(a, b, offsets, 256, 512, 3, out,
                                                                        programs=132, **config)


def gemm_launch(**config):
    """A launch of the Gluon block fprop on the CPU: 1x128-scaled activations [256, 512] in groups
    of 150, 0 and 106 rows against three 128x128-scaled [512, 512] weights; config: the
    launcher's keywords."""
    from qmoe.contracts.enums import Scaling
    from qmoe.kernels import _block_gemm_ws as ws
    from qmoe.kernels import grouped_gemm as gg
    from qmoe.ops.grouped_gemm import quantize_weights
    from qmoe.quant import GroupedTensor
    from qmoe.recipes import Float8BlockScaling

    recipe = Float8BlockScaling()
    g = torch.Generator().manual_seed(0)
    a = GroupedTensor.quantize(torch.randn(256, 512, generator=g), torch.tensor([150, 0, 106]),
                               recipe.quantizer("input"), columnwise=False, validate=False)
    w = quantize_weights(torch.randn(3, 512, 512, generator=g), recipe.quantizer("weight"), rowwise=True,
                         columnwise=False)
    a_op = gg.activation_operand(a, Scaling.BLOCK)
    b_op, n_out, k = gg.weight_operand(w, Scaling.BLOCK, False)
    return lambda: ws.launch_block_gemm_ws(a_op, b_op, a.offsets, a.shape[0], n_out, k, w.num_groups, programs=132,
                                           **config)


def _gemm_launch(config: dict):
    from qmoe.kernels import _block_gemm_ws as ws

    return ws, "block_gemm_ws_kernel", gemm_launch(**config)


def cast_launch(dtype: torch.dtype = torch.bfloat16, mx: bool = False, activation: str | None = None,
                canonical_scales: bool = False, gather: bool = False, **config):
    """A launch of the Gluon block cast (both orientations, FP8 E4M3) of a 256 x 384 tensor of
    `dtype` on the CPU: 1x128 blocks, or MXFP8's 1x32 with `mx`; with a GLU `activation`, of
    act(h) * probs for an h of 256 x 768; its scales steps-major (tile order) as fp8_block_op stores
    them, or in their canonical layout; config: the launcher's keywords (default: its dispatched
    ones; `values` = (rowwise, columnwise) with mx: those copies as exact bf16 values); with
    `gather`, of rows gathered from a 100-row source by an index (a `GatheredRows`)."""
    from qmoe.contracts.formats import E4M3
    from qmoe.kernels import _cast_transpose_gl as ct
    from qmoe.kernels import quantize as K
    from qmoe.kernels._layout import steps_major
    from qmoe.kernels.activation import activation_code

    m, k = 256, 384
    x = torch.randn(m, 2 * k if activation else k).to(dtype)
    if activation:
        config = dict(config, act=activation_code(activation), probs=torch.ones(m))
    if gather:
        from qmoe.kernels.activation import GATHER
        x = torch.randn(100, k).to(dtype)
        config = dict(config, act=GATHER, probs=torch.randint(-1, 100, (m,), dtype=torch.int32))
    row_values, col_values = config.get("values", (False, False))
    row = torch.empty(m, k, dtype=torch.bfloat16 if row_values else torch.float8_e4m3fn)
    col = torch.empty(m, k, dtype=torch.bfloat16) if col_values else torch.empty(k, m, dtype=torch.float8_e4m3fn)
    block, scale_dtype = (32, torch.uint8) if mx else (128, torch.float32)
    if canonical_scales:
        row_s, col_s = torch.empty(m, k // block, dtype=scale_dtype), torch.empty(k, m // block, dtype=scale_dtype)
    else:  # steps-major, as fp8_block_op stores them (its tile order)
        row_s, col_s = steps_major(m, k // block, scale_dtype, "cpu"), steps_major(k, m // block, scale_dtype, "cpu")
    config = {**{key: v for key, v in ct.DISPATCH.items() if key != "per_sm"}, **config}
    return lambda: ct.launch(x, None, 1, False, K.fp8_meta(E4M3), E4M3.max, True, 0.0, True, True, row, row_s, col,
                             col_s, programs=4, mx=(E4M3.emax, True) if mx else None, **config)


def _cast_launch(config: dict):
    from qmoe.kernels import _cast_transpose_gl as ct

    config = dict(config)
    dtype = getattr(torch, config.pop("dtype", "bfloat16"))
    return ct, "fp8_block_cast_kernel", cast_launch(dtype, config.pop("mx", False), config.pop("activation", None),
                                                    config.pop("canonical_scales", False), **config)


def dispatched_config(kernel: str) -> dict:
    """The configuration qmoe dispatches at the benchmark shapes (every K a multiple of 256; the
    cast of bf16 into 1x128 blocks)."""
    if kernel == "cast":
        return dict(dtype="bfloat16", mx=False)
    if kernel == "wgrad":
        from qmoe.kernels import _block_wgrad_ws as wg

        return dict(wg.DISPATCH_WIDE)
    from qmoe.kernels import _block_gemm_ws as ws

    return dict(ws.DISPATCH_WIDE, scales_tma=True)


def compile_kernel(kernel: str, config: dict):
    """The compiled sm_90a kernel (Triton's CompiledKernel) of one of KERNELS in `config`."""
    module, name, launch = {"wgrad": _wgrad_launch, "gemm": _gemm_launch, "cast": _cast_launch}[kernel](config)
    compiled = []
    with sm90_target(), compiling(module, name, compiled):
        launch()
    if not compiled:
        raise RuntimeError(f"the {kernel} launcher compiled nothing with {config}")
    return compiled[-1]


def ptxas_spills(ptx: str) -> dict:
    """ptxas's own count (-v) for the PTX: bytes of spill stores and loads, and its stack frame
    (the ptxas Triton itself picks for sm90)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(src), "-o", str(Path(d) / "k.o")],
                             capture_output=True, text=True, check=True)
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
    return dict(zip(("stack_bytes", "spill_store_bytes", "spill_load_bytes"), map(int, m.groups()))) if m else {}


def sass(cubin: bytes) -> str:
    """cuobjdump's SASS listing of a cubin, with its addresses (the cuobjdump Triton uses, as
    triton.tools.disasm finds it; that module's own listing replaces addresses with labels)."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", str(path)], capture_output=True, text=True,
                              check=True).stdout


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;")
_COUNTED = {"mma": ("GMMA",), "local_loads": ("LDL",), "local_stores": ("STL",), "barriers": ("BAR.SYNC",),
            "ffma": ("FFMA",), "fmul": ("FMUL",), "shared_loads": ("LDS",)}


_SPIN = 4  # instructions of a loop that only waits (a named barrier in a one-trip loop, a retry)


def _spins(body) -> bool:
    """A loop that only waits: a few instructions, a barrier or an mbarrier test among them, no MMA."""
    ops = [text for _, text in body]
    return (len(ops) <= _SPIN and any("BAR." in op or "SYNCS." in op for op in ops)
            and not any("GMMA" in op for op in ops))


def sass_loops(listing: str) -> list[dict]:
    """Every loop of a SASS listing (a backward branch and what lies between its target and it),
    innermost first within each function, with its instruction count and the counts of _COUNTED;
    `inner`: no other loop lies inside it, loops that only wait (`_spins`) aside."""
    instructions = [(int(a, 16), text) for a, text in _INSTRUCTION.findall(listing)]
    index = {address: i for i, (address, _) in enumerate(instructions)}
    spans = []
    for i, (address, text) in enumerate(instructions):
        m = re.search(r"\bBRA(?:\.\w+)*\s+(0x[0-9a-f]+)", text)
        target = int(m.group(1), 16) if m else None
        if target is not None and target <= address and target in index:
            spans.append((index[target], i))
    loops = []
    for start, end in spans:
        ops = [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for _, text in instructions[start:end + 1]]
        counts = collections.Counter(key for op in ops for key, names in _COUNTED.items()
                                     if any(n in op for n in names))
        inner = not any(s >= start and e <= end and (s, e) != (start, end) and not _spins(instructions[s:e + 1])
                        for s, e in spans)
        loops.append(dict(start=hex(instructions[start][0]), end=hex(instructions[end][0]),
                          instructions=len(ops), inner=inner, **{k: counts[k] for k in _COUNTED}))
    return sorted(loops, key=lambda loop: (not loop["inner"], int(loop["start"], 16)))


def report(kernel: str, config: dict) -> tuple[dict, str]:
    """The compiled kernel's shared memory, ptxas's spills and its loops (sass_loops), and its SASS."""
    k = compile_kernel(kernel, config)
    listing = sass(k.asm["cubin"])
    return dict(kernel=kernel, config=config, shared_bytes=k.metadata.shared, **ptxas_spills(k.asm["ptx"]),
                loops=sass_loops(listing)), listing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("kernel", choices=KERNELS)
    p.add_argument("--config", default=None, help="the launcher's keywords as JSON (default: --dispatched)")
    p.add_argument("--dispatched", action="store_true", help="the configuration qmoe dispatches")
    p.add_argument("--sass", help="also write the SASS listing here")
    p.add_argument("--all-loops", action="store_true",
                   help="list every loop (default: the innermost with an MMA or 50 instructions or more)")
    args = p.parse_args(argv)
    from qmoe.kernels._gluon_sm90 import gluon

    if gluon is None:
        print("this Triton has no Gluon: nothing to compile", file=sys.stderr)
        return 2
    config = json.loads(args.config) if args.config else dispatched_config(args.kernel)
    result, listing = report(args.kernel, config)
    if args.sass:
        Path(args.sass).write_text(listing)
    loops = result.pop("loops")
    print(json.dumps(result))
    print(f"{'loop':>17} {'instr':>6} {'mma':>4} {'LDL':>4} {'STL':>4} {'BAR':>4} {'FFMA':>5} {'FMUL':>5} {'LDS':>4}")
    for loop in loops:
        if args.all_loops or (loop["inner"] and (loop["mma"] or loop["instructions"] >= 50)):
            print(f"{loop['start']:>8}-{loop['end']:<8} {loop['instructions']:>6} {loop['mma']:>4} "
                  f"{loop['local_loads']:>4} {loop['local_stores']:>4} {loop['barriers']:>4} {loop['ffma']:>5} "
                  f"{loop['fmul']:>5} {loop['shared_loads']:>4}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
