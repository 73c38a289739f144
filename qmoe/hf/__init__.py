"""Hugging Face MoE models on qmoe (`pip install 'qmoe[hf]'`).

    layer = qmoe.hf.from_hf(block)     # MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock,
                                       # Qwen3MoeSparseMoeBlock, DeepseekV3MoE, GptOssMLP
    qmoe.hf.to_hf(layer, block)        # the layer's weights back into the block
    model = qmoe.hf.convert(model)     # every supported block of a PreTrainedModel, in place
    model = qmoe.hf.restore(model)     # HF blocks back, with the trained weights

Nothing here imports transformers at import time: blocks are recognised by class name.
"""
from qmoe.hf.blocks import from_hf, to_hf
from qmoe.hf.model import HFMoEBlock, convert, restore

__all__ = ["from_hf", "to_hf", "convert", "restore", "HFMoEBlock"]
