"""benchmarks.kernel_sass: its SASS loop census on a hand-written listing, and on the dispatched
block wgrad compiled for sm_90a here (no GPU), whose step loop must do exactly the promotion the
numerics contract asks for."""
import pytest

from benchmarks import kernel_sass

# an outer loop (0x0040 back to 0x0010) around an inner one (0x0030 back to 0x0020), then code after
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDL R2, [R1+0x4] ;
        /*0020*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24 ;
        /*0028*/                   FFMA R3, R4, R5, R3 ;
        /*0030*/               @P0 BRA 0x20 ;
        /*0038*/                   BAR.SYNC.DEFER_BLOCKING 0x2, 0x80 ;
        /*0040*/              @!P1 BRA 0x10 ;
        /*0050*/                   STL [R1], R2 ;
        /*0060*/                   BRA 0x70 ;
        /*0070*/                   EXIT ;
"""


def test_loops_are_counted_from_backward_branches():
    loops = kernel_sass.sass_loops(LISTING)
    assert [(loop["start"], loop["end"], loop["inner"]) for loop in loops] == [("0x20", "0x30", True),
                                                                             ("0x10", "0x40", False)]
    inner, outer = loops
    assert (inner["instructions"], inner["mma"], inner["ffma"], inner["local_loads"]) == (3, 1, 1, 0)
    assert (outer["instructions"], outer["mma"], outer["local_loads"], outer["barriers"], outer["local_stores"]) == (
        6, 1, 1, 1, 0)  # the STL after the loop and the forward branch are not in it


def test_dispatched_block_wgrad_step_loop_does_the_contracts_promotion():
    """The 128 x 256 wgrad's step loop: two 64 x 128 products per consumer (4 wgmma k32 each), and
    per thread 2 x 64 elements promoted as acc + p * (a_scale * b_scale): one FMUL and one FFMA
    each, nothing more (NUMERICS.md's order of operations)."""
    from qmoe.kernels._gluon_sm90 import SMEM_BYTES, gluon

    if gluon is None:
        pytest.skip("this Triton has no Gluon")
    result, listing = kernel_sass.report("wgrad", kernel_sass.dispatched_config("wgrad"))
    assert 0 < result["shared_bytes"] <= SMEM_BYTES
    assert {"stack_bytes", "spill_store_bytes", "spill_load_bytes"} <= result.keys()
    steps = [loop for loop in result["loops"] if loop["inner"] and loop["mma"] == 8]
    assert len(steps) == 2, result["loops"]  # one per consumer partition
    for loop in steps:
        assert (loop["fmul"], loop["ffma"]) == (128, 128), loop
    assert "QGMMA" in listing


SPIN = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0xf, 0x100 ;
        /*0020*/               @P1 BRA 0x10 ;
        /*0030*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24 ;
        /*0040*/              @!P0 BRA 0x10 ;
        /*0050*/                   EXIT ;
"""


def test_a_spin_loop_inside_leaves_the_step_loop_innermost():
    """A loop that only waits (a named barrier in a one-trip loop) does not hide the loop around it."""
    loops = kernel_sass.sass_loops(SPIN)
    assert [(loop["start"], loop["end"], loop["inner"]) for loop in loops] == [("0x10", "0x20", True),
                                                                             ("0x10", "0x40", True)]
