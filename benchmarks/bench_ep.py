"""Expert-parallel MoE benchmark: bf16 vs quantized token dispatch, step time and all-to-all traffic.

Run under torchrun, one process per GPU:
    torchrun --nproc-per-node 2 --no-python qmoe bench ep [--quick] [--recipes ...]
    torchrun --nproc-per-node 2 -m benchmarks.bench_ep          (from the repository root)
A CPU smoke run (gloo, tiny shape): torchrun --nproc-per-node 2 -m benchmarks.bench_ep --device cpu

Each rank holds E/ep experts of one `qmoe.nn.MoELayer(ep_group=WORLD)` and routes its own tokens.
Per recipe, the layer runs with the tokens dispatched in bf16 and (where the recipe's input
format allows, `Quantizer.quantize_for_dispatch`) quantized: 1 byte per element plus scales.
Reported per row (rank 0 prints and writes benchmarks/results/ep.json):
- step_ms: forward + backward (input, router and expert gradients), the slowest rank's median;
- dispatch_bytes / combine_bytes: bytes this rank sent in the forward all-to-alls (rank 0's;
  backward sends the gradients of both back in bf16), a2a_step_bytes: all four together;
- a2a_ms, algbw_gbps, busbw_gbps: the dispatch all-to-all alone (same split sizes and payload,
  `all_to_all_single` timed by itself), algbw = bytes sent per rank / time, busbw = algbw *
  (ep-1)/ep (nccl-tests' all-to-all convention);
- speedup_vs_bf16_dispatch: the same recipe's bf16-dispatch step time / this step time;
  bytes_vs_bf16_dispatch: this row's dispatch bytes / the bf16 dispatch's.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.harness import error_line, run_header, write_results

# per-rank shard shapes: tokens routed by each rank, experts held by each rank (E = local * ep)
SHAPES = {
    "deepseek-v3-ep": dict(tokens=8192, local_experts=32, top_k=8, hidden=7168, ffn=2048),
    "tiny": dict(tokens=64, local_experts=2, top_k=2, hidden=128, ffn=64),
}
RECIPES = ("bf16", "current", "block", "mxfp8", "delayed", "nvfp4")
QUICK_RECIPES = ("bf16", "block", "mxfp8")


class _Timer:
    """Median milliseconds of `fn` over iterations, each started after a barrier (ranks aligned)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, warmup: int, iters: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            dist.barrier()
            if self.cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return _slowest(statistics.median(times))


def _slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _comm_device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _a2a_alone(exchange, row_shape, dtype, device, timer, warmup, iters):
    """Time the dispatch all-to-all by itself with the layer's split sizes and row payload."""
    from qmoe.parallel import all_to_all

    send = torch.zeros((exchange.send_rows, *row_shape), dtype=dtype, device=device)
    ms = timer(lambda: all_to_all(send, exchange), warmup, iters)
    sent = send.numel() * send.element_size()
    ep = dist.get_world_size()
    algbw = sent / (ms * 1e-3) / 1e9 if ms > 0 else None
    return ms, algbw, algbw * (ep - 1) / ep if algbw is not None else None


def bench(rows, name, shape, recipes, warmup, iters, device, capacity_factor):
    import qmoe
    from qmoe.recipes import recipe_from_config

    ep = dist.get_world_size()
    t, h, num_experts = shape["tokens"], shape["hidden"], shape["local_experts"] * ep
    dtype = torch.bfloat16
    torch.manual_seed(0)  # same weights on every rank before slicing: the router is replicated
    layers = {q: qmoe.nn.MoELayer(h, shape["ffn"], num_experts, shape["top_k"], params_dtype=dtype, device=device,
                                  ep_group=dist.group.WORLD, quantized_dispatch=q, capacity_factor=capacity_factor)
              for q in (False, True)}
    layers[True].load_state_dict(layers[False].state_dict())
    gen = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
    x = torch.randn(t, h, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    dy = torch.randn(t, h, device=device, dtype=dtype, generator=gen)
    timer = _Timer(device)
    for rname in recipes:
        recipe = None if rname == "bf16" else recipe_from_config({"name": rname})
        bf16_ms = bf16_bytes = None
        for quantized in (False, True):
            layer = layers[quantized]
            row = dict(shape=name, recipe=rname, dispatch="quantized" if quantized else "bf16", ep=ep,
                       **shape, experts=num_experts, capacity_factor=capacity_factor, step_ms=None, tokens_per_s=None,
                       dispatch_bytes=None, combine_bytes=None, a2a_step_bytes=None, a2a_ms=None, algbw_gbps=None,
                       busbw_gbps=None, speedup_vs_bf16_dispatch=None, bytes_vs_bf16_dispatch=None,
                       error=None)

            def step():
                layer.zero_grad(set_to_none=True)
                x.grad = None
                with qmoe.autocast(recipe=recipe, enabled=recipe is not None):
                    y = layer(x)
                y.backward(dy)
            try:
                step()
                stats = layer.dispatcher.last_stats
                if quantized and not stats["quantized"]:
                    break  # this recipe's input format cannot be dispatched quantized: one row is enough
                row["step_ms"] = timer(step, warmup, iters)
                row["tokens_per_s"] = t / (row["step_ms"] * 1e-3)
                # backward sends both gradients back in bf16: the rows' and the probs'
                grad_bytes = stats["rows_sent"] * (h * dtype.itemsize + 4) + stats["combine_bytes"]
                row.update(dispatch_bytes=stats["dispatch_bytes"], combine_bytes=stats["combine_bytes"],
                           a2a_step_bytes=stats["dispatch_bytes"] + stats["combine_bytes"] + grad_bytes)
                payload = ((stats["row_bytes"],), torch.uint8) if stats["quantized"] else ((h,), dtype)
                row["a2a_ms"], row["algbw_gbps"], row["busbw_gbps"] = _a2a_alone(
                    layer.dispatcher.last_exchange, *payload, device, timer, warmup, iters)
                if quantized and bf16_ms:
                    row["speedup_vs_bf16_dispatch"] = bf16_ms / row["step_ms"]
                    row["bytes_vs_bf16_dispatch"] = row["dispatch_bytes"] / bf16_bytes
                if not quantized:
                    bf16_ms, bf16_bytes = row["step_ms"], row["dispatch_bytes"]
            except Exception as e:  # noqa: BLE001 - one recipe failing must not stop the others
                row["error"] = error_line(e)
            rows.append(row)
            _print_row(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else format("-", spec.split(".")[0] or "")


HEADER = (f"{'shape':<15} {'recipe':<8} {'dispatch':<9} {'step ms':>9} {'disp MB':>9} {'comb MB':>9} "
          f"{'a2a ms':>8} {'busbw GB/s':>10} {'speedup':>8}  note")


def _print_row(r):
    if dist.get_rank() != 0:
        return
    def mb(b):
        return b / 1e6 if b is not None else None

    print(f"{r['shape']:<15} {r['recipe']:<8} {r['dispatch']:<9} {_fmt(r['step_ms'], '>9.3f')} "
          f"{_fmt(mb(r['dispatch_bytes']), '>9.2f')} {_fmt(mb(r['combine_bytes']), '>9.2f')} "
          f"{_fmt(r['a2a_ms'], '>8.3f')} {_fmt(r['busbw_gbps'], '>10.1f')} "
          f"{_fmt(r['speedup_vs_bf16_dispatch'], '>7.2f')}x  {r['error'] or ''}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="qmoe bench ep", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"recipes {', '.join(QUICK_RECIPES)}, fewer iterations")
    parser.add_argument("--shape", choices=list(SHAPES), default=None,
                        help="per-rank shard shape (default deepseek-v3-ep on CUDA, tiny on CPU)")
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), help="recipes to run (default: all)")
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="fixed-capacity dispatch (static all-to-all sizes) instead of dropless")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 5, --quick 2)")
    parser.add_argument("--iters", type=int, default=None, help="timed steps (default 20, --quick 5)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "ep.json"))
    args = parser.parse_args(argv)
    args.argv = argv
    if "WORLD_SIZE" not in os.environ and not dist.is_initialized():
        print("bench ep runs one process per GPU: launch it with torchrun, e.g. "
              "torchrun --nproc-per-node 2 --no-python qmoe bench ep", file=sys.stderr)
        return 2
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        print("bench ep --device cuda: no CUDA GPU found", file=sys.stderr)
        return 2
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                timeout=datetime.timedelta(minutes=10))
    try:
        return _run(args, torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda"
                    else torch.device("cpu"))
    finally:
        if own_group:
            dist.destroy_process_group()


def _run(args, device) -> int:
    shape_name = args.shape or ("deepseek-v3-ep" if device.type == "cuda" else "tiny")
    recipes = args.recipes or list(QUICK_RECIPES if args.quick else RECIPES)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    iters = args.iters if args.iters is not None else (5 if args.quick else 20)
    if dist.get_rank() == 0:
        print(HEADER, flush=True)
    rows = []
    bench(rows, shape_name, SHAPES[shape_name], recipes, warmup, iters, device, args.capacity_factor)
    if dist.get_rank() != 0:
        return 0
    from qmoe.backend import use_kernels
    result = dict(
        suite="ep",
        world_size=dist.get_world_size(), backend=dist.get_backend(),
        qmoe_backend="triton" if use_kernels(torch.empty(1, device=device)) else "reference",
        method=(f"one MoELayer(ep_group=WORLD) per rank, bf16 weights and activations, fp32 router; a step is forward "
                f"+ backward (input, router and expert gradients); step_ms: the slowest rank's median of {iters} "
                f"timed steps after {warmup} warm-up steps (CUDA events, a barrier before each); dispatch_bytes / "
                f"combine_bytes: rank 0's forward all-to-all bytes (rows + fp32 probs / expert outputs); "
                f"a2a_step_bytes adds the backward's bf16 gradients; a2a_ms: the dispatch all-to-all alone with the "
                f"layer's split sizes and payload (bf16 rows or packed FP8 codes + scales); algbw = bytes sent per "
                f"rank / a2a time, busbw = algbw * (ep-1)/ep; speedup_vs_bf16_dispatch = same recipe's bf16-dispatch "
                f"step_ms / step_ms; bytes_vs_bf16_dispatch = dispatch_bytes / the bf16 dispatch's"),
        quick=args.quick, rows=rows,
    )
    write_results(args.out, run_header("benchmarks.bench_ep", args.argv, device), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
