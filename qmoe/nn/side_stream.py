"""Run part of a module's forward on a second CUDA stream, overlapped with the rest.

`MoELayer(overlap_shared_experts=True)` runs its shared experts this way while the current stream
routes, permutes and multiplies the routed experts. The rules are PyTorch's CUDA stream semantics:
- fork: the side stream waits on an event recorded on the current stream, so it sees every input
  the current stream produced; each input records the side stream (`Tensor.record_stream`), so
  the caching allocator does not hand its memory to later work of the current stream (the
  backward included, which reads saved inputs on the side stream again) before the side stream
  is done with it;
- join: the current stream waits on an event recorded on the side stream before using the
  outputs, which record the current stream for the same reason.
Inside a CUDA-graph capture these event waits fork the side stream from the capturing stream and
join it back, as capture requires, so the overlap is captured too. Autograd runs each op's backward
on the stream its forward ran on and synchronises streams where gradients cross them (and the
caller's stream with the streams that produced leaf gradients), so the backward overlaps the same way.
"""
from __future__ import annotations

import torch

from qmoe.contracts.validate import cuda_index

# One side stream per device index, made on first use and kept (a stream per call would defeat the
# allocator's per-stream caching, and a module holding one could neither be copied nor pickled).
_STREAMS: dict[int, torch.cuda.Stream] = {}


class SideStream:
    """A fork/join pair around work run on a device's side stream; see the module docstring.

    >>> side = SideStream(x.device)
    >>> y = side.run(f, x)      # f(x) queued on the side stream after x's producers
    >>> ...                     # the current stream goes on meanwhile
    >>> y = side.join(y)        # the current stream waits for f before reading y
    """

    def __init__(self, device: torch.device):
        index = cuda_index(device)
        stream = _STREAMS.get(index)
        if stream is None:
            stream = _STREAMS[index] = torch.cuda.Stream(device=index)
        self.stream = stream
        self.main = torch.cuda.current_stream(index)

    def run(self, fn, *inputs: torch.Tensor):
        """fn(*inputs) on the side stream, forked from the current stream (an event, no host sync)."""
        self.stream.wait_stream(self.main)
        for t in inputs:
            t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            return fn(*inputs)

    def join(self, output: torch.Tensor) -> torch.Tensor:
        """`output`, once the current stream has waited for the side stream's work (an event)."""
        self.main.wait_stream(self.stream)
        output.record_stream(self.main)
        return output


def side_stream_for(device: torch.device) -> SideStream | None:
    """A SideStream on CUDA devices, None elsewhere (and while torch.compile traces: it orders the
    graph's streams itself), where the work runs in line."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return None
    return SideStream(device)
