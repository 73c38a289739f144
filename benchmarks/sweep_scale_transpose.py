"""The block casts' scale copies: `qmoe.kernels._transpose.transpose_into` against torch's `copy_`
from a transposed view, same run.

The casts store 1x128 and MXFP8 scales steps-major (`_layout.steps_major`); canonical copies
of them, and the block GEMMs' steps-major copies of scales stored otherwise, are such moves.
This times them at the benchmark cast's scale shapes (65536x7168 bf16: FP8 1x128 fp32 scales
[65536, 56] and [7168, 512], MXFP8 E8M0 bytes [65536, 224] and [7168, 2048]) and checks both give the same bits.
GB/s counts the scales read once and written once.

    PYTHONPATH=. python3 -m benchmarks.sweep_scale_transpose --out $OUT/scale_transpose.json
    TRITON_INTERPRET=1 PYTHONPATH=. python3 -m benchmarks.sweep_scale_transpose --tiny --out /tmp/t.json
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.harness import add_tiny_flag, gpu_or_tiny, median_ms, run_header, write_results

SHAPES = [((65536, 56), torch.float32), ((7168, 512), torch.float32), ((65536, 224), torch.uint8),
          ((7168, 2048), torch.uint8)]
TINY = [((300, 3), torch.float32), ((70, 130), torch.uint8)]


def main(argv=None) -> int:
    from qmoe.kernels._transpose import transpose_into

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("scale_transpose.json"))
    add_tiny_flag(p)
    args = p.parse_args(argv)
    on_gpu = gpu_or_tiny(args.tiny)
    if on_gpu is None:
        return 2
    device = "cuda" if on_gpu else "cpu"
    rows = []
    for shape, dtype in TINY if args.tiny else SHAPES:
        src = torch.randint(0, 1 << 30, shape[::-1], dtype=torch.int32, device=device).view(torch.float32) \
            if dtype == torch.float32 else torch.randint(0, 256, shape[::-1], dtype=torch.uint8, device=device)
        want, got = torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
        moves = {"torch copy_": lambda: want.copy_(src.t()), "transpose_into": lambda: transpose_into(got, src)}
        for move in moves.values():
            move()
        row = dict(shape=list(shape), dtype=str(dtype).removeprefix("torch."),
                   same_bits=bool(torch.equal(want.view(torch.uint8), got.view(torch.uint8))))
        if on_gpu:
            nbytes = 2 * src.numel() * src.element_size()
            for name, move in moves.items():
                us = median_ms(move) * 1e3
                row[f"{name} us"], row[f"{name} GB/s"] = round(us, 1), round(nbytes / us / 1e3)
        rows.append(row)
        print(row, flush=True)
    write_results(args.out, run_header("benchmarks.sweep_scale_transpose", argv),
                  {"suite": "scale_transpose", "rows": rows})
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
