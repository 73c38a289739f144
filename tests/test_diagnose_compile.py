"""benchmarks/diagnose_compile.py pairs op calls by occurrence and names where a run departs."""
import torch

from benchmarks.diagnose_compile import _snapshot, compare


def _call(name, args, out):
    return name, _snapshot(list(args)), _snapshot(out)


def test_compare_names_the_first_departure():
    x, y = torch.arange(6.0).view(2, 3), torch.ones(3)
    eager = [_call("qmoe::a", [x], y), _call("qmoe::b", [y, 2], x), _call("qmoe::b", [y, 3], x)]
    compiled = [_call("qmoe::b", [y, 2], x),  # another order: paired by (op, occurrence), not by position
                _call("qmoe::a", [x], y + 1),
                _call("qmoe::b", [y, 3], x.t().contiguous().t())]
    lines = compare(eager, compiled)
    assert len(lines) == 2, lines
    assert lines[0].startswith("qmoe::a call 0: equal inputs, OUTPUTS differ: out: max diff 1")
    assert lines[1].startswith("qmoe::b call 1: equal inputs, OUTPUTS differ: out: equal values, strides (3, 1) vs (1, 2)")


def test_compare_reports_different_inputs_and_missing_calls():
    x = torch.zeros(4)
    eager = [_call("qmoe::a", [x, 1], x), _call("qmoe::c", [x], x)]
    compiled = [_call("qmoe::a", [x + 2, 1], x)]
    lines = compare(eager, compiled)
    assert lines[0].startswith("qmoe::a call 0: INPUTS differ: arg[0]: max diff 2 at (0,), 4 of 4 differ")
    assert lines[1] == "qmoe::c call 0: not called by the compiled run"
    assert compare(eager, eager) == []
