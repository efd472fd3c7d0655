"""Documented defaults, pinned by behaviour (spec/ppo.md, "Defaults"; spec/dump-format.md).

The expected values come from the documents, not from the code: the convention defaults are read
from the "refppo default" column of the table in spec/dump-format.md, the rest are the numbers
written in spec/ppo.md "Defaults", each checked through what the function computes when the
argument is left out (a hand-worked value), so a changed default fails here.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from refppo.core.aggregate import aggregate_loss
from refppo.core.kl import token_kl
from refppo.core.logprobs import entropy_from_logits, logprobs_from_logits
from refppo.core.masked import masked_moments, masked_var, masked_whiten
from refppo.core.objective import entropy_bonus, kl_loss, total_loss
from refppo.core.policy import clipped_policy_loss
from refppo.core.value import value_loss
from refppo.pipeline.settings import FLAT, Convention, Hyperparams

F64 = torch.float64
SPEC = Path(__file__).resolve().parents[2] / "spec"


def _s(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def test_total_loss_coefficients_default_to_zero() -> None:
    # spec/ppo.md Defaults: every coefficient 0 -> only pg_loss remains.
    assert total_loss(_s(1.0), _s(2.0), _s(3.0), _s(4.0), _s(5.0)).item() == 1.0
    # Each coefficient alone: 1 + c·term (entropy subtracted).
    assert total_loss(_s(1.0), _s(2.0), vf_coef=0.5).item() == 2.0
    assert total_loss(_s(1.0), entropy=_s(3.0), ent_coef=0.5).item() == -0.5
    assert total_loss(_s(1.0), kl_loss_value=_s(4.0), kl_coef=0.5).item() == 3.0
    assert total_loss(_s(1.0), ptx_loss=_s(5.0), ptx_coef=0.5).item() == 3.5


def test_whitening_defaults_to_unbiased_variance_shifted_mean_and_eps_1e8() -> None:
    # x = [0, 1e-4]: μ = 5e-5, Σ(x−μ)² = 5e-9. Unbiased σ² = 5e-9 (N − 1 = 1), so
    # whitened[0] = −5e-5/√(5e-9 + 1e-8) = −√(2.5e-9/1.5e-8) = −1/√6.
    # (population: −√(2.5e-9/1.25e-8) = −√0.2; without eps: −√0.5; no shift: −1/√6 + 5e-5.)
    x = torch.tensor([[0.0, 1e-4]], dtype=F64)
    m = torch.ones(1, 2, dtype=torch.bool)
    w = masked_whiten(x, m)
    assert w[0].tolist() == pytest.approx([-1 / math.sqrt(6), 1 / math.sqrt(6)], rel=1e-12, abs=0.0)
    assert masked_var(x, m).item() == pytest.approx(5e-9, rel=1e-12)
    mu, var = masked_moments(x, m)
    assert (mu.item(), var.item()) == pytest.approx((5e-5, 5e-9), rel=1e-12)


def test_policy_and_value_loss_default_clip_ranges_are_0_2() -> None:
    # ρ = 1.5, A = 1: clipped at 1 + 0.2 -> ℓ = −1.2; ρ = 0.5, A = −1: clipped at 0.8 -> ℓ = 0.8.
    lp = torch.tensor([[math.log(1.5), math.log(0.5)]], dtype=F64)
    out = clipped_policy_loss(
        lp, torch.zeros(1, 2, dtype=F64), torch.tensor([[1.0, -1.0]], dtype=F64), torch.ones(1, 2)
    )
    assert out.per_token[0].tolist() == pytest.approx([-1.2, 0.8], abs=1e-15)
    assert out.loss.item() == pytest.approx(-0.2, abs=1e-15)  # token-mean
    # V = 1, V_old = 0, R = 0 ... V^clip = 0.2: max(1, 0.04)/2 = 0.5 (clipped kind, unclipped branch);
    # V = 1, V_old = 0, R = 2: V^clip = 0.2, max(1, 3.24)/2 = 1.62 (the clipped branch, ε_v = 0.2).
    v = value_loss(
        torch.tensor([[1.0, 1.0]], dtype=F64),
        torch.zeros(1, 2, dtype=F64),
        torch.tensor([[0.0, 2.0]], dtype=F64),
        torch.ones(1, 2),
    )
    assert v.per_token[0].tolist() == pytest.approx([0.5, 1.62], abs=1e-15)
    assert v.loss.item() == pytest.approx(1.06, abs=1e-15)


def test_kl_estimators_default_to_k1_for_the_reward_and_k3_for_the_loss() -> None:
    # d = 1: k1 = 1, k3 = e^{−1} + 1 − 1 = e^{−1}.
    lp, ref, m = torch.tensor([[1.0]], dtype=F64), torch.zeros(1, 1, dtype=F64), torch.ones(1, 1)
    assert token_kl(lp, ref, m).item() == 1.0
    assert kl_loss(lp, ref, m).item() == pytest.approx(math.exp(-1.0), abs=1e-15)


def test_temperature_and_aggregation_default_to_one_and_token_mean() -> None:
    # logits [0, ln 3] at τ = 1: p = [1/4, 3/4].
    logits = torch.tensor([[[0.0, math.log(3.0)]]], dtype=F64)
    assert logprobs_from_logits(logits, torch.tensor([[1]])).item() == pytest.approx(
        math.log(0.75), abs=1e-15
    )
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(logits).item() == pytest.approx(h, abs=1e-15)
    # Rows of 2 and 1 valid tokens: token-mean (1 + 2 + 6)/3 = 3 (seq-mean-token-mean would be 3.75).
    loss = torch.tensor([[1.0, 2.0], [6.0, 99.0]], dtype=F64)
    m = torch.tensor([[1, 1], [1, 0]])
    assert aggregate_loss(loss, m).item() == 3.0
    assert entropy_bonus(loss, m).item() == 3.0


def test_hyperparams_defaults_are_the_documented_ones() -> None:
    hp = Hyperparams()
    assert (hp.gamma, hp.lam, hp.kl_coef, hp.cliprange, hp.cliprange_value) == (1.0, 0.95, 0.05, 0.2, 0.2)
    assert (hp.vf_coef, hp.ent_coef, hp.whiten_eps) == (0.1, 0.0, 1e-8)
    assert hp.cliprange_high is None and hp.horizon is None


def test_score_map_defaults_are_the_identity() -> None:
    # spec/ppo.md step 0: "The defaults (`0`, `1`, none) are the identity". ScoreMap() goes through
    # the pipeline's step 0 unchanged (the score-map tests compare pipeline and naive twin, which
    # read the same defaults, so a changed default could not fail there; mutation testing).
    from refppo.pipeline.blocks import Evaluation
    from refppo.pipeline.groups import ScoreMap
    from refppo.pipeline.rollout import score_map_stage

    sm = ScoreMap()
    assert (sm.bias, sm.scale, sm.clip) == (0.0, 1.0, None)
    assert Convention().score == sm
    s = torch.tensor([-3.0, -0.5, 0.0, 2.5, 40.0], dtype=F64)
    out = score_map_stage({"scores": s}, Convention(), Hyperparams(), Evaluation())["mapped_scores"]
    assert out.tolist() == [-3.0, -0.5, 0.0, 2.5, 40.0]


def _documented_convention_defaults() -> dict[str, str]:
    """The "refppo default" column of the convention table in spec/dump-format.md."""
    rows: dict[str, str] = {}
    for line in (SPEC / "dump-format.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`[a-z_]+`", cells[0]):
            rows[cells[0].strip("`")] = cells[2].strip("`")
    return rows


def test_convention_defaults_are_the_documented_ones() -> None:
    documented = _documented_convention_defaults()
    conv = Convention()
    compared = 0
    for key, want in documented.items():
        if key not in FLAT:
            continue
        got = conv.get(key)
        if isinstance(got, float):
            assert got == float(want), key
        else:
            assert ("none" if got is None else str(getattr(got, "value", got))) == want, key
        compared += 1
    # Every flat convention key is in the table.
    undocumented = set(FLAT) - set(documented)
    assert not undocumented, f"convention keys missing from spec/dump-format.md: {sorted(undocumented)}"
    assert compared == len(FLAT)
