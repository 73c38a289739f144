"""Router inputs shared by the reference tests, the interpreter tests and the GPU tests.

`router_cases` draws (logits [T, E], top_k, topk_route keyword arguments) on the CPU, so a
seed gives the same numbers on any machine: every score function and option, fp32 or bf16
logits, and kinds of values that break selection rules: exact ties, one dominant expert,
-inf columns, and NaN / +inf / -inf sprinkled over rows (whole rows of one value included),
with NaN or inf in `expert_bias` too.
"""
import torch
from hypothesis import strategies as st

INF = float("inf")
NAN = float("nan")
SPECIALS = (NAN, INF, -INF)


def sprinkle_non_finite(logits: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """A copy with about `fraction` of the entries NaN, +inf or -inf (a third each), and, when
    there are at least 3 rows, row 0 all NaN, row 1 all +inf and row 2 all -inf."""
    gen = torch.Generator().manual_seed(seed)
    pick = torch.rand(logits.shape, generator=gen)
    out = logits.clone()
    for i, value in enumerate(SPECIALS):
        out[(pick >= i * fraction / 3) & (pick < (i + 1) * fraction / 3)] = value
    if len(out) >= 3:
        for row, value in enumerate(SPECIALS):
            out[row] = value
    return out


@st.composite
def router_cases(draw, non_finite=True):
    """(logits, top_k, kwargs) for `topk_route`; `non_finite=False` draws finite values only."""
    e = draw(st.sampled_from([4, 6, 8, 16]))
    t = draw(st.integers(1, 12))
    k = draw(st.integers(1, e))
    fn = draw(st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]))
    pre = fn == "softmax" and draw(st.booleans())
    kw = dict(score_function=fn, pre_softmax=pre)
    if fn != "softmax" or pre:
        kw["normalize_topk_probs"] = draw(st.sampled_from([None, True, False]))
    groups = [g for g in (2, 4) if e % g == 0 and draw(st.booleans())]
    if groups:
        g = groups[0]
        score_topk = draw(st.sampled_from([None] + list(range(1, e // g + 1))))
        gk = draw(st.sampled_from([d for d in range(1, g + 1)
                                   if (score_topk is not None or k % d == 0) and d * (e // g) >= k] or [None]))
        if gk is not None:
            kw.update(num_groups=g, group_topk=gk, group_score_topk=score_topk)
    if draw(st.booleans()):
        kw["expert_bias"] = torch.tensor(draw(st.lists(st.floats(-2, 2), min_size=e, max_size=e)))
    if draw(st.booleans()):
        kw["scaling_factor"] = draw(st.floats(0.5, 4))
    kinds = ["random", "ties", "one_expert", "inf_columns"] + (["non_finite"] * 2 if non_finite else [])
    kind = draw(st.sampled_from(kinds))
    seed = draw(st.integers(0, 99))
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(seed))
    if kind == "ties":
        # non-negative: sigmoid(x) + sigmoid(-x) == 1 would make group scores tie only up to
        # rounding, where kernel and reference may round apart
        logits = logits.abs().round()
    elif kind == "one_expert":
        logits[:, draw(st.integers(0, e - 1))] = 20.0
    elif kind == "inf_columns":
        logits[:, 0] = -INF
    elif kind == "non_finite":
        logits = sprinkle_non_finite(logits, draw(st.sampled_from([0.1, 0.5])), seed)
        if "expert_bias" in kw and draw(st.booleans()):
            kw["expert_bias"][draw(st.integers(0, e - 1))] = draw(st.sampled_from(SPECIALS))
    logits = logits.to(draw(st.sampled_from([torch.float32, torch.bfloat16])))
    return logits, k, kw
