"""The measurements the benchmarks here share: a kernel-time median (eager, and replaying a CUDA
graph, which removes the host's launch cost) and the copy roofline."""
from __future__ import annotations

import torch


def median_ms(fn, warmup: int = 10, rep: int = 50) -> float:
    """Median ms of `fn` by triton.testing.do_bench (CUDA events; warmup / rep in ms of running)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def capture_graph(fn) -> tuple[torch.cuda.CUDAGraph | None, str | None]:
    """(`fn` captured in a CUDA graph after a warm-up, None) or (None, why it cannot be captured).

    Replaying it issues the recorded kernels with no Python, dispatcher or autograd work: its
    time is the device time a CUDA-graphed training step would spend on `fn`. The graph holds
    `fn`, and with it the tensors `fn` closes over that the replay reads (freed, their memory
    would be reused under the graph).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(3):  # warm up (compiles, autotuning, allocator) off the capture
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as err:  # e.g. a host sync inside fn: not capturable
        torch.cuda.synchronize()
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    graph.keepalive = fn
    return graph, None


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
