"""The NVFP4 cast (a Triton kernel) compiles for sm_90a in every combination of block shape,
Hadamard transform, stochastic rounding and codes / values per copy, with the Triton installed
here and no GPU: the interpreter runs Python, not Triton's compiler, so a kernel that only the
compiler refuses (branches that return different types, say) passes every CPU test otherwise."""
import itertools

import pytest
import torch

from qmoe.contracts.formats import NVFP4_BLOCK
from qmoe.kernels import quantize_nvfp4 as K4
from qmoe.kernels._tiles import RHT_SIGN_MASK

CASES = [c for c in itertools.product((False, True), (False, True), (False, True), (False, True), (False, True))
         if not (c[0] and c[1])]  # (block_2d, rht, stochastic, row_values, col_values); no RHT of 16x16 blocks


@pytest.mark.parametrize("block_2d,rht,stochastic,row_values,col_values", CASES)
def test_the_nvfp4_cast_compiles_for_sm90(block_2d, rht, stochastic, row_values, col_values):
    from benchmarks.kernel_sass import sm90_target

    m, k = 256, 256
    x = torch.empty(m, k, dtype=torch.bfloat16)
    f32, i64, u8 = (torch.empty(4, dtype=d) for d in (torch.float32, torch.int64, torch.uint8))
    row = torch.empty(1, dtype=torch.bfloat16 if row_values else torch.uint8)
    col = torch.empty(1, dtype=torch.bfloat16 if col_values else torch.uint8)
    with sm90_target():
        compiled = K4._nvfp4_kernel.fn.warmup(
            x, x, f32, f32, i64, row, u8, col, u8, i64, m, k, 3, k, k // 2, m // 2, 16, 16, ACT=-1, GLU_BLOCK=0,
            B=NVFP4_BLOCK, BLOCK_2D=block_2d, RHT=rht, STOCHASTIC=stochastic, ROWWISE=True, COLWISE=True,
            GROUPED=True, G_P2=32, SIGN_MASK=RHT_SIGN_MASK, ROW_VALUES=row_values, COL_VALUES=col_values, BM=64,
            BK=64, num_warps=4, grid=(1,))
    assert compiled.asm.get("cubin"), "no sm_90a binary"
