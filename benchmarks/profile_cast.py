"""A few calls of one block cast with a columnwise copy, for Nsight Compute to profile.

    ncu --clock-control none --section SchedulerStats --launch-skip 2 --launch-count 1 \
        -k regex:fp8_block python3 -m benchmarks.profile_cast --block 1x128

It times nothing itself: `ncu` picks a launch (here the third, after compilation and autotuning)
and measures it. bf16 randn input of --shape rows x columns; --block picks FP8 1x128 or 128x128
blocks or MXFP8 (round-up scales); --columnwise-only drops the rowwise codes; --fp32-reads reads
bf16 tiles as fp32 as fp16 / fp32 inputs are (the Gluon kernel's other path, same bits), after
one dispatched call that allocates the outputs (so skip one launch more).
`sweeps/ncu_block_cast_words.json` and `sweeps/ncu_block_cast_staged.json` came from these calls
(then in a script of their own).
"""
from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.sweep_block_cast import run


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block", choices=("1x128", "128x128", "mx32"), default="1x128")
    p.add_argument("--shape", default="65536x7168", help="ROWSxCOLUMNS of the bf16 input")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--columnwise-only", action="store_true")
    p.add_argument("--fp32-reads", action="store_true", help="the Gluon kernel reading bf16 as fp32")
    args = p.parse_args(argv)
    try:
        args.rows, args.cols = (int(v) for v in args.shape.lower().split("x"))
    except ValueError:
        p.error(f"--shape {args.shape!r}: expected ROWSxCOLUMNS, e.g. 65536x7168")
    if args.rows <= 0 or args.cols <= 0 or args.cols % 8:
        p.error(f"--shape {args.shape!r}: positive sizes, columns a multiple of 8 (16-byte rows for TMA)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from qmoe.kernels import _cast_transpose_gl as ct

    x = torch.randn(args.rows, args.cols, device="cuda").to(torch.bfloat16)
    rowwise = not args.columnwise_only
    if args.fp32_reads:  # the sweep's Gluon variant: the kernel itself into the op's outputs
        outs = run(x, None, args.block, rowwise)  # one dispatched launch first: skip one more
        for _ in range(args.calls):
            run(x, None, args.block, rowwise, dict(ct.DISPATCH, packed=False), outs)
    else:
        for _ in range(args.calls):
            run(x, None, args.block, rowwise)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
