"""benchmarks/profile_cast: its arguments, and a clear exit where there is no GPU."""
from __future__ import annotations

import pytest
import torch

from benchmarks import profile_cast


def test_shape_and_block_parse():
    args = profile_cast.parse_args(["--block", "mx32", "--shape", "256x512", "--columnwise-only"])
    assert (args.block, args.rows, args.cols, args.columnwise_only, args.fp32_reads) == ("mx32", 256, 512, True, False)


@pytest.mark.parametrize("shape", ["7168", "0x128", "64x100", "axb"])
def test_a_bad_shape_is_refused_by_name(shape, capsys):
    with pytest.raises(SystemExit):
        profile_cast.parse_args(["--shape", shape])
    assert "--shape" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only exit")
def test_without_a_gpu_it_says_so(capsys):
    assert profile_cast.main([]) == 2
    assert "CUDA GPU" in capsys.readouterr().err
