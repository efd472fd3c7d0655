"""``Convention.value_loss_agg``: the value loss aggregated apart from the policy loss (OpenRLHF).

The expected losses are written here with plain loops over Python floats, from the definitions in
``spec/ppo.md`` — never from refppo's own aggregation code.
"""

from __future__ import annotations

import pytest
import torch

from refppo.conventions import LossAgg
from refppo.errors import ConventionError
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import update_quantities

EPS, EPS_V = 0.2, 0.2


def _inputs(seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 7
    lengths = [7, 2, 5, 3]  # unequal lengths: token-mean and seq-mean-token-mean differ
    mask = torch.arange(T).expand(B, T) < torch.tensor(lengths).unsqueeze(1)

    def rnd() -> torch.Tensor:
        return torch.randn(B, T, generator=g, dtype=torch.float64)

    old = -rnd().abs() - 0.5
    return {
        "mask": mask,
        "old_logprobs": old,
        "logprobs": old + 0.3 * rnd(),
        "advantages": rnd(),
        "old_values": rnd(),
        "values": rnd(),
        "returns": rnd(),
    }


def _per_token_loops(x: dict[str, torch.Tensor]) -> tuple[list[list[float]], list[list[float]]]:
    """(policy, value) per-token losses of the valid tokens, row by row."""
    m = x["mask"].tolist()
    lp, old, adv = x["logprobs"].tolist(), x["old_logprobs"].tolist(), x["advantages"].tolist()
    v, v_old, ret = x["values"].tolist(), x["old_values"].tolist(), x["returns"].tolist()
    pol: list[list[float]] = []
    val: list[list[float]] = []
    for b in range(len(m)):
        prow, vrow = [], []
        for t in range(len(m[b])):
            if not m[b][t]:
                continue
            ratio = torch.tensor(lp[b][t] - old[b][t], dtype=torch.float64).exp().item()
            clipped = min(max(ratio, 1 - EPS), 1 + EPS)
            prow.append(max(-adv[b][t] * ratio, -adv[b][t] * clipped))
            v_clip = min(max(v[b][t], v_old[b][t] - EPS_V), v_old[b][t] + EPS_V)
            vrow.append(0.5 * max((v[b][t] - ret[b][t]) ** 2, (v_clip - ret[b][t]) ** 2))
        pol.append(prow)
        val.append(vrow)
    return pol, val


def _token_mean(rows: list[list[float]]) -> float:
    return sum(sum(r) for r in rows) / sum(len(r) for r in rows)


def _seq_mean_token_mean(rows: list[list[float]]) -> float:
    return sum(sum(r) / len(r) for r in rows) / len(rows)


def _run(x: dict[str, torch.Tensor], conv: Convention) -> tuple[float, float]:
    uq = update_quantities(
        logprobs=x["logprobs"],
        values=x["values"],
        old_logprobs=x["old_logprobs"],
        old_values=x["old_values"],
        advantages=x["advantages"],
        returns=x["returns"],
        mask=x["mask"],
        hp=Hyperparams(cliprange=EPS, cliprange_value=EPS_V),
        conv=conv,
    )
    return float(uq.pg_loss), float(uq.vf_loss)


def test_value_loss_agg_aggregates_the_value_loss_only() -> None:
    x = _inputs()
    pol, val = _per_token_loops(x)
    assert abs(_token_mean(val) - _seq_mean_token_mean(val)) > 1e-3  # the test can tell them apart
    split = Convention.of(loss_agg="seq-mean-token-mean", value_loss_agg="token-mean")  # type: ignore[arg-type]  # strings are parsed
    pg, vf = _run(x, split)
    assert vf == pytest.approx(_token_mean(val), rel=1e-12, abs=0.0)
    assert pg == pytest.approx(_seq_mean_token_mean(pol), rel=1e-12, abs=0.0)
    # None (the default): the value loss follows loss_agg, as before the field existed.
    pg0, vf0 = _run(x, Convention.of(loss_agg=LossAgg.SEQ_MEAN_TOKEN_MEAN))
    assert vf0 == pytest.approx(_seq_mean_token_mean(val), rel=1e-12, abs=0.0)
    assert pg0 == pg


def test_value_loss_agg_parses_and_round_trips() -> None:
    c = Convention.of(value_loss_agg="seq-mean-token-sum")  # type: ignore[arg-type]  # strings are parsed
    assert c.agg.value is LossAgg.SEQ_MEAN_TOKEN_SUM
    assert c.to_dict()["value_loss_agg"] == "seq-mean-token-sum"
    assert Convention.from_dict(c.to_dict()) == c
    assert Convention().agg.value is None
    assert "value_loss_agg" not in Convention().to_dict()  # default: the pre-existing dict
    assert Convention.from_dict(Convention().to_dict()) == Convention()
    up = Convention().with_updates({"value_loss_agg": "token-mean"})
    assert up.agg.value is LossAgg.TOKEN_MEAN
    assert up.with_updates({"value_loss_agg": None}).agg.value is None
    with pytest.raises(ConventionError, match="value_loss_agg"):
        Convention.of(value_loss_agg="mean")  # type: ignore[arg-type]  # a wrong name must fail
