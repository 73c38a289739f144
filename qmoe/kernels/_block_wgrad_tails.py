"""How the FP8 block wgrad (`_block_wgrad_ws.py`) loads the steps of a token group that a TMA box
of the whole operand cannot: the group's partial last step, and every step of a group that starts
off 16 bytes (private helper of that module).

A group's tokens start anywhere (groups are padded to the recipe's `align_size`, not to 128), so
its last step may be partial, and a TMA box of the whole operand runs on into the next group's
tokens there. TAIL picks how those tokens become zeros; the same bits either way:
- "desc": the producer loads the partial step through descriptors of the group's own tokens,
  made on the device once per group (`tma.make_tensor_descriptor`), and TMA fills the box past
  the group's end with zeros, as it does past a tensor's end: the step costs what a full one
  does. A program keeps two pairs and alternates between them, and before it rewrites one it
  waits until the last load through it has landed: a load still in flight may read its
  descriptor late.
- "loads": the consumers read that step themselves, masked loads of their A rows and of the
  whole B tile into private buffers.
A group that starts on 16 bytes but off 32 makes each 128-byte box row touch five 32-byte sectors
instead of four, which slows the loads; with LEAD = 32 (or 64, 128: the box rows then fall in fewer
128-byte lines) the "desc" producer starts such a group's steps at the LEAD-token boundary before
it, at a negative coordinate of its own descriptors, and TMA fills the tokens before the group with
zeros as it does those past its end. This moves where the 128-token steps fall, so only per-tensor
scaling (one fp32 sum over all steps) may use it; the block wgrad's steps are its scale blocks.
A TMA load that starts off a 16-byte boundary stops the GPU with an illegal instruction
(docs/performance.md, block wgrad), so a group that starts off one (an `align_size` that is not
a multiple of 16) takes every step through masked loads: correct, slower.
"""
from __future__ import annotations

from qmoe.kernels._gluon_sm90 import gluon

TAILS = {"loads": 0, "desc": 1}  # the kernel's TAIL values, by name

if gluon is not None:
    from qmoe.kernels._gluon_sm90 import gl, mbarrier, tma

    # TAIL: how the partial last step of a group reads zeros past the group's end (module docstring)
    TAIL_LOADS = gl.constexpr(0)
    TAIL_DESC = gl.constexpr(1)

    @gluon.jit
    def lead(start, length, TAIL: gl.constexpr, LEAD: gl.constexpr):
        """Zeros ahead of the group's first token in its first step: under TAIL_DESC with LEAD > 16,
        the steps of a group start at the LEAD-token boundary before its first token (module
        docstring); none otherwise, and none for an empty group (no steps, no descriptors: a
        descriptor of no tokens is invalid)."""
        if TAIL == TAIL_DESC and LEAD > 16:
            return gl.where(length > 0, start % LEAD, 0)
        return start * 0

    @gluon.jit
    def tma_steps(start, length, BK: gl.constexpr, TAIL: gl.constexpr, LEAD: gl.constexpr = 16):
        """The group's steps that go through the TMA ring (the producer loads, the consumers take):
        its full steps, and under TAIL_DESC its partial last one (and the zeros of its `lead`);
        none for a group starting off 16 bytes, which TMA cannot load."""
        n = length // BK
        if TAIL == TAIL_DESC:
            n = gl.cdiv(length + lead(start, length, TAIL, LEAD), BK)
        return gl.where(start % 16 == 0, n, 0)

    @gluon.jit
    def group_descs(a_ptr, b_ptr, start, length, N, K, stride_an, stride_bk, a_desc, b_desc):
        """TMA descriptors of A's and B's tokens of one group (a_ptr, b_ptr: the codes as bytes):
        boxes read zeros past its end."""
        a_codes = a_ptr.to(gl.pointer_type(a_desc.dtype), bitcast=True)
        b_codes = b_ptr.to(gl.pointer_type(b_desc.dtype), bitcast=True)
        ga = tma.make_tensor_descriptor(a_codes + start, [N, length], [stride_an, 1], a_desc.block_type.shape,
                                        a_desc.layout)
        gb = tma.make_tensor_descriptor(b_codes + start, [K, length], [stride_bk, 1], b_desc.block_type.shape,
                                        b_desc.layout)
        return ga, gb

    @gluon.jit
    def landed(full, last, it, STAGES: gl.constexpr):
        """Wait until load `last` has landed, unless it is no load (-1) or a later load into its
        stage was issued (`it`: the next load): the producer issues one only after the consumers
        released the stage, so `last` landed. Until then its barrier still holds `last`'s phase."""
        if last >= 0 and it - last <= STAGES:
            mbarrier.wait(full.index(last % STAGES), (last // STAGES) & 1)

    @gluon.jit
    def _tail_operand(ptr, rows, n_rows, t0, tail, stride_r, R: gl.constexpr, BK: gl.constexpr,
                      layout: gl.constexpr, DTYPE: gl.constexpr):
        """[R, BK] codes of rows `rows..` at tokens t0.., zero past `tail` tokens or n_rows rows.

        ptr: the codes as bytes. Loads whole 16-token chunks (one vector each; the chunk holding
        the group's end stays inside the data, whose token count is a multiple of 16), zeroes the
        tokens past the end as integers, then reinterprets the bytes as DTYPE.
        """
        r = rows + gl.arange(0, R, layout=gl.SliceLayout(1, layout))
        c = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
        ptrs = ptr + gl.expand_dims(r.to(gl.int64) * stride_r, 1) + gl.expand_dims(t0 + c, 0)
        row_ok = gl.expand_dims(r < n_rows, 1)
        x = gl.load(ptrs, mask=row_ok & gl.expand_dims((c // 16) * 16 < tail, 0), other=0)
        x = gl.where(row_ok & gl.expand_dims(c < tail, 0), x, 0)
        return x.to(DTYPE, bitcast=True)

    @gluon.jit
    def tail_to_smem(ptr, smem, rows, n_rows, t0, tail, stride_r, layout: gl.constexpr):
        """The tail step's [R, BK] operand rows into `smem`, 32 rows at a time (few registers)."""
        R: gl.constexpr = smem.shape[0]
        BK: gl.constexpr = smem.shape[1]
        for i in gl.static_range(R // 32):
            smem.slice(i * 32, 32).store(_tail_operand(ptr, rows + i * 32, n_rows, t0, tail, stride_r, 32, BK,
                                                       layout, smem.dtype))
