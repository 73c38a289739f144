"""What every benchmark results file records about its run, and how it is written."""
from __future__ import annotations

import datetime
import json
import os
import platform

import torch


def run_environment(device: torch.device | str | None = None) -> dict:
    """When and on what a benchmark ran: UTC date, device name and compute capability (None on
    a CPU), torch, triton (None when absent) and Python versions."""
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available()
                                                                          else "cpu")
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    on_gpu = device.type == "cuda"
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu",
        capability=list(torch.cuda.get_device_capability(device)) if on_gpu else None,
        torch=torch.__version__, triton=triton_version, python=platform.python_version(),
    )


def write_results(path: str, result: dict, indent: int = 2, quiet: bool = False) -> None:
    """`result` as JSON at `path` (its folder created), and a line saying where unless `quiet`
    (scripts that rewrite the file after every row, so a partial run keeps its rows)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=indent)
    if not quiet:
        print(f"wrote {path}")
