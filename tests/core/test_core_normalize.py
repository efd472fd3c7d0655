"""``refppo/core/normalize.py`` and the conventions built on it (whiten_advantages center/scale,
whiten_eps_at, whiten_rewards), gae_padding, kl_loss_agg/entropy_agg, loss_agg token-sum and the
score affine map: hand-computed values, junk on padding, and the pipeline's use of each."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from refppo.core.aggregate import aggregate_loss, aggregate_loss_naive
from refppo.core.gae import gae
from refppo.core.normalize import normalize, normalize_naive
from refppo.errors import MaskError
from refppo.pipeline.blocks import Evaluation
from refppo.pipeline.rollout import score_map_stage
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import rollout_quantities, update_quantities

F64 = torch.float64
MASK = torch.tensor([[True, True, True, False], [True, False, False, False]])
X = torch.tensor([[1.0, 2.0, 3.0, 99.0], [6.0, -7.0, 1e6, float("nan")]], dtype=F64)
# valid values 1, 2, 3, 6: N = 4, mean 3, Σ(x−μ)² = 4 + 1 + 0 + 9 = 14, Σx² = 50


def _valid(t: torch.Tensor) -> list[float]:
    return [float(v) for v in t[MASK]]


def test_center_subtracts_the_masked_mean_only() -> None:
    out = normalize(X, MASK, "center")
    assert _valid(out) == [-2.0, -1.0, 0.0, 3.0]
    assert float(out[~MASK].abs().sum()) == 0.0  # padding 0 despite NaN / 1e6 junk


@pytest.mark.parametrize(("unbiased", "d"), [(True, 3.0), (False, 4.0)])
def test_scale_divides_by_the_root_mean_square(unbiased: bool, d: float) -> None:
    out = normalize(X, MASK, "scale", unbiased=unbiased, eps=0.0)
    rms = math.sqrt(50.0 / d)
    assert _valid(out) == pytest.approx([1 / rms, 2 / rms, 3 / rms, 6 / rms], rel=1e-12)


def test_eps_at_std_adds_eps_to_the_standard_deviation() -> None:
    # unbiased σ² = 14/3; AReaL: (x − μ)/(σ + eps)
    eps = 0.5
    sigma = math.sqrt(14.0 / 3.0)
    out = normalize(X, MASK, "masked", eps=eps, eps_at="std")
    assert _valid(out) == pytest.approx([(v - 3.0) / (sigma + eps) for v in (1, 2, 3, 6)], rel=1e-12)
    plain = normalize(X, MASK, "masked", eps=eps, eps_at="variance")
    assert _valid(plain) == pytest.approx([(v - 3.0) / math.sqrt(14.0 / 3.0 + eps) for v in (1, 2, 3, 6)])


def test_eps_at_clamp_is_a_floor_on_the_variance() -> None:
    x = torch.tensor([[1.0, 1.0 + 1e-6, 0.0]], dtype=F64)
    m = torch.tensor([[True, True, False]])
    out = normalize(x, m, "masked", unbiased=False, eps=1e-8, eps_at="clamp")  # σ² = 2.5e-13 < eps
    assert float(out[0, 1]) == pytest.approx(0.5e-6 / math.sqrt(1e-8), rel=1e-9)
    big = normalize(X, MASK, "masked", unbiased=False, eps=1e-8, eps_at="clamp")  # σ² = 3.5 > eps
    assert _valid(big) == pytest.approx([(v - 3.0) / math.sqrt(3.5) for v in (1, 2, 3, 6)], rel=1e-12)


@pytest.mark.parametrize("kind", ["none", "masked", "masked_no_shift", "center", "scale"])
@pytest.mark.parametrize("eps_at", ["variance", "clamp", "std"])
@pytest.mark.parametrize("unbiased", [True, False])
def test_normalize_matches_its_naive_twin(kind: str, eps_at: str, unbiased: bool) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, generator=g, dtype=F64) * 2 + 0.7
    m = torch.arange(7).expand(5, 7) < torch.tensor([[7], [1], [4], [6], [2]])
    got = normalize(x, m, kind, unbiased=unbiased, eps=1e-3, eps_at=eps_at)
    want = normalize_naive(x, m, kind, unbiased=unbiased, eps=1e-3, eps_at=eps_at)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_default_whitening_is_unchanged_by_the_new_module() -> None:
    from refppo.core.masked import masked_whiten

    assert torch.equal(normalize(X, MASK, "masked"), masked_whiten(X, MASK))


def test_token_sum_is_the_plain_masked_sum() -> None:
    loss = torch.tensor([[1.0, 2.0, 4.0, 1e9], [8.0, 1e9, 1e9, 1e9]], dtype=F64)
    assert float(aggregate_loss(loss, MASK, "token-sum")) == 15.0
    assert float(aggregate_loss_naive(loss, MASK, "token-sum")) == 15.0


def _rollout(conv: Convention, old_values: torch.Tensor, hp: Hyperparams | None = None):  # type: ignore[no-untyped-def]  # test helper
    m = torch.tensor([[True, True, False], [True, True, True]])
    return rollout_quantities(
        scores=torch.tensor([2.0, -1.0], dtype=F64),
        old_logprobs=torch.zeros(2, 3, dtype=F64),
        ref_logprobs=torch.zeros(2, 3, dtype=F64),
        old_values=old_values,
        mask=m,
        hp=hp or Hyperparams(gamma=0.5, lam=0.5, kl_coef=0.0),
        conv=conv,
    )


def test_gae_through_padding_reads_the_padded_value() -> None:
    # row 0: L = 2, V = [v0, v1, vpad], r = [0, 2, 0], γ = λ = 0.5 (with λ = 1 vpad would cancel).
    # through: δ2 = −vpad, δ1 = 2 + 0.5·vpad − v1, A1 = δ1 + 0.25·δ2 = 2 + 0.25·vpad − v1.
    v = torch.tensor([[0.3, 0.4, 8.0], [0.1, 0.2, 0.3]], dtype=F64)
    through = _rollout(Convention.of(gae_padding="through", whiten_advantages="none"), v)  # type: ignore[arg-type]  # parsed
    masked = _rollout(Convention.of(whiten_advantages="none"), v)  # type: ignore[arg-type]  # parsed
    assert float(through.advantages_raw[0, 1]) == pytest.approx(2.0 + 0.25 * 8.0 - 0.4)
    assert float(masked.advantages_raw[0, 1]) == pytest.approx(2.0 - 0.4)
    # the full row (no padding) is the same either way
    torch.testing.assert_close(through.advantages_raw[1], masked.advantages_raw[1])
    want, _ = gae(through.token_rewards, v, torch.ones(2, 3, dtype=torch.bool), gamma=0.5, lam=0.5)
    torch.testing.assert_close(through.advantages_raw, want)


def test_whiten_rewards_normalises_the_token_rewards_over_the_value_mask() -> None:
    # TRL whiten_rewards: masked_whiten(rewards, ~padding_mask_p1, shift_mean=False); with
    # score_at=after_last_valid the value mask of row 0 is [1, 1, 1] (the slot after L = 2).
    v = torch.zeros(2, 3, dtype=F64)
    conv = Convention.of(
        score_at="after_last_valid", whiten_rewards="masked_no_shift", whiten_advantages="none"
    )  # type: ignore[arg-type]  # parsed
    rq = _rollout(conv, v)
    raw = [0.0, 0.0, 2.0, 0.0, 0.0, -1.0]  # row 0 score at slot 2; row 1 (full) at its last token
    mu = sum(raw) / 6
    var = sum((r - mu) ** 2 for r in raw) / 5
    want = [(r - mu) / math.sqrt(var + 1e-8) + mu for r in raw]
    assert rq.token_rewards.flatten().tolist() == pytest.approx(want, rel=1e-12)
    plain = _rollout(Convention.of(score_at="after_last_valid", whiten_advantages="none"), v)  # type: ignore[arg-type]  # parsed
    assert plain.token_rewards.flatten().tolist() == raw


def _update(conv: Convention) -> tuple[float, float]:
    g = torch.Generator().manual_seed(5)
    m = torch.arange(6).expand(3, 6) < torch.tensor([[6], [1], [3]])
    lp = -torch.rand(3, 6, generator=g, dtype=F64)
    ref = lp + 0.5 * torch.randn(3, 6, generator=g, dtype=F64)
    ent = torch.rand(3, 6, generator=g, dtype=F64)
    uq = update_quantities(
        logprobs=lp,
        values=torch.zeros(3, 6, dtype=F64),
        old_logprobs=lp,
        old_values=torch.zeros(3, 6, dtype=F64),
        advantages=torch.zeros(3, 6, dtype=F64),
        returns=torch.zeros(3, 6, dtype=F64),
        mask=m,
        ref_logprobs=ref,
        entropy=ent,
        hp=Hyperparams(),
        conv=conv,
    )
    kl = torch.where(m, lp - ref, torch.zeros((), dtype=F64))
    want_kl = float(aggregate_loss_naive(kl, m, conv.agg.kl or conv.agg.loss))
    want_ent = float(aggregate_loss_naive(ent, m, conv.agg.entropy or conv.agg.loss))
    assert float(uq.kl_loss) == pytest.approx(want_kl, rel=1e-12)
    assert float(uq.entropy_loss) == pytest.approx(want_ent, rel=1e-12)
    return float(uq.kl_loss), float(uq.entropy_loss)


def test_kl_loss_and_entropy_aggregated_apart_from_the_policy_loss() -> None:
    base = Convention.of(kl_in="loss", kl_estimator="k1")  # type: ignore[arg-type]  # parsed
    split = Convention.of(
        kl_in="loss", kl_estimator="k1", kl_loss_agg="seq-mean-token-mean", entropy_agg="seq-mean-token-sum"
    )  # type: ignore[arg-type]  # parsed
    kl0, e0 = _update(base)
    kl1, e1 = _update(split)
    assert abs(kl0 - kl1) > 1e-3 and abs(e0 - e1) > 1e-3  # the split really changes both terms


def test_score_affine_map_before_the_clip() -> None:
    s = torch.tensor([1.0, -4.0, 10.0], dtype=F64)
    # AReaL: clip((s + bias)·scale, ±clip), the pipeline's score map stage
    conv = Convention.of(score_clip=5.0, score_bias=0.5, score_scale=2.0)
    hp, ev = Hyperparams(), Evaluation()
    assert score_map_stage({"scores": s}, conv, hp, ev)["mapped_scores"].tolist() == [3.0, -5.0, 5.0]
    assert score_map_stage({"scores": s}, Convention(), hp, ev)["mapped_scores"].tolist() == s.tolist()


def test_new_fields_round_trip_and_stay_out_of_the_default_dict() -> None:
    d = Convention().to_dict()
    for key in ("whiten_eps_at", "whiten_rewards", "gae_padding", "kl_loss_agg", "entropy_agg"):
        assert key not in d
    c = Convention.of(
        whiten_eps_at="std", whiten_rewards="masked_no_shift", gae_padding="through", kl_loss_agg="token-mean"
    )  # type: ignore[arg-type]  # parsed
    assert Convention.from_dict(c.to_dict()) == c


# ---- from the survivors of tools/mutate.py --module normalize ------------------------------------


@pytest.mark.parametrize("kind", ["masked", "masked_no_shift", "center", "scale"])
@pytest.mark.parametrize("eps_at", ["variance", "clamp"])
def test_normalize_with_all_reduce_equals_the_concatenated_batch(kind: str, eps_at: str) -> None:
    # two simulated ranks (threads, a blocking SUM collective): every kind's statistics are global
    from test_core_masked import _run_ranks, _sharded_batch

    x, m, sizes = _sharded_batch(F64)
    cut = sizes[0]
    whole = normalize(x, m, kind, eps=1e-8, eps_at=eps_at)

    def run(xs: torch.Tensor, ms: torch.Tensor, ar: Any) -> torch.Tensor:
        return normalize(xs, ms, kind, eps=1e-8, eps_at=eps_at, all_reduce=ar)

    glob = torch.cat(_run_ranks([(x[:cut], m[:cut]), (x[cut:], m[cut:])], run))
    assert float((glob - whole).abs().max()) <= 1e-13
    local = torch.cat(
        [normalize(x[:cut], m[:cut], kind, eps_at=eps_at), normalize(x[cut:], m[cut:], kind, eps_at=eps_at)]
    )
    assert float((local - whole).abs().max()) > 1e-2  # control: per-rank statistics differ


def test_unbiased_scale_needs_two_valid_tokens() -> None:
    # Σx²/(N−1) with N = 2 tokens (1, 3): ms = 10, scale 1/sqrt(10) (exactly two tokens are enough)
    m2 = torch.tensor([[True, True, False]])
    x2 = torch.tensor([[1.0, 3.0, 5.0]], dtype=F64)
    out = normalize(x2, m2, "scale", unbiased=True, eps=0.0)
    assert _valid_of(out, m2) == pytest.approx([1 / math.sqrt(10), 3 / math.sqrt(10)], rel=1e-12)
    with pytest.raises(MaskError, match="at least 2 valid tokens, got 1"):
        normalize(x2, torch.tensor([[True, False, False]]), "scale", unbiased=True)


def _valid_of(t: torch.Tensor, m: torch.Tensor) -> list[float]:
    return [float(v) for v in t[m]]
