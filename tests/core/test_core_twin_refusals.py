"""Bad input to a core step gets the SAME refusal from every implementation of that step: the
whole-batch function, its row-block twin (:mod:`refppo.core.by_rows`) and its naive twin.

Each case feeds one bad input (a doubly bad one where the order of the checks matters) to every
implementation and asserts each raises the project's own error (a :class:`RefPPOError` subclass)
of one class with one message: a twin that skips a check (and computes on garbage), checks in
another order, or names the argument differently fails here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from refppo.core.by_rows import policy_loss_by_rows, value_loss_by_rows
from refppo.core.grad import kl_loss_grad_naive, policy_grad_naive, value_grad_naive
from refppo.core.group import group_scalar_advantages
from refppo.core.gspo import gspo_policy_grad_naive, gspo_policy_loss, gspo_policy_loss_naive
from refppo.core.helpers_naive import group_scalar_advantages_naive
from refppo.core.policy import clipped_policy_loss, clipped_policy_loss_naive
from refppo.core.value import value_loss, value_loss_naive
from refppo.errors import RefPPOError

F64, F32 = torch.float64, torch.float32
NAN, INF = math.nan, math.inf


def _refusal(call: Callable[[], object]) -> tuple[type[BaseException], str]:
    """The error ``call`` raises (class, message); fails the test when it raises none."""
    try:
        call()
    except Exception as e:
        return type(e), str(e)
    raise AssertionError("accepted a bad input (no error)")


def _same_refusal(calls: dict[str, Callable[[], object]]) -> tuple[type[BaseException], str]:
    got = {name: _refusal(call) for name, call in calls.items()}
    first = next(iter(got.values()))
    assert issubclass(first[0], RefPPOError), got
    assert all(g == first for g in got.values()), got
    return first


def _bt(B: int = 3, T: int = 4) -> dict[str, Any]:
    """Good inputs: a ragged mask and float64 log-probs, advantages, values."""
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)[:B, :T]
    lp_old = -torch.rand(B, T, generator=g, dtype=F64) - 0.1
    return {
        "logp": lp_old + 0.1 * torch.randn(B, T, generator=g, dtype=F64),
        "logp_old": lp_old,
        "advantages": torch.randn(B, T, generator=g, dtype=F64),
        "mask": mask,
    }


# ---- the clipped surrogate: whole batch, by rows, naive (fin1 #2) -----------------------------

POLICY_BAD: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # (id, tensor overrides, keyword overrides)
    ("clip_low<0 & logp f32", {"logp": F32}, {"clip_low": -1.0}),
    ("clip_low>1", {}, {"clip_low": 1.5}),
    ("clip_low=nan", {}, {"clip_low": NAN}),
    ("clip_high<0", {}, {"clip_high": -0.1}),
    ("clip_high=inf & agg bogus", {}, {"clip_high": INF, "agg": "bogus"}),
    ("dual_clip=1", {}, {"dual_clip": 1.0}),
    ("dual_clip=nan & logp_old f32", {"logp_old": F32}, {"dual_clip": NAN}),
    ("agg bogus & logp f32", {"logp": F32}, {"agg": "bogus"}),
    ("log_ratio_clamp=0", {}, {"log_ratio_clamp": 0.0}),
    ("log_ratio_clamp=nan & adv f32", {"advantages": F32}, {"log_ratio_clamp": NAN}),
    ("adv f32", {"advantages": F32}, {}),
    ("logp_old f32", {"logp_old": F32}, {}),
    ("logp int & logp_old f32", {"logp": torch.int64, "logp_old": F32}, {}),
    ("adv shape & clip_low<0", {"advantages": "short"}, {"clip_low": -1.0}),
    ("mask 2", {"mask": "two"}, {}),
    ("mask empty row & clip_low<0", {"mask": "empty"}, {"clip_low": -1.0}),
    ("token_count=0", {}, {"token_count": 0.0}),
    ("horizon=nan", {}, {"horizon": NAN, "agg": "seq-mean-token-sum-norm"}),
]


def _apply(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if v == "short":
            out[k] = base[k][:, :-1]
        elif v == "two":
            out[k] = base[k].to(torch.int64) * 2
        elif v == "empty":
            m = base[k].clone()
            m[1] = False
            out[k] = m
        else:
            out[k] = base[k].to(v)
    return out


@pytest.mark.parametrize(
    ("tensors", "kw"), [(t, k) for _, t, k in POLICY_BAD], ids=[i for i, _, _ in POLICY_BAD]
)
def test_policy_loss_refusals_are_identical(tensors: dict[str, Any], kw: dict[str, Any]) -> None:
    x = _apply(_bt(), tensors)
    args = (x["logp"], x["logp_old"], x["advantages"], x["mask"])
    _same_refusal(
        {
            "whole": lambda: clipped_policy_loss(*args, **kw),
            "rows=1": lambda: policy_loss_by_rows(1, *args, **kw),
            "rows=2": lambda: policy_loss_by_rows(2, *args, **kw),
            "naive": lambda: clipped_policy_loss_naive(*args, **kw),
            "grad naive": lambda: policy_grad_naive(*args, **kw),
        }
    )


def test_policy_doubly_bad_input_names_the_clip_first() -> None:
    # fin1 #2: by_rows checked the dtypes first (DtypeError), the whole batch the clip
    x = _apply(_bt(), {"logp": F32})
    args = (x["logp"], x["logp_old"], x["advantages"], x["mask"])
    cls, msg = _same_refusal(
        {
            "whole": lambda: clipped_policy_loss(*args, clip_low=-1.0),
            "rows": lambda: policy_loss_by_rows(1, *args, clip_low=-1.0),
        }
    )
    assert cls.__name__ == "HyperparameterError" and msg.startswith("clip_low:"), msg


# ---- GSPO: whole batch, by rows (gspo=True), naive loss and naive gradient --------------------

GSPO_BAD = [
    (i, t, {("log_ratio_max" if k == "log_ratio_clamp" else k): v for k, v in kw.items()})
    for i, t, kw in POLICY_BAD
    if "dual_clip" not in kw
] + [("log_ratio_max<0 & clip_low<0", {}, {"log_ratio_max": -1.0, "clip_low": -1.0})]


@pytest.mark.parametrize(("tensors", "kw"), [(t, k) for _, t, k in GSPO_BAD], ids=[i for i, _, _ in GSPO_BAD])
def test_gspo_loss_refusals_are_identical(tensors: dict[str, Any], kw: dict[str, Any]) -> None:
    x = _apply(_bt(), tensors)
    args = (x["logp"], x["logp_old"], x["advantages"], x["mask"])
    rows_kw = {("log_ratio_clamp" if k == "log_ratio_max" else k): v for k, v in kw.items()}
    _same_refusal(
        {
            "whole": lambda: gspo_policy_loss(*args, **kw),
            "rows": lambda: policy_loss_by_rows(1, *args, gspo=True, **rows_kw),
            "naive": lambda: gspo_policy_loss_naive(*args, **kw),
            "grad naive": lambda: gspo_policy_grad_naive(*args, **kw),
        }
    )


def test_gspo_by_rows_names_the_clamp_log_ratio_max() -> None:
    # fin1 #2: by_rows said `log_ratio_clamp` where gspo_policy_loss says `log_ratio_max`
    x = _bt()
    args = (x["logp"], x["logp_old"], x["advantages"], x["mask"])
    _, msg = _same_refusal(
        {
            "whole": lambda: gspo_policy_loss(*args, log_ratio_max=-1.0),
            "rows": lambda: policy_loss_by_rows(1, *args, gspo=True, log_ratio_clamp=-1.0),
            "grad naive": lambda: gspo_policy_grad_naive(*args, log_ratio_max=-1.0),
        }
    )
    assert msg.startswith("log_ratio_max:"), msg


# ---- the value loss: whole batch, by rows, naive -----------------------------------------------

VALUE_BAD: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("clip<0", {}, {"clip": -0.5}),
    ("clip None", {}, {"clip": None}),
    ("clip=nan & returns f32", {"returns": F32}, {"clip": NAN}),
    ("kind bogus", {}, {"kind": "bogus"}),
    ("clip_form bogus", {}, {"clip_form": "bogus"}),
    ("agg bogus & values f32", {"values": F32}, {"agg": "bogus"}),
    ("values_old f32", {"values_old": F32}, {}),
    ("mask 2", {"mask": "two"}, {}),
    ("seq_count<0", {}, {"seq_count": -1.0, "agg": "seq-mean-token-mean"}),
]


@pytest.mark.parametrize(
    ("tensors", "kw"), [(t, k) for _, t, k in VALUE_BAD], ids=[i for i, _, _ in VALUE_BAD]
)
def test_value_loss_refusals_are_identical(tensors: dict[str, Any], kw: dict[str, Any]) -> None:
    b = _bt()
    base = {"values": b["logp"], "values_old": b["logp_old"], "returns": b["advantages"], "mask": b["mask"]}
    x = _apply(base, tensors)
    args = (x["values"], x["values_old"], x["returns"], x["mask"])
    _same_refusal(
        {
            "whole": lambda: value_loss(*args, **kw),
            "rows": lambda: value_loss_by_rows(1, *args, **kw),
            "naive": lambda: value_loss_naive(*args, **kw),
            "grad naive": lambda: value_grad_naive(*args, **kw),
        }
    )


# ---- group scalar advantages: the lengths of `opo` (fin1 #4) ----------------------------------

LENGTHS_BAD = [
    [3.0, NAN, 2.0, 4.0],
    [3.0, INF, 2.0, 4.0],
    [3.0, -2.0, 2.0, 4.0],
    [3.0, 0.0, 2.0, 4.0],
    [3.0, 2.5, 2.0, 4.0],
]


@pytest.mark.parametrize("estimator", ["opo", "grpo"])
@pytest.mark.parametrize("lengths", LENGTHS_BAD, ids=["nan", "inf", "negative", "zero", "fraction"])
def test_group_lengths_that_are_not_counts_are_refused(lengths: list[float], estimator: str) -> None:
    s = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=F64)
    g = torch.tensor([0, 0, 1, 1])
    L = torch.tensor(lengths, dtype=F64)
    cls, msg = _same_refusal(
        {
            "core": lambda: group_scalar_advantages(s, g, estimator=estimator, lengths=L),
            "naive": lambda: group_scalar_advantages_naive(s, g, estimator=estimator, lengths=L),
        }
    )
    assert cls.__name__ == "MaskError" and msg.startswith("lengths:") and "at row 1" in msg, msg


def test_group_lengths_good_counts_still_give_opo() -> None:
    # the check refuses nothing a mask could give: whole counts >= 1, any float dtype
    s = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=F64)
    g = torch.tensor([0, 0, 1, 1])
    L = torch.tensor([3.0, 1.0, 2.0, 4.0], dtype=F64)
    a = group_scalar_advantages(s, g, estimator="opo", lengths=L)
    # by hand: group 0 mean (3·1 + 1·0)/4 = 0.75, group 1 (2·0.5 + 4·2)/6 = 1.5
    assert torch.equal(a, torch.tensor([0.25, -0.75, -1.0, 0.5], dtype=F64))
    assert group_scalar_advantages_naive(s, g, estimator="opo", lengths=L) == [0.25, -0.75, -1.0, 0.5]


def test_group_lengths_as_integer_counts_are_accepted_under_every_estimator() -> None:
    # rev6 STD-2: `mask.sum(1)` (int64) is the natural count; it was a DtypeError under every
    # estimator. Integer counts now give what the same counts as floats give (core and twin).
    s = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=F64)
    g = torch.tensor([0, 0, 1, 1])
    L = torch.tensor([3.0, 1.0, 2.0, 4.0], dtype=F64)
    from refppo.core._group_checks import GROUP_ESTIMATORS

    for estimator in [e.value for e in GROUP_ESTIMATORS] + ["flash-reinforce"]:
        want = group_scalar_advantages(s, g, estimator=estimator, lengths=L)
        want_naive = group_scalar_advantages_naive(s, g, estimator=estimator, lengths=L)
        for dtype in (torch.int64, torch.int32):
            got = group_scalar_advantages(s, g, estimator=estimator, lengths=L.to(dtype))
            assert got.dtype == F64 and torch.equal(got, want), (estimator, dtype)
            got_naive = group_scalar_advantages_naive(s, g, estimator=estimator, lengths=L.to(dtype))
            assert got_naive == want_naive, (estimator, dtype)
    # by hand (opo): group 0 mean (3·1 + 1·0)/4 = 0.75, group 1 (2·0.5 + 4·2)/6 = 1.5
    got = group_scalar_advantages(s, g, estimator="opo", lengths=torch.tensor([3, 1, 2, 4]))
    assert torch.equal(got, torch.tensor([0.25, -0.75, -1.0, 0.5], dtype=F64))


INT_LENGTHS_BAD = [
    (torch.tensor([3, 0, 2, 4]), "MaskError"),
    (torch.tensor([3, -1, 2, 4], dtype=torch.int32), "MaskError"),
    (torch.tensor([True, True, True, True]), "DtypeError"),
]


@pytest.mark.parametrize("estimator", ["opo", "grpo"])
@pytest.mark.parametrize(("L", "cls_name"), INT_LENGTHS_BAD, ids=["int64 zero", "int32 negative", "bool"])
def test_group_lengths_integer_zero_and_bool_are_refused(
    estimator: str, L: torch.Tensor, cls_name: str
) -> None:
    s = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=F64)
    g = torch.tensor([0, 0, 1, 1])
    cls, msg = _same_refusal(
        {
            "core": lambda: group_scalar_advantages(s, g, estimator=estimator, lengths=L),
            "naive": lambda: group_scalar_advantages_naive(s, g, estimator=estimator, lengths=L),
        }
    )
    assert cls.__name__ == cls_name and msg.startswith("lengths:"), msg


# ---- token_kl's log_ratio_clamp that is not a pair (rev6 STD-1) -------------------------------

KL_CLAMP_BAD: list[tuple[str, object]] = [
    ("scalar", 0.5),
    ("one-tuple", (0.5,)),
    ("triple", (-1.0, 0.0, 1.0)),
    ("string bound", ("a", 1.0)),
    ("bool bound", (-1.0, True)),
]


@pytest.mark.parametrize("clamp", [c[1] for c in KL_CLAMP_BAD], ids=[c[0] for c in KL_CLAMP_BAD])
def test_kl_log_ratio_clamp_not_a_pair_is_one_hyperparameter_error(clamp: object) -> None:
    from refppo.core import kl, objective
    from refppo.core.by_rows import kl_loss_by_rows

    x = torch.linspace(-1.0, 0.0, 12, dtype=F64).reshape(3, 4)
    y, m = x.flip(1), _bt()["mask"]
    kw: dict[str, Any] = {"log_ratio_clamp": clamp}
    cls, msg = _same_refusal(
        {
            "token_kl": lambda: kl.token_kl(x, y, m, **kw),
            "token_kl_naive": lambda: kl.token_kl_naive(x, y, m, **kw),
            "kl_loss": lambda: objective.kl_loss(x, y, m, **kw),
            "kl_loss_naive": lambda: objective.kl_loss_naive(x, y, m, **kw),
            "kl_loss rows": lambda: kl_loss_by_rows(1, x, y, m, **kw),
            "kl_loss_grad_naive": lambda: kl_loss_grad_naive(x, y, m, **kw),
        }
    )
    assert cls.__name__ == "HyperparameterError" and msg.startswith("log_ratio_clamp:"), msg


# ---- every other public step against its naive twin (item 3 of the checks brief) -------------
# One table: (id, the vectorized call, the naive twin's call), each on one bad input.

_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
_X = torch.linspace(-1.0, 1.0, 12, dtype=F64).reshape(3, 4)
_EMPTY_ROW = _MASK.clone()
_EMPTY_ROW[1] = False
_TWO = _MASK.to(torch.int64) * 2
_S4 = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=F64)
_G4 = torch.tensor([0, 0, 1, 1])
_LONE = torch.tensor([0, 0, 1, 2])  # prompts 1 and 2 have one response each
_M4 = torch.ones(4, 3, dtype=torch.bool)
_ONE_TOKEN = torch.ones(1, 1, dtype=torch.bool)


def _group_cases() -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    from refppo.core import group as gr
    from refppo.core import group_naive as gn

    def adv(**kw: Any) -> tuple[Callable[[], object], Callable[[], object]]:
        a = {"scores": _S4, "group_index": _G4, "mask": _M4}
        a.update(kw)
        s, g, m = a.pop("scores"), a.pop("group_index"), a.pop("mask")
        return (lambda: gr.group_advantages(s, g, m, **a)), (lambda: gn.group_advantages_naive(s, g, m, **a))

    def scalar(**kw: Any) -> tuple[Callable[[], object], Callable[[], object]]:
        a = {"scores": _S4, "group_index": _G4}
        a.update(kw)
        s, g = a.pop("scores"), a.pop("group_index")
        return (
            lambda: gr.group_scalar_advantages(s, g, **a),
            lambda: group_scalar_advantages_naive(s, g, **a),
        )

    def rpp(x: torch.Tensor = _X, m: torch.Tensor = _MASK, **kw: Any) -> tuple[Callable[[], object], ...]:
        return (lambda: gr.reinforce_pp_advantages(x, m, **kw)), (
            lambda: gn.reinforce_pp_advantages_naive(x, m, **kw)
        )

    def ret(x: torch.Tensor = _X, m: torch.Tensor = _MASK, **kw: Any) -> tuple[Callable[[], object], ...]:
        return (lambda: gr.discounted_returns(x, m, **kw)), (lambda: gn.discounted_returns_naive(x, m, **kw))

    table: dict[str, tuple[Callable[[], object], ...]] = {
        "adv estimator bogus": adv(estimator="bogus"),
        "adv estimator gae": adv(estimator="gae"),
        "adv std_level bogus": adv(std_level="bogus"),
        "adv eps<0": adv(eps=-1.0),
        "adv singleton bogus": adv(singleton="bogus"),
        "adv lone prompts": adv(group_index=_LONE),
        "adv group_index float": adv(group_index=_G4.to(F64)),
        "adv group_index None": adv(group_index=None),
        "adv group_index short": adv(group_index=_G4[:3]),
        "adv mask 2": adv(mask=_M4.to(torch.int64) * 2),
        "adv mask empty rows": adv(mask=torch.zeros(4, 3, dtype=torch.bool)),
        "adv scores short": adv(scores=_S4[:3]),
        "adv scores int": adv(scores=_S4.to(torch.int64)),
        "adv penalty f32": adv(token_penalty=torch.zeros(4, 3)),
        "adv penalty shape & lone": adv(token_penalty=torch.zeros(4, 2, dtype=F64), group_index=_LONE),
        "adv whiten_eps<0": adv(estimator="reinforce++-baseline", whiten_eps=-1.0),
        "adv whiten_eps_form bogus": adv(whiten_eps_form="bogus"),
        "adv passk score lone": adv(estimator="grpo-passk", singleton="score", group_index=_LONE),
        "scalar lone prompts": scalar(group_index=_LONE),
        "scalar group_index float": scalar(group_index=_G4.to(F64)),
        "scalar group_index short": scalar(group_index=_G4[:3]),
        "scalar group_index None": scalar(group_index=None),
        "scalar flash group_index short": scalar(estimator="flash-reinforce", group_index=_G4[:3]),
        "scalar scores int": scalar(scores=_S4.to(torch.int64)),
        "scalar scores empty": scalar(scores=_S4[:0], group_index=_G4[:0]),
        "scalar lengths short": scalar(estimator="opo", lengths=_S4[:3]),
        "scalar lengths None under opo": scalar(estimator="opo"),
        "scalar eps nan": scalar(eps=NAN),
        "rpp gamma>1": rpp(gamma=1.5),
        "rpp whiten_eps<0": rpp(whiten_eps=-1.0),
        "rpp whiten_eps_form bogus": rpp(whiten_eps_form="bogus"),
        "rpp holes bogus": rpp(holes="bogus"),
        "rpp one valid token": rpp(x=torch.ones(1, 1, dtype=F64), m=_ONE_TOKEN),
        "rpp mask 2": rpp(m=_TWO),
        "returns gamma nan": ret(gamma=NAN),
        "returns holes bogus": ret(holes="bogus"),
        "returns int rewards": ret(x=_X.to(torch.int64)),
        "returns empty row": ret(m=_EMPTY_ROW),
        "returns f32 rewards & gamma<0": ret(x=_X.to(F32), gamma=-0.5),
    }
    return [(k, *v) for k, v in table.items()]  # (id, core, twin)


GROUP_CASES = _group_cases()


@pytest.mark.parametrize(("core", "twin"), [c[1:] for c in GROUP_CASES], ids=[c[0] for c in GROUP_CASES])
def test_group_advantages_refusals_are_identical(
    core: Callable[[], object], twin: Callable[[], object]
) -> None:
    _same_refusal({"core": core, "naive": twin})


def _step_cases() -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    import importlib

    from refppo.core import helpers_naive as hn
    from refppo.core import kl, logprobs, masked, normalize, objective, rewards, score_map

    gae = importlib.import_module("refppo.core.gae")  # refppo.core re-exports the function `gae`
    x, y, m, s3 = _X, _X.flip(1), _MASK, torch.tensor([1.0, -1.0, 0.5], dtype=F64)
    logits = torch.linspace(-2.0, 2.0, 60, dtype=F64).reshape(3, 4, 5)
    tokens = torch.tensor([[0, 1, 2, 3], [4, 0, 1, 2], [3, 4, 0, 1]])

    def pair(core: Callable[..., object], twin: Callable[..., object], *a: Any, **kw: Any) -> tuple[Any, Any]:
        return (lambda: core(*a, **kw)), (lambda: twin(*a, **kw))

    table: dict[str, tuple[Any, Any]] = {}
    for name, core, twin in (
        ("sum", masked.masked_sum, masked.masked_sum_naive),
        ("mean", masked.masked_mean, masked.masked_mean_naive),
    ):
        table |= {
            f"masked_{name} dim=0": pair(core, twin, x, m, dim=0),
            f"masked_{name} mask 2": pair(core, twin, x, _TWO),
            f"masked_{name} int x": pair(core, twin, x.to(torch.int64), m),
            f"masked_{name} x short": pair(core, twin, x[:, :3], m),
        }
    table |= {
        "masked_mean empty row": pair(masked.masked_mean, masked.masked_mean_naive, x, _EMPTY_ROW),
        "masked_var one token": pair(masked.masked_var, masked.masked_var_naive, x[:1, :1], _ONE_TOKEN),
        "masked_var mask 2": pair(masked.masked_var, masked.masked_var_naive, x, _TWO),
        "masked_var empty row": pair(masked.masked_var, masked.masked_var_naive, x, _EMPTY_ROW),
        "masked_whiten empty row & eps<0": pair(
            masked.masked_whiten, masked.masked_whiten_naive, x, _EMPTY_ROW, eps=-1.0
        ),
        "masked_whiten eps<0": pair(masked.masked_whiten, masked.masked_whiten_naive, x, m, eps=-1.0),
        "masked_whiten one token": pair(
            masked.masked_whiten, masked.masked_whiten_naive, x[:1, :1], _ONE_TOKEN
        ),
        "masked_whiten int x & eps<0": pair(
            masked.masked_whiten, masked.masked_whiten_naive, x.to(torch.int64), m, eps=-1.0
        ),
        "token_kl estimator bogus": pair(kl.token_kl, kl.token_kl_naive, x, y, m, "bogus"),
        "token_kl clamp nan": pair(kl.token_kl, kl.token_kl_naive, x, y, m, log_ratio_clamp=(NAN, None)),
        "token_kl clamp lo>hi": pair(kl.token_kl, kl.token_kl_naive, x, y, m, log_ratio_clamp=(1.0, -1.0)),
        "token_kl value_clamp 0": pair(kl.token_kl, kl.token_kl_naive, x, y, m, value_clamp=0.0),
        "token_kl logp_ref f32": pair(kl.token_kl, kl.token_kl_naive, x, y.to(F32), m),
        "token_kl mask 2": pair(kl.token_kl, kl.token_kl_naive, x, y, _TWO),
        "token_rewards beta<0": pair(rewards.token_rewards, rewards.token_rewards_naive, s3, x, m, -1.0),
        "token_rewards beta nan": pair(rewards.token_rewards, rewards.token_rewards_naive, s3, x, m, NAN),
        "token_rewards score_at bogus": pair(
            rewards.token_rewards, rewards.token_rewards_naive, s3, x, m, 0.1, score_at="bogus"
        ),
        "token_rewards scores f32": pair(
            rewards.token_rewards, rewards.token_rewards_naive, s3.to(F32), x, m, 0.1
        ),
        "token_rewards scores short": pair(
            rewards.token_rewards, rewards.token_rewards_naive, s3[:2], x, m, 0.1
        ),
        "token_rewards empty row": pair(
            rewards.token_rewards, rewards.token_rewards_naive, s3, x, _EMPTY_ROW, 0.1
        ),
        "score_positions empty row": pair(rewards.score_positions, hn.score_positions_naive, _EMPTY_ROW),
        "score_positions bogus": pair(rewards.score_positions, hn.score_positions_naive, m, "bogus"),
        "gae gamma>1": pair(gae.gae, gae.gae_naive, x, y, m, gamma=1.5, lam=0.9),
        "gae lam nan": pair(gae.gae, gae.gae_naive, x, y, m, gamma=1.0, lam=NAN),
        "gae holes bogus": pair(gae.gae, gae.gae_naive, x, y, m, gamma=1.0, lam=1.0, holes="bogus"),
        "gae values f32": pair(gae.gae, gae.gae_naive, x, y.to(F32), m, gamma=1.0, lam=1.0),
        "gae empty row": pair(gae.gae, gae.gae_naive, x, y, _EMPTY_ROW, gamma=1.0, lam=1.0),
        "envelope mask 2": pair(gae.envelope, hn.envelope_naive, _TWO),
        "has_holes mask 2": pair(gae.has_holes, hn.has_holes_naive, torch.tensor([[2, 0, 0], [1, 1, 0]])),
        "has_holes 1-d mask": pair(gae.has_holes, hn.has_holes_naive, _MASK[0]),
        "logprobs temperature 0": pair(
            logprobs.logprobs_from_logits,
            logprobs.logprobs_from_logits_naive,
            logits,
            tokens,
            m,
            temperature=0.0,
        ),
        "logprobs token out of range": pair(
            logprobs.logprobs_from_logits, logprobs.logprobs_from_logits_naive, logits, tokens + 5, m
        ),
        "logprobs float tokens": pair(
            logprobs.logprobs_from_logits, logprobs.logprobs_from_logits_naive, logits, tokens.to(F64), m
        ),
        "entropy temperature nan": pair(
            logprobs.entropy_from_logits, logprobs.entropy_from_logits_naive, logits, m, temperature=NAN
        ),
        "entropy 2-d logits": pair(logprobs.entropy_from_logits, logprobs.entropy_from_logits_naive, x, m),
        "entropy logits a list": pair(
            logprobs.entropy_from_logits, logprobs.entropy_from_logits_naive, logits.tolist(), m
        ),
        "entropy mask shape": pair(
            logprobs.entropy_from_logits, logprobs.entropy_from_logits_naive, logits, m[:, :3]
        ),
        "entropy_bonus agg bogus": pair(
            objective.entropy_bonus, objective.entropy_bonus_naive, x, m, "bogus"
        ),
        "entropy_bonus token_count 0": pair(
            objective.entropy_bonus, objective.entropy_bonus_naive, x, m, token_count=0.0
        ),
        "kl_loss estimator bogus": pair(objective.kl_loss, objective.kl_loss_naive, x, y, m, "bogus"),
        "kl_loss logp_ref f32": pair(objective.kl_loss, objective.kl_loss_naive, x, y.to(F32), m),
        "kl_loss empty row": pair(objective.kl_loss, objective.kl_loss_naive, x, y, _EMPTY_ROW),
        "kl_loss grad estimator bogus": pair(objective.kl_loss, kl_loss_grad_naive, x, y, m, "bogus"),
        "kl_loss grad logp_ref f32": pair(objective.kl_loss, kl_loss_grad_naive, x, y.to(F32), m),
        "kl_loss grad empty row": pair(objective.kl_loss, kl_loss_grad_naive, x, y, _EMPTY_ROW),
        "kl_loss grad clamp lo>hi": pair(
            objective.kl_loss, kl_loss_grad_naive, x, y, m, log_ratio_clamp=(1.0, 0.0)
        ),
        "kl_loss grad agg bogus": pair(objective.kl_loss, kl_loss_grad_naive, x, y, m, "k3", "bogus"),
        "kl_loss grad horizon 0": pair(
            objective.kl_loss, kl_loss_grad_naive, x, y, m, agg="seq-mean-token-sum-norm", horizon=0.0
        ),
        "total_loss vf_coef<0": pair(
            objective.total_loss, objective.total_loss_naive, torch.tensor(1.0, dtype=F64), vf_coef=-1.0
        ),
        "total_loss kl_coef nan": pair(
            objective.total_loss, objective.total_loss_naive, torch.tensor(1.0, dtype=F64), kl_coef=NAN
        ),
        "normalize kind bogus": pair(normalize.normalize, normalize.normalize_naive, x, m, "bogus"),
        "normalize eps_at bogus": pair(normalize.normalize, normalize.normalize_naive, x, m, eps_at="bogus"),
        "normalize eps<0": pair(normalize.normalize, normalize.normalize_naive, x, m, eps=-1.0),
        "normalize int x": pair(normalize.normalize, normalize.normalize_naive, x.to(torch.int64), m),
        "map_scores bias nan": pair(score_map.map_scores, score_map.map_scores_naive, s3, bias=NAN),
        "map_scores clip 0": pair(score_map.map_scores, score_map.map_scores_naive, s3, clip=0.0),
        "map_scores int": pair(score_map.map_scores, score_map.map_scores_naive, s3.to(torch.int64)),
        "map_scores 2-d": pair(score_map.map_scores, score_map.map_scores_naive, x),
    }
    return [(k, *v) for k, v in table.items()]


STEP_CASES = _step_cases()


@pytest.mark.parametrize(("core", "twin"), [c[1:] for c in STEP_CASES], ids=[c[0] for c in STEP_CASES])
def test_step_refusals_are_identical(core: Callable[[], object], twin: Callable[[], object]) -> None:
    _same_refusal({"core": core, "naive": twin})


def test_group_advantages_counts_lengths_only_for_opo() -> None:
    # group_advantages counts each row's valid tokens for `opo` only: in float16 a count past 65504
    # is inf, which the lengths check refuses, so the other estimators must not count at all
    from refppo.core.group import group_advantages

    m = torch.ones(2, 65600, dtype=torch.bool)
    s = torch.tensor([1.0, 0.0], dtype=torch.float16)
    a = group_advantages(s, torch.tensor([0, 0]), m, estimator="grpo")
    # by hand: μ = 0.5, σ = sqrt(0.5) (unbiased), (±0.5)/(σ + 1e-6) = ±0.7071 in float16
    assert torch.equal(a[:, 0], torch.tensor([0.7070, -0.7070], dtype=torch.float16))
    with pytest.raises(RefPPOError, match=r"lengths: .* got inf at row 0"):
        group_advantages(s, torch.tensor([0, 0]), m, estimator="opo")


def test_has_holes_accepts_an_empty_row_as_envelope_does() -> None:
    # the mask check of has_holes is envelope's (no non-empty-row rule): a row with no valid token
    # has no hole; [1, 1, 0] has none either, [0, 1] has one (a valid token after a masked one)
    import importlib

    from refppo.core import helpers_naive as hn

    gae = importlib.import_module("refppo.core.gae")
    no_hole = torch.tensor([[0, 0, 0], [1, 1, 0]], dtype=torch.bool)
    hole = torch.tensor([[0, 0, 0], [0, 1, 1]], dtype=torch.bool)
    assert gae.has_holes(no_hole) is False and hn.has_holes_naive(no_hole) is False
    assert gae.has_holes(hole) is True and hn.has_holes_naive(hole) is True
    assert torch.equal(gae.envelope(hole), torch.tensor([[False] * 3, [True] * 3]))
