"""Shared test setup: the `gpu` marker skips without a CUDA device of sm90 or newer.

Triton is a dependency on Linux only (pyproject.toml): elsewhere tests/kernels is not collected;
on Linux a kernel module or Triton that fails to import fails its tests instead of skipping them.
"""
import os
import sys

import pytest
import torch

from hypothesis import settings

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("QMOE_HYPOTHESIS_PROFILE", "ci"))

collect_ignore_glob = [] if sys.platform.startswith("linux") else ["kernels/*"]


def _has_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def pytest_collection_modifyitems(config, items):
    if _has_sm90():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU of compute capability >= 9.0")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
