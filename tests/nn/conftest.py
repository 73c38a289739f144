"""Fixtures the nn tests share."""
import pytest

import qmoe.ops.grouped_linear_paths as paths


@pytest.fixture
def weight_quantizations(monkeypatch):
    """The weight stacks the grouped path quantized (the weight caches' misses), in call order."""
    calls = []
    real = paths.quantize_weights

    def counted(weight, *args, **kwargs):
        calls.append(weight)
        return real(weight, *args, **kwargs)
    monkeypatch.setattr(paths, "quantize_weights", counted)
    return calls
