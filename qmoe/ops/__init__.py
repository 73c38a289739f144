"""Functional ops and autograd Functions; each picks the Triton kernel or the reference."""
from qmoe.ops.linear import quantized_linear
from qmoe.ops.router import apply_capacity, router_logits, topk_route
from qmoe.ops.aux_loss import moe_aux_loss, seq_aux_loss, update_expert_bias, z_loss
from qmoe.ops.permute import RowIdMap, gathered_rows, moe_permute, moe_unpermute
from qmoe.ops.grouped_gemm import k_grouped_gemm, m_grouped_gemm, quantize_weights, select_grouped_path
from qmoe.ops.grouped_linear import grouped_linear
from qmoe.ops.activation import expert_activation
