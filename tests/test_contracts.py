"""qmoe.contracts: the enums parse their public strings once, and the one split-size validator
holds one rule set whatever the caller."""
import pytest
import torch

from qmoe.contracts.carriers import ACTIVATIONS, GLU_ACTIVATIONS
from qmoe.contracts.enums import (Activation, GemmRoute, GroupedPath, ScoreFunction, parse_activation,
                                  parse_gemm_route, parse_grouped_path, parse_score_function)
from qmoe.contracts.validate import check_split_sizes


@pytest.mark.parametrize("parse, cls, name", [(parse_activation, Activation, "activation"),
                                              (parse_score_function, ScoreFunction, "score_function"),
                                              (parse_grouped_path, GroupedPath, "grouped_path"),
                                              (parse_gemm_route, GemmRoute, "route")])
def test_enums_parse_their_strings_and_name_the_argument(parse, cls, name):
    for member in cls:
        assert parse(member.value) is member and parse(member) is member
        assert member == member.value and f"{member}" == member.value  # plain strings keep working
    for bad in ("nope", 3, None, ["auto"]):
        with pytest.raises(ValueError, match=rf"{name}=.* is unknown; use one of"):
            parse(bad)


def test_activation_constants_follow_the_enum():
    assert ACTIVATIONS == ("swiglu", "geglu", "clamped_qgeglu", "relu2", "gelu")  # kernels index this order
    assert GLU_ACTIVATIONS == tuple(a.value for a in Activation if a.is_glu)


CPU = torch.device("cpu")


@pytest.mark.parametrize("splits, kw, error, match", [
    ([1, 2, 3], {}, None, None),
    (torch.tensor([1, 2, 3], dtype=torch.int32), {}, None, None),
    ([1, -1, 6], {}, ValueError, "non-negative"),
    ([1, 2, 2], {}, ValueError, "sum to 5 but the input has 6 rows"),
    ([1, 2, 2], {"max_rows": True}, None, None),
    ([1, 2, 4], {"max_rows": True}, ValueError, "more than the 6 rows"),
    ([1, 2, 3], {"num_groups": 4}, ValueError, "3 entries but there are 4 groups"),
    ([], {}, ValueError, "non-empty"),
    ([1.0, 5.0], {}, TypeError, "Python ints"),
    ([True, 5], {}, TypeError, "Python ints"),
    (torch.tensor([1.0, 5.0]), {}, TypeError, "int32 or int64"),
    (torch.tensor([[1, 5]]), {}, ValueError, "1-D"),
    (6, {}, TypeError, "list of ints or an integer tensor"),
    ([1, 2, 3], {"on_device": True}, TypeError, "tensor"),
    (torch.tensor([1, 2, 3], device="meta"), {}, ValueError, "same device"),
    (torch.tensor([1, -1, 6]), {"read": "never"}, None, None),
])
def test_split_sizes_one_rule_set(splits, kw, error, match):
    kw = {"device": CPU, "num_rows": 6, **kw}
    if error is None:
        check_split_sizes(splits, **kw)
    else:
        with pytest.raises(error, match=match):
            check_split_sizes(splits, **kw)


def test_split_sizes_read_modes():
    host = torch.tensor([2, 4])
    assert check_split_sizes(host, device=CPU, num_rows=6) == [2, 4]
    assert check_split_sizes(host, device=CPU, num_rows=6, read="never") is None
    assert check_split_sizes([2, 4], device=CPU, num_rows=6, read="always") == [2, 4]
    with pytest.raises(ValueError, match="read="):
        check_split_sizes(host, device=CPU, read="sometimes")
