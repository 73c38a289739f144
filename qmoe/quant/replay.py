"""What a recomputed forward (activation checkpointing) must see as the first forward saw it.

`qmoe.checkpoint` runs a function twice: in the forward, and again in the backward to rebuild
what the forward did not keep. The second run must quantize with the scales the first one used
(delayed scaling's scales move when the autocast region exits, before the backward), record no
amax a second time, and redo no in-place state update (the router's expert bias). The first run
keeps those values in a `ForwardLog`, in call order, and the recompute reads them back in the
same order: the same code path asks for them in the same sequence.

This layer holds the log and the list of regions a recompute re-enters; `qmoe.checkpoint` opens
the log, the quantizers and the router read it, and `qmoe.autocast` registers its recipe region
(`register_region`), so checkpoint and autocast stay independent of each other. An op that
rebuilds part of its own forward in its backward (grouped_linear's recompute_activation) opens a
log of its own around that part, nested in the checkpoint's when there is one.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import torch

_LOG: contextvars.ContextVar["ForwardLog | None"] = contextvars.ContextVar("qmoe_forward_log", default=None)


class ForwardLog:
    """Values the first forward used, replayed in order by the recompute.

    Entries are (owner, value): the owner (a delayed-scaling state, a router) is checked at
    replay, so a recompute that takes another path fails loudly instead of using wrong values.

    parent: the log active where this one opens (or None). A log opened inside another (an
    op that recomputes part of its own forward in its backward, run inside `qmoe.checkpoint`)
    takes its values from the parent, which keeps or replays them as it does its own: the
    values stay the first forward's however many recomputes sit in between.
    """

    def __init__(self, parent: "ForwardLog | None" = None):
        self.parent = parent
        self.entries: list[tuple[object, object]] = []
        self.replaying = False
        self._next = 0
        self.side_outputs: list = []  # modules whose `aux_loss` must leave a reentrant checkpoint

    def note_side_output(self, module) -> None:
        """`module.aux_loss` is a result of the checkpointed function too (noted by the first run)."""
        if not self.replaying and all(m is not module for m in self.side_outputs):
            self.side_outputs.append(module)

    def keep(self, owner: object, make: Callable[[], object]):
        """First run: `make()` (a copy of the value in force), remembered. Recompute: that copy."""
        if not self.replaying:
            value = make() if self.parent is None else self.parent.keep(owner, make)
            self.entries.append((owner, value))
            return value
        if self._next >= len(self.entries) or self.entries[self._next][0] is not owner:
            raise RuntimeError("qmoe.checkpoint: the recomputed forward asked for other state than the first "
                               "forward did (another path through the qmoe modules); the checkpointed function "
                               "must make the same qmoe calls each time it runs")
        value = self.entries[self._next][1]
        self._next += 1
        return value

    def start_replay(self) -> None:
        self.replaying, self._next = True, 0

    def recomputing(self) -> bool:
        """Whether this log or one it draws from replays (the run repeats a forward already done)."""
        log = self
        while log is not None:
            if log.replaying:
                return True
            log = log.parent
        return False


def active_log() -> ForwardLog | None:
    """The log of the checkpointed forward running here, or None (always None in compiled code, which
    cannot read a ContextVar: qmoe.checkpoint runs eagerly)."""
    if torch.compiler.is_compiling():
        return None
    return _LOG.get()


def recomputing() -> bool:
    """True inside `qmoe.checkpoint`'s recompute: record no amax, update no state."""
    log = active_log()
    return log is not None and log.recomputing()


# (capture, restore): capture() -> token at the checkpointed call, restore(token) -> a context manager
_REGIONS: list[tuple[Callable[[], object], Callable[[object], contextlib.AbstractContextManager]]] = []


def register_region(capture: Callable[[], object],
                    restore: Callable[[object], contextlib.AbstractContextManager]) -> None:
    """A region state (e.g. qmoe.autocast's recipe) a recompute must run under as the forward did."""
    _REGIONS.append((capture, restore))


def capture_regions() -> list[tuple[Callable, object]]:
    return [(restore, capture()) for capture, restore in _REGIONS]


@contextlib.contextmanager
def restored_regions(captured: list[tuple[Callable, object]]):
    with contextlib.ExitStack() as stack:
        for restore, token in captured:
            stack.enter_context(restore(token))
        yield


@contextlib.contextmanager
def using_log(log: ForwardLog | None):
    """Make `log` the active log inside the block (None: no log, as outside any checkpoint)."""
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)
