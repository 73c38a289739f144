"""The two measurements every benchmark here shares: a kernel-time median and the copy roofline."""
from __future__ import annotations

import torch


def median_ms(fn, warmup: int = 10, rep: int = 50) -> float:
    """Median ms of `fn` by triton.testing.do_bench (CUDA events; warmup / rep in ms of running)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


_COPY_GBPS: dict[int, float] = {}  # per rep budget, measured once per process


def copy_gbps(rep: int = 50) -> float:
    """GB/s read + written by a 1 GiB device-to-device bf16 copy: the roofline's bandwidth."""
    if rep not in _COPY_GBPS:
        src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        ms = median_ms(lambda: dst.copy_(src), max(5, rep // 4), rep)
        _COPY_GBPS[rep] = 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9
        del src, dst
    return _COPY_GBPS[rep]
