"""Sweep: where an MoE layer step's peak memory goes, per recipe and weight option.

    PYTHONPATH=. python3 -m benchmarks.sweep_layer_memory --out $OUT/layer_memory.json
    PYTHONPATH=. python3 -m benchmarks.sweep_layer_memory --tiny --out /tmp/m.json   # CPU: a dry run

One forward + backward of `MoELayer` at a bench_moe shape (bf16 weights, input and upstream
gradient), recorded with torch's CUDA allocator history (`torch.cuda.memory._record_memory_history`).
Replaying the recorded allocations and frees finds the moment of peak allocated memory; the blocks
alive then are grouped by the innermost qmoe (or benchmark) frame that allocated them, with the
phase (forward / backward) and their sizes. So the table says which tensors make one recipe's
peak higher than bf16's, and what each option (`recompute_weight_columnwise`,
`recompute_activation`) removes from it. On the CPU (`--tiny`) it only checks that the layer runs.
"""
from __future__ import annotations

import argparse
import gc
import sys
from collections import defaultdict

import torch

from benchmarks.bench_moe import SHAPES, _step_fn
from benchmarks.harness import error_line, run_header, write_results

TINY = dict(tokens=64, experts=4, top_k=2, hidden=128, ffn=128)
OPTIONS = {"": {}, "+rw": dict(recompute_weight_columnwise=True), "+rc": dict(recompute_activation=True),
           "+rw+rc": dict(recompute_weight_columnwise=True, recompute_activation=True)}


def _recipe(name):
    from qmoe.recipes import recipe_from_config
    return None if name == "bf16" else recipe_from_config({"name": name})


def _site(frames) -> tuple[str, str]:
    """(innermost qmoe or benchmarks frame as 'file:line function', phase) of one allocation."""
    site, phase = "?", "forward"
    for f in frames:  # innermost first
        name = f.get("filename", "")
        if site == "?" and ("/qmoe/" in name or "/benchmarks/" in name):
            site = f"{name.split('/qmoe/')[-1].split('/benchmarks/')[-1]}:{f.get('line')} {f.get('name')}"
        if "backward" in f.get("name", "") or "run_backward" in f.get("name", ""):
            phase = "backward"
    return site, phase


def peak_breakdown(snapshot: dict, base: int) -> dict:
    """The peak of allocated bytes over the recorded trace and the blocks alive at it, by site."""
    events = [e for trace in snapshot["device_traces"] for e in trace]
    live: dict[int, tuple[int, list]] = {}
    now = peak = 0
    peak_live: dict[int, tuple[int, list]] = {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            now += e["size"]
            if now > peak:
                peak, peak_live = now, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
    by_site: dict[tuple[str, str], int] = defaultdict(int)
    for size, frames in peak_live.values():
        by_site[_site(frames)] += size
    rows = sorted(({"site": s, "phase": p, "gib": b / 2 ** 30} for (s, p), b in by_site.items()),
                  key=lambda r: -r["gib"])
    return dict(step_peak_gib=peak / 2 ** 30, resident_gib=base / 2 ** 30, peak_gib=(peak + base) / 2 ** 30,
                at_peak=rows[:25])


def profile(shape: dict, recipe_name: str, option: str, device) -> dict:
    import qmoe

    torch.manual_seed(0)
    layer = qmoe.nn.MoELayer(shape["hidden"], shape["ffn"], shape["experts"], shape["top_k"],
                             params_dtype=torch.bfloat16, device=device, **OPTIONS[option])
    x = torch.randn(shape["tokens"], shape["hidden"], device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    step = _step_fn(layer, x, dy, _recipe(recipe_name))
    step()  # compiles, autotunes, builds recipe state
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    gc.collect()
    if device.type != "cuda":
        step()
        return dict(recipe=recipe_name, option=option, ran=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    out = dict(recipe=recipe_name, option=option, max_memory_allocated_gib=torch.cuda.max_memory_allocated() / 2 ** 30)
    out.update(peak_breakdown(snapshot, base))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="deepseek-v3-ep8", choices=sorted(SHAPES))
    p.add_argument("--recipes", nargs="+", default=["bf16", "delayed", "current", "block", "mxfp8", "nvfp4"])
    p.add_argument("--options", nargs="+", default=["", "+rw"], choices=sorted(OPTIONS),
                   help="weight / activation options ('' is the default layer)")
    p.add_argument("--tiny", action="store_true", help="tiny shape on the CPU (a dry run)")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    shape = TINY if args.tiny else SHAPES[args.shape]
    rows = []
    for name in args.recipes:
        for option in args.options:
            if name == "bf16" and "rw" in option:
                continue  # no quantized weight copy to recompute
            try:
                row = profile(shape, name, option, device)
            except Exception as e:  # noqa: BLE001 - a failing variant is a result
                row = dict(recipe=name, option=option, error=error_line(e))
            rows.append(row)
            if "peak_gib" in row:
                print(f"{name}{option}: peak {row['peak_gib']:.2f} GiB (step {row['step_peak_gib']:.2f} above "
                      f"{row['resident_gib']:.2f} resident)", flush=True)
                for r in row["at_peak"][:8]:
                    print(f"    {r['gib']:6.3f} GiB  {r['phase']:8s} {r['site']}", flush=True)
            else:
                print(f"{name}{option}: {row.get('error', 'ran')}", flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    write_results(args.out, run_header("benchmarks.sweep_layer_memory", argv, device),
                  dict(shape=dict(name="tiny" if args.tiny else args.shape, **shape), rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
