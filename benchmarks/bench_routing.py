"""Routing benchmark: router, aux losses, permute and unpermute, forward + backward.

Run: `qmoe bench routing` or `PYTHONPATH=. python -m benchmarks.bench_routing [--quick]`.

Each stage is timed in the same run, alternately (ROUNDS times, medians kept): the eager PyTorch
reference (`qmoe.reference.*`, the executable spec, run op by op on the GPU with autograd) and
qmoe's op (`qmoe.ops.*`, Triton kernels with fused backward). Medians of `triton.testing.do_bench`. Shapes: DeepSeek-V3
(8192 tokens, 256 experts, top-8, sigmoid, group-limited 8 groups / top-4, H 7168) and Qwen3
(16384 tokens, 128 experts, top-8, softmax, H 2048), and the balance loss alone at E in
{64, 1024, 4096} with 131072 tokens. Writes benchmarks/results/routing.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import triton

from benchmarks.harness import capture_graph, copy_gbps, median_ms, run_header, write_results

MODELS = {
    "deepseek-v3": dict(tokens=8192, experts=256, top_k=8, hidden=7168, align=16,
                        router=dict(score_function="sigmoid", num_groups=8, group_topk=4,
                                    scaling_factor=2.5, bias=True), seq_length=4096),
    "qwen3": dict(tokens=16384, experts=128, top_k=8, hidden=2048, align=16,
                  router=dict(score_function="softmax"), seq_length=4096),
}
AUX_ONLY = [(131072, 64), (131072, 1024), (131072, 4096)]
QUICK_SCALE = 8  # --quick divides token counts by this


def _fwd_bwd(forward, inputs):
    """A closure running forward, then backward with fixed gradients on every float output."""
    outs = forward()
    outs = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,))
             if isinstance(o, torch.Tensor) and o.requires_grad]
    grads = [torch.randn_like(o) for o in outs]

    def run():
        for t in inputs:
            t.grad = None
        res = forward()
        res = [o for o in (res if isinstance(res, (tuple, list)) else (res,))
               if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.backward(res, grads)
    return run


def min_bytes(stage: str, t: int, e: int, k: int = 0, h: int = 0, rows: int = 0) -> int:
    """The fewest bytes a stage's forward + backward can move (each input read once, each output
    written once; fp32 probs/logits, bool routing map, bf16 activations)."""
    te = t * e
    return {
        "router": te * (4 + 4 + 1) + te * (4 + 4),  # logits -> probs, map; dprobs -> dlogits
        "aux_loss": te * 4 + te * 4,  # read probs; write dprobs
        "seq_aux_loss": te * (4 + 1) + te * 4,  # probs and map; write dprobs
        "z_loss": te * 4 + te * (4 + 4),  # read logits; read them again and write dlogits
        "permute": 2 * (t * h + rows * h) * 2,  # x -> rows; drows -> dx
        "unpermute": (rows * h + t * h) * 2 + (t * h + 2 * rows * h) * 2,  # y -> out; dout, y -> dy
    }[stage]


# Eager and qmoe are timed in alternation, ROUNDS times, and each keeps its median: issue times
# of these host-bound stages drift by tens of percent within a process (and ~2x between
# processes), and alternating keeps a drift from landing on one side of the ratio.
ROUNDS = 3


@triton.jit
def _empty_kernel(x_ptr):
    pass


class _Floor(torch.autograd.Function):
    """The cheapest differentiable op: forward and backward each allocate their result and call
    `launch` on it (None: nothing; `_launch_empty`: one empty Triton kernel, what a fused op
    launches at the least). Timed under the same harness, it is what Python, autograd, the
    engine's hand-off to the device thread (and the launch) cost any op before its kernels do
    any work."""

    @staticmethod
    def forward(ctx, x, launch):
        ctx.launch, ctx.shape = launch, x.shape
        if launch is not None:
            launch(x)
        return torch.empty((), device=x.device)

    @staticmethod
    def backward(ctx, _):
        grad = torch.empty(ctx.shape, device="cuda")  # a fresh tensor: AccumulateGrad keeps it, no copy
        if ctx.launch is not None:
            ctx.launch(grad)
        return grad, None


def _launch_empty(t):
    _empty_kernel[(1,)](t)


def floor_step(launch=None, numel: int = 16):
    """A forward + backward of `_Floor` under the bench's harness (`_fwd_bwd`)."""
    x = torch.zeros(numel, device="cuda", requires_grad=True)
    return _fwd_bwd(lambda: _Floor.apply(x, launch), [x])


def _stage(rows, model, stage, shape, eager_fwd, qmoe_fwd, inputs, nbytes=None):
    row = dict(model=model, stage=stage, shape=shape)
    impls = (("eager", eager_fwd), ("qmoe", qmoe_fwd))
    steps = {name: _fwd_bwd(fwd, inputs) for name, fwd in impls}
    graphs = {}
    for name, fwd in impls:
        graphs[name], why = capture_graph(_fwd_bwd(fwd, inputs))
        if why:
            row[f"{name}_graph_error"] = why
    times = {f"{name}_{kind}": [] for name, _ in impls for kind in ("fwd_ms", "ms", "graph_ms")}
    floors = {"autograd_floor_ms": floor_step(), "triton_floor_ms": floor_step(_launch_empty)}
    times.update({key: [] for key in floors})
    for _ in range(ROUNDS):
        for key, step in floors.items():
            times[key].append(median_ms(step))
        for name, fwd in impls:
            with torch.no_grad():
                times[f"{name}_fwd_ms"].append(median_ms(fwd))
            times[f"{name}_ms"].append(median_ms(steps[name]))
            if graphs[name] is not None:
                times[f"{name}_graph_ms"].append(median_ms(graphs[name].replay))
    for key, values in times.items():
        row[key] = statistics.median(values) if values else None
    row["speedup"] = row["eager_ms"] / row["qmoe_ms"]
    row["speedup_fwd"] = row["eager_fwd_ms"] / row["qmoe_fwd_ms"]
    row["speedup_graph"] = (row["eager_graph_ms"] / row["qmoe_graph_ms"]
                            if row["eager_graph_ms"] and row["qmoe_graph_ms"] else None)
    # the speed of light: min bytes at copy bandwidth. eager_ms / roofline_ms is the largest
    # speedup any implementation could show over eager; qmoe_frac_roofline how close qmoe gets
    row["min_bytes"] = nbytes
    row["roofline_ms"] = nbytes / (copy_gbps() * 1e9) * 1e3 if nbytes else None
    row["max_possible_speedup"] = row["eager_ms"] / row["roofline_ms"] if nbytes else None
    row["qmoe_frac_roofline"] = row["roofline_ms"] / row["qmoe_ms"] if nbytes else None
    # and the host's: no differentiable Python op that launches a kernel each way runs forward +
    # backward faster than the Triton floor
    row["max_possible_speedup_eager"] = row["eager_ms"] / max(row["triton_floor_ms"], row["roofline_ms"] or 0)
    rows.append(row)
    print(f"{model:>12} {stage:<14} {str(shape):<58} eager {row['eager_ms']:8.3f} ms  "
          f"qmoe {row['qmoe_ms']:8.3f} ms  x{row['speedup']:6.2f}   (fwd x{row['speedup_fwd']:.2f}; "
          f"graphed x{row['speedup_graph'] or 0:.2f}; "
          f"at most x{row['max_possible_speedup'] or 0:.1f} at copy bandwidth, "
          f"x{row['max_possible_speedup_eager']:.1f} eagerly)",
          flush=True)


def bench_model(rows, name, cfg, scale):
    from qmoe import ops
    from qmoe.reference import aux_loss as ref_aux, permute as ref_perm, router as ref_router
    t, e, k, h, align = cfg["tokens"] // scale, cfg["experts"], cfg["top_k"], cfg["hidden"], cfg["align"]
    seq = min(cfg["seq_length"], t)
    dev = "cuda"
    torch.manual_seed(0)
    kw = dict(cfg["router"])
    if kw.pop("bias", False):
        kw["expert_bias"] = torch.randn(e, device=dev) * 0.01
    logits = torch.randn(t, e, device=dev, requires_grad=True)
    shape = dict(T=t, E=e, K=k, **{n: v for n, v in kw.items() if n != "expert_bias"})
    _stage(rows, name, "router", shape, lambda: ref_router.topk_route(logits, k, **kw)[0],
           lambda: ops.topk_route(logits, k, **kw)[0], [logits], min_bytes("router", t, e))

    with torch.no_grad():
        probs, routing_map = ops.topk_route(logits, k, **kw)
    probs = probs.detach().requires_grad_(True)
    counts = routing_map.sum(0)
    _stage(rows, name, "aux_loss", dict(T=t, E=e),
           lambda: ref_aux.moe_aux_loss(probs, counts, t, e, k, 1e-2),
           lambda: ops.moe_aux_loss(probs, counts, t, e, k, 1e-2), [probs], min_bytes("aux_loss", t, e))
    _stage(rows, name, "seq_aux_loss", dict(T=t, E=e, L=seq),
           lambda: ref_aux.seq_aux_loss(probs, routing_map, seq, k, 1e-2),
           lambda: ops.seq_aux_loss(probs, routing_map, seq, k, 1e-2), [probs], min_bytes("seq_aux_loss", t, e))
    _stage(rows, name, "z_loss", dict(T=t, E=e), lambda: ref_aux.z_loss(logits, 1e-3),
           lambda: ops.z_loss(logits, 1e-3), [logits], min_bytes("z_loss", t, e))

    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    pshape = dict(T=t, E=e, K=k, H=h, align=align, dtype="bf16")
    used = t * k  # rows that carry a token (padding rows are written once, counted in neither)
    _stage(rows, name, "permute", pshape,
           lambda: ref_perm.moe_permute(x, routing_map, probs, align, top_k=k)[:2],
           lambda: ops.moe_permute(x, routing_map, probs, align, top_k=k)[:2], [x, probs],
           min_bytes("permute", t, e, k, h, used))
    with torch.no_grad():
        out, _, row_id_map, _ = ops.moe_permute(x, routing_map, probs, align, top_k=k)
    y = torch.randn_like(out).requires_grad_(True)
    _stage(rows, name, "unpermute", pshape, lambda: ref_perm.moe_unpermute(y, row_id_map, probs),
           lambda: ops.moe_unpermute(y, row_id_map, probs), [y, probs], min_bytes("unpermute", t, e, k, h, used))


def aux_only_case(t, e):
    """(eager forward, qmoe forward, leaf inputs) of the balance loss alone over [t, e] softmax probs."""
    from qmoe import ops
    from qmoe.reference import aux_loss as ref_aux
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(t, e, device="cuda"), -1).requires_grad_(True)
    counts = (torch.rand(t, e, device="cuda") < 8 / e).sum(0)
    return (lambda: ref_aux.moe_aux_loss(probs, counts, t, e, 8, 1e-2),
            lambda: ops.moe_aux_loss(probs, counts, t, e, 8, 1e-2), [probs])


def bench_aux_only(rows, scale):
    for t, e in AUX_ONLY:
        t //= scale
        _stage(rows, f"aux-E{e}", "aux_loss", dict(T=t, E=e), *aux_only_case(t, e), min_bytes("aux_loss", t, e))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="qmoe bench routing", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"token counts / {QUICK_SCALE}: a smoke run")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "routing.json"))
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--no-aux-sweep", action="store_true", help="skip the E in {64, 1024, 4096} sweep")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench routing needs a CUDA GPU (the kernels run on sm90+); none found", file=sys.stderr)
        return 2
    from qmoe.backend import use_kernels
    probe = torch.empty(1, device="cuda")
    if not use_kernels(probe):
        print("warning: qmoe ops run the reference on this device (sm < 90 or QMOE_BACKEND=reference);"
              " the comparison is reference vs reference", file=sys.stderr)
    header = run_header("benchmarks.bench_routing", argv)
    scale = QUICK_SCALE if args.quick else 1
    rows = []
    for name in args.models:
        bench_model(rows, name, MODELS[name], scale)
        torch.cuda.empty_cache()
    if not args.no_aux_sweep:
        bench_aux_only(rows, scale)
    result = dict(
        suite="routing",
        qmoe_backend="triton" if use_kernels(probe) else "reference",
        method="triton.testing.do_bench medians, ms; *_ms = forward + backward, *_fwd_ms = forward "
               "(no_grad); eager = qmoe.reference run op by op in PyTorch (the spec, autograd "
               "backward), qmoe = qmoe.ops (Triton kernels); speedup = eager / qmoe; *_graph_ms = forward + "
               "backward captured once in a CUDA graph and replayed (device time, no host launch cost; "
               "speedup_graph = eager_graph_ms / qmoe_graph_ms); min_bytes: the "
               "fewest bytes the stage's forward + backward can move; roofline_ms = min_bytes / copy_gbps "
               "(a 1 GiB copy, same run); max_possible_speedup = eager_ms / roofline_ms (no "
               "implementation can beat eager by more); qmoe_frac_roofline = roofline_ms / qmoe_ms; "
               "autograd_floor_ms: the same forward + backward harness around a differentiable op "
               "that launches no kernel (Python, autograd, the engine's device-thread hand-off); "
               "triton_floor_ms: the same, launching one empty Triton kernel forward and one backward; "
               "max_possible_speedup_eager = eager_ms / max(triton_floor_ms, roofline_ms); eager "
               "and qmoe are timed alternately, 3 rounds, medians",
        quick=args.quick, target="qmoe >= 3x eager for each stage", copy_gbps=copy_gbps(),
        rows=rows,
    )
    write_results(args.out, header, result)
    worst = min(r["speedup"] for r in rows)
    print(f"slowest speedup x{worst:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
