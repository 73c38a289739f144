"""Shared test setup: the `gpu` marker skips without a CUDA device of sm90 or newer."""
import os

import pytest
import torch

from hypothesis import settings

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("QMOE_HYPOTHESIS_PROFILE", "ci"))


def _has_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def pytest_collection_modifyitems(config, items):
    if _has_sm90():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU of compute capability >= 9.0")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
