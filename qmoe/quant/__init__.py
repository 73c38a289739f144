"""Quantizers, QuantizedTensor and GroupedTensor (NUMERICS.md)."""
from qmoe.quant.factory import make_quantizer
from qmoe.quant.grouped import GroupedTensor
from qmoe.quant.quantizer import (Float8BlockQuantizer, Float8CurrentQuantizer, Float8DelayedQuantizer,
                                  MXFP8Quantizer, NVFP4Quantizer, Quantizer)
from qmoe.quant.tensor import QuantizedTensor
from qmoe.quant.weight_cache import WeightCache, capture_weights, clear_weight_caches

__all__ = ["Quantizer", "Float8CurrentQuantizer", "Float8DelayedQuantizer", "Float8BlockQuantizer",
           "MXFP8Quantizer", "NVFP4Quantizer", "QuantizedTensor", "GroupedTensor", "make_quantizer", "WeightCache",
           "capture_weights", "clear_weight_caches"]
