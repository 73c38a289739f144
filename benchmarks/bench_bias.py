"""Grouped-bias backward benchmark: dbias (and dscales) from dy, against the copy roofline.

Run: `qmoe bench bias` or `PYTHONPATH=. python -m benchmarks.bench_bias` (GPU only).

The backward (`qmoe.kernels.bias.grouped_bias_backward`) is deterministic: two launches with
fixed summation orders instead of fp32 atomics. This measures what that costs: the median of
`triton.testing.do_bench` per case, and the fraction of the time a read of dy at copy bandwidth
would take (dy is read once; the partials are 1/32 of its bytes). Cases: a DeepSeek-V3 FC1
output shard (65536 rows, N 4096, 256 experts) split evenly and all in one group, and 32 experts
of N 7168. Writes benchmarks/results/bias.json.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks.harness import copy_gbps, median_ms, run_header, write_results

CASES = [(65536, 4096, 256, False), (65536, 4096, 256, True), (65536, 7168, 32, False)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="qmoe bench bias", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "bias.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench bias needs a CUDA GPU; none found", file=sys.stderr)
        return 2
    from qmoe.kernels.bias import grouped_bias_backward
    header = run_header("benchmarks.bench_bias", argv)
    torch.manual_seed(0)
    rows = []
    for r, n, e, one_group in CASES:
        dy = torch.randn(r, n, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(e, n, device="cuda", dtype=torch.bfloat16)
        scales = torch.rand(r, device="cuda")
        offsets = (torch.tensor([0] + [r] * e, device="cuda") if one_group
                   else torch.arange(e + 1, device="cuda") * (r // e))
        for need_dscales in (False, True):
            ms = median_ms(lambda: grouped_bias_backward(dy, bias, offsets, scales, need_dscales))
            roofline_ms = r * n * dy.element_size() / (copy_gbps() * 1e9) * 1e3
            rows.append(dict(R=r, N=n, E=e, split="one group" if one_group else "even", dscales=need_dscales,
                             ms=ms, read_dy_roofline_ms=roofline_ms, frac_roofline=roofline_ms / ms))
            print(f"R {r} N {n} E {e} {rows[-1]['split']:9s} dscales={need_dscales!s:5s} {ms:.3f} ms "
                  f"(dy read at copy bandwidth: {roofline_ms:.3f} ms, {roofline_ms / ms:.2f})", flush=True)
    result = dict(
        suite="bias", copy_gbps=copy_gbps(),
        method="triton.testing.do_bench medians of grouped_bias_backward (bf16 dy, fp32 scales); "
               "read_dy_roofline_ms = dy bytes / copy_gbps (a 1 GiB copy, same run)",
        rows=rows)
    write_results(args.out, header, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
