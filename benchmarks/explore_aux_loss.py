"""Device time of the balance loss's two launches, by variant: where a graphed step's time goes.

`qmoe bench routing` replays each loss's forward + backward in a CUDA graph; the balance loss
is two launches there (the forward reduction, the backward's broadcast multiply) and runs at
2.1-2.9x the eager reference's graph, short of 3x. Each piece is captured alone and replayed,
at the bench's shapes, with:

- forward: the persistent reduction at several programs per SM and tile sizes;
- the sequence-level loss's forward by column block width (at L = 4096);
- backward: ATen's broadcasting multiply over a stride-0 view (what the op used below 2^24
  elements until this measurement, for its lower host cost) against the Triton broadcast kernel.

    PYTHONPATH=. python -m benchmarks.explore_aux_loss [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.timing import capture_graph, median_ms

SHAPES = [(8192, 256), (16384, 128), (131072, 64), (131072, 1024)]


def graphed_us(fn) -> float:
    graph, why = capture_graph(fn)
    if graph is None:
        raise RuntimeError(why)
    return median_ms(graph.replay, 25, 200) * 1e3


def main(argv=None) -> int:
    from benchmarks.results_file import run_environment
    from qmoe.kernels import aux_loss as k

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = []
    base = (k._PROGRAMS_PER_SM, k._TILE)
    seq_base = k._SEQ_BLOCK_E
    for t, e in SHAPES:
        torch.manual_seed(0)
        probs = torch.softmax(torch.randn(t, e, device="cuda"), -1)
        counts = (torch.rand(t, e, device="cuda") < 8 / e).sum(0)
        grad_loss = torch.tensor(0.5, device="cuda")
        row = dict(T=t, E=e, forward_us={}, backward_us={})
        for pps in (1, 2, 4, 8):
            for tile in (2048, 4096, 8192, 16384):
                k._PROGRAMS_PER_SM, k._TILE = pps, tile
                k._tile.cache_clear()
                k._reduce_geometry.cache_clear()
                fwd = lambda: k.aux_loss_forward(probs, counts, 1e-3, None, True)  # noqa: E731
                row["forward_us"][f"pps{pps}-tile{tile}"] = graphed_us(fwd)
        k._PROGRAMS_PER_SM, k._TILE = base
        k._tile.cache_clear()
        k._reduce_geometry.cache_clear()
        _, rows_buf = k.aux_loss_forward(probs, counts, 1e-3, None, True)
        unit = rows_buf.as_strided((t, e), (0, 1))
        row["backward_us"]["aten_mul"] = graphed_us(lambda: torch.mul(unit, grad_loss))
        row["backward_us"]["triton_broadcast"] = graphed_us(
            lambda: k.broadcast_grad(grad_loss, rows_buf, t, e, torch.float32, 1.0, t))
        row["backward_us"]["one_tiny_aten_kernel"] = graphed_us(lambda: grad_loss.mul(1.0))
        row["copy_us_at_4.2TBps"] = t * e * 4 / 4.2e12 * 1e6
        if e <= 256:  # the sequence-level loss at the bench's L = 4096, by column block width
            routing_map = torch.rand(t, e, device="cuda") < 8 / e
            row["seq_forward_us"] = {}
            for block in (32, 64, 128, 256):
                k._SEQ_BLOCK_E = block
                k._seq_geometry.cache_clear()
                row["seq_forward_us"][f"block_e{block}"] = graphed_us(
                    lambda: k.seq_aux_loss_forward(probs, routing_map, 4096, 1e-3))
            k._SEQ_BLOCK_E = seq_base
            k._seq_geometry.cache_clear()
            print(f"T={t} E={e}: seq forward {row['seq_forward_us']}", flush=True)
        rows.append(row)
        best = min(row["forward_us"], key=row["forward_us"].get)
        print(f"T={t} E={e}: forward default {row['forward_us'][f'pps{base[0]}-tile{base[1]}']:.1f} us, "
              f"best {best} {row['forward_us'][best]:.1f} us; backward {row['backward_us']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(suite="aux_loss_variants", **run_environment(),
                           method="median us of replaying one launch captured in a CUDA graph "
                                  "(do_bench, 200 ms); fp32 probs", rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
