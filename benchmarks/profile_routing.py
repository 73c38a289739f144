"""Why the small routing stages miss 3x over eager PyTorch: host time against device time.

`qmoe bench routing` times the router and the aux / z losses, forward + backward, at 0.2-0.6 ms
although they move 8-36 MB (a few microseconds at copy bandwidth). For each such stage, eager
(the reference, op by op, autograd backward) and qmoe, at the bench's shapes:

- issue_us: wall time to issue one forward + backward, over many steps without synchronizing
  (the host's cost: Python, autograd, allocations, launches);
- wall_us: the same steps until the GPU is done (what do_bench sees);
- device_us and launches: the summed time of the step's kernels (torch.profiler) and their count;
  qmoe_kernels_us: qmoe's per kernel.

wall_us close to issue_us and far above device_us means the stage is bound by the host: a
faster kernel cannot help, fewer launches and less Python can (or a CUDA graph, where
device_us is the floor).

    PYTHONPATH=. python -m benchmarks.profile_routing --out benchmarks/results/profile_routing.json
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.bench_routing import AUX_ONLY, MODELS, _fwd_bwd, aux_only_case
from benchmarks.profile_quantize import device_profile, issue_and_wall_s
from benchmarks.results_file import write_results


def stages(cfg):
    """(stage, eager forward, qmoe forward, leaf inputs) at one model's routing shape."""
    from qmoe import ops
    from qmoe.reference import aux_loss as ref_aux, router as ref_router
    t, e, k = cfg["tokens"], cfg["experts"], cfg["top_k"]
    torch.manual_seed(0)
    kw = dict(cfg["router"])
    if kw.pop("bias", False):
        kw["expert_bias"] = torch.randn(e, device="cuda") * 0.01
    logits = torch.randn(t, e, device="cuda", requires_grad=True)
    with torch.no_grad():
        probs, routing_map = ops.topk_route(logits, k, **kw)
    probs = probs.detach().requires_grad_(True)
    counts = routing_map.sum(0)
    seq = min(cfg["seq_length"], t)
    return [
        ("router", lambda: ref_router.topk_route(logits, k, **kw)[0], lambda: ops.topk_route(logits, k, **kw)[0],
         [logits]),
        ("aux_loss", lambda: ref_aux.moe_aux_loss(probs, counts, t, e, k, 1e-2),
         lambda: ops.moe_aux_loss(probs, counts, t, e, k, 1e-2), [probs]),
        ("seq_aux_loss", lambda: ref_aux.seq_aux_loss(probs, routing_map, seq, k, 1e-2),
         lambda: ops.seq_aux_loss(probs, routing_map, seq, k, 1e-2), [probs]),
        ("z_loss", lambda: ref_aux.z_loss(logits, 1e-3), lambda: ops.z_loss(logits, 1e-3), [logits]),
    ]


def aux_only_stages():
    """(model label, T, E, [(stage, eager, qmoe, inputs)]) of the bench's balance-loss-alone sweep."""
    return [(f"aux-E{e}", t, e, [("aux_loss", *aux_only_case(t, e))]) for t, e in AUX_ONLY]


def main(argv=None) -> int:
    import triton

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  method="issue_us / wall_us: perf_counter per forward + backward over 200 unsynchronized steps "
                         "(after 20), until issued / until the GPU is done; device_us, launches: torch.profiler "
                         "CUDA kernel time and count per step (20 steps)", rows=[])
    cases = [(model, cfg["tokens"], cfg["experts"], stages(cfg)) for model, cfg in MODELS.items()]
    for model, t, e, model_stages in cases + aux_only_stages():
        for stage, eager, qmoe_fwd, inputs in model_stages:
            row = dict(model=model, stage=stage, T=t, E=e)
            for name, fwd in (("eager", eager), ("qmoe", qmoe_fwd)):
                try:
                    step = _fwd_bwd(fwd, inputs)
                    issue, wall = issue_and_wall_s(step, 200, 20)
                    dev, launches, kernels = device_profile(step)
                    row.update({f"{name}_issue_us": issue * 1e6, f"{name}_wall_us": wall * 1e6,
                                f"{name}_device_us": dev, f"{name}_launches": launches})
                    if name == "qmoe":
                        row["qmoe_kernels_us"] = kernels
                except Exception as e:  # keep profiling the rest; the row says what failed
                    row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            result["rows"].append(row)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else
                           f"{k}={ {n[:40]: round(u, 1) for n, u in v.items()} }" if isinstance(v, dict) else
                           f"{k}={v}" for k, v in row.items()), flush=True)
            if args.out:
                write_results(args.out, result, indent=1, quiet=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
