"""cProfile of the small routing ops' forward + backward on the GPU: which host calls cost the time.

Companion of benchmarks/profile_routing.py (which shows these stages are bound by the host).
Prints per op the issue time of a forward + backward and of a forward under no_grad, and the
Python/C calls with the most own time. Output of record: benchmarks/results/profile_routing_host.txt.

    PYTHONPATH=. python -m benchmarks.profile_routing_host
"""
import cProfile, pstats, io, time
import torch
from qmoe import ops
from benchmarks.bench_routing import _fwd_bwd
t, e, k = 8192, 256, 8
logits = torch.randn(t, e, device="cuda", requires_grad=True)
with torch.no_grad():
    probs, rmap = ops.topk_route(logits, k, pre_softmax=True)
probs = probs.detach().requires_grad_(True)
counts = rmap.sum(0)
cases = {
 "aux_loss": (lambda: ops.moe_aux_loss(probs, counts, t, e, k, 1e-2), [probs]),
 "z_loss": (lambda: ops.z_loss(logits, 1e-3), [logits]),
 "router": (lambda: ops.topk_route(logits, k, score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5)[0], [logits]),
}
for name, (fwd, inputs) in cases.items():
    step = _fwd_bwd(fwd, inputs)
    for _ in range(30): step()
    torch.cuda.synchronize()
    fwd_only = lambda: fwd()
    for label, fn in (("fwd+bwd", step), ("fwd no_grad", fwd_only)):
        with torch.no_grad() if label != "fwd+bwd" else torch.enable_grad():
            for _ in range(30):  # forward-only kernel variants compile on first use
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(300): fn()
            us = (time.perf_counter() - t0) / 300 * 1e6
        torch.cuda.synchronize()
        print(f"== {name} {label}: {us:.1f} us issue", flush=True)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(300): step()
    pr.disable(); torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    print("\n".join(l[:170] for l in s.getvalue().splitlines() if l.strip() and (l.strip()[0].isdigit() or "ncalls" in l)), flush=True)
