"""Expert parallelism over torch.distributed: experts split over a group's ranks, tokens moved by all-to-all.

    layer = qmoe.nn.MoELayer(H, F, E, K, ep_group=group)      # E / group size experts on this rank
    layer.load_state_dict(qmoe.parallel.shard_expert_state_dict(full, E, rank, world))

See `ExpertParallelDispatcher` for the dropless and fixed-capacity modes and quantized dispatch.
"""
from qmoe.parallel.comm import AllToAll, Exchange, all_to_all
from qmoe.parallel.dispatcher import ExpertParallelDispatcher, shard_expert_state_dict

__all__ = ["AllToAll", "Exchange", "all_to_all", "ExpertParallelDispatcher", "shard_expert_state_dict"]
