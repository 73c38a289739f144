"""Where the routing ops' host time goes: floors of the pieces every small op pays.

The routing stages at training sizes are bound by the host (benchmarks/results/routing.json:
forward + backward issue time exceeds device time several times over). This measures, in one
process, the issue time (host microseconds per call, the GPU kept ahead by small tensors) of:

- allocation and ATen launch floors (empty, zeros, a small mul);
- a Triton launch through `JITFunction.run`, through qmoe's `FastLauncher`, and the compiled
  kernel's launcher called directly;
- autograd: a forward + backward of one native op, and of one Python `autograd.Function`
  (the floor every differentiable op pays: the engine's hand-off to the device thread);
- the routing stages themselves, eager reference against qmoe, forward (grad enabled) and
  forward + backward.

    PYTHONPATH=. python -m benchmarks.explore_host_overhead [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _nop4(a, b, n, s, BLOCK: tl.constexpr):
    pass


@triton.jit
def _nop16(a, b, c, d, n0, n1, n2, n3, s0, s1, s2, s3, f0, f1, f2, f3, A: tl.constexpr,
           B: tl.constexpr):
    pass


def issue_us(fn, n: int = 400, warm: int = 30) -> float:
    """Median over 5 batches of host microseconds per call of `fn` (no sync inside a batch)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    meds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        meds.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return sorted(meds)[2]


def main(argv=None) -> int:
    from benchmarks.bench_routing import _fwd_bwd, floor_step
    from benchmarks.results_file import run_environment
    from qmoe import ops
    from qmoe.reference import aux_loss as ref_aux, router as ref_router

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    dev = "cuda"
    x = torch.randn(1024, device=dev)
    res = {}

    def rec(name, us):
        res[name] = us
        print(f"{name:<48} {us:8.1f} us", flush=True)

    rec("torch.empty(1024)", issue_us(lambda: torch.empty(1024, device=dev)))
    rec("torch.zeros(1, int32)", issue_us(lambda: torch.zeros(1, dtype=torch.int32, device=dev)))
    rec("torch.mul(x, 2)", issue_us(lambda: torch.mul(x, 2.0)))
    rec("torch.cuda.current_stream()", issue_us(lambda: torch.cuda.current_stream()))
    rec("is_current_stream_capturing()", issue_us(torch.cuda.is_current_stream_capturing))
    rec("triton jit launch, 4 args", issue_us(lambda: _nop4[(1,)](x, x, 1024, 1.0, BLOCK=128)))
    rec("triton jit launch, 16 args", issue_us(
        lambda: _nop16[(1,)](x, x, x, x, 1024, 7, 9, 33, 1024, 1, 3, 5, 1.0, 2.0, 3.0, 4.0, A=1, B=2)))
    k4 = _nop4[(1,)](x, x, 1024, 1.0, BLOCK=128)
    k16 = _nop16[(1,)](x, x, x, x, 1024, 7, 9, 33, 1024, 1, 3, 5, 1.0, 2.0, 3.0, 4.0, A=1, B=2)
    from triton.runtime.driver import driver
    dev_i = driver.active.get_current_device()
    stream = driver.active.get_current_stream(dev_i)

    def direct4():
        k4.run(1, 1, 1, stream, k4.function, k4.packed_metadata, None, None, None, x, x, 1024, 1.0, 128)

    def direct16():
        k16.run(1, 1, 1, stream, k16.function, k16.packed_metadata, None, None, None,
                x, x, x, x, 1024, 7, 9, 33, 1024, 1, 3, 5, 1.0, 2.0, 3.0, 4.0, 1, 2)

    try:
        rec("compiled.run direct, 4 args", issue_us(direct4))
        rec("compiled.run direct, 16 args", issue_us(direct16))
    except Exception as err:  # the launcher's signature differs on this Triton
        print("direct launch failed:", type(err).__name__, err)
    from qmoe.kernels._triton_utils import FastLauncher
    fast4, fast16 = FastLauncher(_nop4), FastLauncher(_nop16)
    rec("qmoe FastLauncher, 4 args", issue_us(lambda: fast4[(1,)](x, x, 1024, 1.0, BLOCK=128)))
    rec("qmoe FastLauncher, 16 args", issue_us(
        lambda: fast16[(1,)](x, x, x, x, 1024, 7, 9, 33, 1024, 1, 3, 5, 1.0, 2.0, 3.0, 4.0, A=1, B=2)))
    rec("get_current_stream (triton driver)", issue_us(lambda: driver.active.get_current_stream(dev_i)))

    # autograd floors
    leaf = torch.randn(1024, device=dev, requires_grad=True)
    g0 = torch.ones((), device=dev)

    def native():
        leaf.grad = None
        torch.autograd.backward([torch.mul(leaf, 2.0).sum()], [g0])

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return torch.mul(a, 2.0)

        @staticmethod
        def backward(ctx, g):
            return torch.mul(g, 2.0)

    g1 = torch.ones(1024, device=dev)

    def python_fn():
        leaf.grad = None
        torch.autograd.backward([Scale.apply(leaf)], [g1])

    def native_one():
        leaf.grad = None
        torch.autograd.backward([torch.mul(leaf, 2.0)], [g1])

    rec("autograd native mul: fwd+bwd", issue_us(native_one))
    rec("autograd native mul+sum: fwd+bwd", issue_us(native))
    rec("autograd.Function (mul/mul): fwd+bwd", issue_us(python_fn))
    with torch.no_grad():
        rec("Function.apply under no_grad", issue_us(lambda: Scale.apply(leaf)))
    rec("Function.apply fwd, grad on", issue_us(lambda: Scale.apply(leaf)))

    # floors: one differentiable op, forward + backward, launching per direction no kernel, a
    # tiny ATen kernel, an empty Triton kernel through JITFunction.run, or the same through its
    # compiled launcher directly
    def launcher(kind):
        if kind == "aten":
            return lambda t: torch.mul(t, 2.0)
        if kind == "triton_jit":
            return lambda t: _nop4[(1,)](t, t, 1024, 1.0, BLOCK=128)
        if kind == "qmoe_fast":
            return lambda t: fast4[(1,)](t, t, 1024, 1.0, BLOCK=128)
        if kind == "triton_direct":
            return lambda t: k4.run(1, 1, 1, driver.active.get_current_stream(dev_i), k4.function,
                                    k4.packed_metadata, None, None, None, t, t, 1024, 1.0, 128)
        return None

    for kind in ("none", "aten", "triton_jit", "qmoe_fast", "triton_direct"):
        rec(f"floor fwd+bwd, launch per direction: {kind}", issue_us(floor_step(launcher(kind), 1024)))

    # the stages
    t, e, k = 8192, 256, 8
    torch.manual_seed(0)
    logits = torch.randn(t, e, device=dev, requires_grad=True)
    bias = torch.randn(e, device=dev) * 0.01
    kw = dict(score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5, expert_bias=bias)
    with torch.no_grad():
        probs, rmap = ops.topk_route(logits, k, **kw)
    probs = probs.detach().requires_grad_(True)
    counts = rmap.sum(0)
    stages = {
        "router": ((lambda: ref_router.topk_route(logits, k, **kw)[0]),
                   (lambda: ops.topk_route(logits, k, **kw)[0]), [logits]),
        "aux_loss": ((lambda: ref_aux.moe_aux_loss(probs, counts, t, e, k, 1e-2)),
                     (lambda: ops.moe_aux_loss(probs, counts, t, e, k, 1e-2)), [probs]),
        "seq_aux_loss": ((lambda: ref_aux.seq_aux_loss(probs, rmap, 4096, k, 1e-2)),
                         (lambda: ops.seq_aux_loss(probs, rmap, 4096, k, 1e-2)), [probs]),
        "z_loss": ((lambda: ref_aux.z_loss(logits, 1e-3)), (lambda: ops.z_loss(logits, 1e-3)), [logits]),
    }
    for name, (eager, ours, inputs) in stages.items():
        for label, fwd in (("eager", eager), ("qmoe", ours)):
            with torch.no_grad():
                rec(f"{name} {label} fwd no_grad", issue_us(fwd, n=200))
            rec(f"{name} {label} fwd grad", issue_us(fwd, n=200))
            rec(f"{name} {label} fwd+bwd", issue_us(_fwd_bwd(fwd, inputs), n=200))

    # the pieces of qmoe's router and aux loss, each alone
    from qmoe.kernels import aux_loss as kaux, router as kr
    from qmoe.reference.router import ScoreFunction
    fn = ScoreFunction("sigmoid")
    grid, fmeta, bmeta = kr._route_launch(t, e, k, fn, False, 8, 4, True)
    pr = torch.empty(t, e, device=dev)
    mb = torch.empty(t, e, device=dev, dtype=torch.uint8)
    dl = torch.empty(t, e, device=dev)
    gp = torch.randn(t, e, device=dev)
    ld = logits.detach()
    pieces = {
        "router raw fwd launch": lambda: kr._topk_route_kernel[grid](
            ld, bias, pr, mb, t, e, e, e, e, 2.5, **fmeta),
        "router _route_forward_op": lambda: kr._route_forward_op(ld, bias, k, "sigmoid", False, 8, 4, 2.5),
        "router route_forward": lambda: kr.route_forward(ld, k, fn, False, 8, 4, 2.5, bias),
        "router map != 0": lambda: mb != 0,
        "router raw bwd launch": lambda: kr._topk_route_bwd_kernel[grid](
            gp, ld, mb, dl, t, e, e, e, e, e, 2.5, **bmeta),
        "router route_backward": lambda: kr.route_backward(gp, ld, rmap, k, fn, False, 2.5),
        "router map.to(uint8)": lambda: rmap.to(torch.uint8),
        "aux aux_loss_forward": lambda: kaux.aux_loss_forward(probs.detach(), counts, 1e-3, None, True),
        "aux grad_from_rows": lambda: kaux.grad_from_rows(g0, pr[0], t, e, t, torch.float32),
    }
    with torch.no_grad():
        for name, f in pieces.items():
            rec(name, issue_us(f, n=300))
    for label, fwd, inputs in (("router", stages["router"][1], [logits]),
                               ("aux", stages["aux_loss"][1], [probs])):
        step = _fwd_bwd(fwd, inputs)
        outs = fwd()
        gouts = torch.randn_like(outs)

        def bwd_only(outs=outs, gouts=gouts):
            torch.autograd.backward([outs], [gouts], retain_graph=True)
        rec(f"{label} backward only (retain_graph)", issue_us(bwd_only, n=200))

    env = run_environment()
    print(json.dumps(env))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(suite="host_overhead", **env, method="host microseconds per call, "
                           "median of 5 batches of 200-400 calls without sync", us=res), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
