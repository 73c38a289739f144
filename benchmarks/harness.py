"""What every `qmoe bench` suite shares: how it times, and how it writes its results file.

Timing: a kernel-time median (eager), a CUDA graph capture (its replay removes the host's launch
cost) and the copy roofline. Results: every file under benchmarks/results/ is one JSON object
whose first key is `header`, saying when, how and on what it was measured (HEADER_KEYS), so a
number cited in the docs can be traced to the code that produced it and run again.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# every header has these; extra keys (capability, python) are allowed
HEADER_KEYS = ("date", "command", "commit", "device", "torch", "triton")
# environment variables that change what a suite measures, recorded in front of its command line
RECORDED_ENV = ("QMOE_BACKEND", "TRITON_INTERPRET", "NCCL_NVLS_ENABLE")


@contextlib.contextmanager
def environ_set(name: str, value: str):
    """os.environ[name] = value inside the block; afterwards what it was, or unset again."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def add_tiny_flag(parser) -> None:
    """--tiny, for the sweeps that also run on the CPU: tiny shapes, bits only, no timing."""
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, bits only (CPU: TRITON_INTERPRET=1)")


def gpu_or_tiny(tiny: bool) -> bool | None:
    """Whether a sweep measures on the GPU (True) or checks bits on tiny shapes (False: --tiny, on
    the CPU under TRITON_INTERPRET=1 where there is no GPU); None, having said why, with neither."""
    if not torch.cuda.is_available() and not tiny:
        print("needs a CUDA GPU (or --tiny under TRITON_INTERPRET=1)", file=sys.stderr)
        return None
    return torch.cuda.is_available() and not tiny


# ---------------------------------------------------------------- timing

def error_line(e: BaseException, limit: int = 400) -> str:
    """A failed measurement's error as one line for a results file: type and first line of text."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:limit]


def median_ms(fn, warmup: int = 10, rep: int = 50) -> float:
    """Median ms of `fn` by triton.testing.do_bench (CUDA events; warmup / rep in ms of running)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


_WARMUP_STREAMS: dict[int, torch.cuda.Stream] = {}


def warmup_stream() -> torch.cuda.Stream:
    """The side stream every capture's warm-up runs on, one per device for the whole process: cuBLAS
    keeps a 64 MiB workspace for each stream it has run on, so a new stream per capture would leave
    that much more allocated for every measurement after it, and later peaks would count it
    (benchmarks/results/sweeps/moe_peak_order.json)."""
    index = torch.cuda.current_device()
    if index not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[index] = torch.cuda.Stream()
    return _WARMUP_STREAMS[index]


def capture_graph(fn) -> tuple[torch.cuda.CUDAGraph | None, str | None]:
    """(`fn` captured in a CUDA graph after a warm-up, None) or (None, why it cannot be captured).

    Replaying it issues the recorded kernels with no Python, dispatcher or autograd work: its
    time is the device time a CUDA-graphed training step would spend on `fn`. The graph holds
    `fn`, and with it the tensors `fn` closes over that the replay reads (freed, their memory
    would be reused under the graph).
    """
    side = warmup_stream()
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


# ---------------------------------------------------------------- results files

def git_commit(root: Path | str = REPO_ROOT) -> str:
    """`git rev-parse HEAD` of the checkout the suite runs from, or "unknown" (no git, no
    repository: an installed copy, a machine without git). `QMOE_COMMIT` names it instead for a
    run from an exported tree, whose enclosing git checkout (if any) is not what was measured."""
    if os.environ.get("QMOE_COMMIT"):
        return os.environ["QMOE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else "unknown"


def command_line(module: str, argv: list[str] | None = None, environ=None) -> str:
    """The shell command that reruns this measurement: `python -m <module> <argv>` (argv None:
    this process's arguments), after the RECORDED_ENV variables that are set, under `torchrun`
    when the process is one of a torchrun job's."""
    environ = os.environ if environ is None else environ
    args = sys.argv[1:] if argv is None else list(argv)
    words = [f"{k}={shlex.quote(environ[k])}" for k in RECORDED_ENV if k in environ]
    if "WORLD_SIZE" in environ and "LOCAL_WORLD_SIZE" in environ:
        words += ["torchrun", f"--nproc-per-node={environ['LOCAL_WORLD_SIZE']}", "-m", module]
    else:
        words += ["python", "-m", module]
    return " ".join(words + [shlex.quote(a) for a in args])


def run_header(module: str, argv: list[str] | None = None, device: torch.device | str | None = None) -> dict:
    """The header of a results file written now by `python -m <module> <argv>` on `device`
    (default: the current CUDA device, else the CPU): UTC date, command, commit, device name
    and compute capability (None on a CPU), torch, triton (None when absent) and Python versions."""
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available()
                                                                          else "cpu")
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    on_gpu = device.type == "cuda"
    return dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command=command_line(module, argv),
        commit=git_commit(),
        device=torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu",
        capability=list(torch.cuda.get_device_capability(device)) if on_gpu else None,
        torch=torch.__version__, triton=triton_version, python=platform.python_version(),
    )


def check_header(header) -> None:
    """TypeError unless `header` is a dict, ValueError unless every HEADER_KEYS entry is a
    non-empty string (triton may be None: a run without Triton)."""
    if not isinstance(header, dict):
        raise TypeError(f"header must be a dict, got {type(header).__name__}")
    for key in HEADER_KEYS:
        value = header.get(key)
        if key == "triton" and key in header and value is None:
            continue
        if not isinstance(value, str) or not value:
            raise ValueError(f"header[{key!r}] must be a non-empty string, got {value!r}")


def write_results(path: str | Path, header: dict, result: dict, indent: int = 2, quiet: bool = False) -> None:
    """`{"header": header, **result}` as JSON at `path` (its folder created), and a line saying
    where unless `quiet` (suites that rewrite the file after every shape, so a partial run keeps
    its rows). The run's facts live in the header only: `result` may not repeat them."""
    check_header(header)
    repeated = sorted(set(result) & {"header", *HEADER_KEYS})
    if repeated:
        raise ValueError(f"result repeats the header's {repeated}: keep them in the header only")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"header": header, **result}, indent=indent) + "\n")
    if not quiet:
        print(f"wrote {path}")
