"""Tests for survivors of ``tools/mutate.py`` that were not equivalent (issue #9, refresh run).

Each test pins one documented behaviour that a surviving mutant changed; the expected values are
worked out in the comments, not taken from the code under test.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch

from refppo.core.gae import envelope
from refppo.core.grad import policy_grad_naive
from refppo.core.group import group_scalar_advantages, reinforce_pp_advantages
from refppo.core.group_naive import reinforce_pp_advantages_naive
from refppo.core.gspo import gspo_policy_loss
from refppo.core.policy import clipped_policy_loss
from refppo.core.score_map import map_scores
from refppo.errors import ConventionError, ShapeError
from refppo.pipeline.blocks import Evaluation, Normalisers, gae_by_rows
from refppo.pipeline.rollout import critic_free_advantages, score_map_stage
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import rollout_quantities
from refppo.pipeline.update import policy_term


def test_envelope_accepts_a_row_without_a_valid_token() -> None:
    """``envelope`` is documented for any bool mask (``check_mask(require_nonempty_rows=False)``):
    a row with no valid token has no position up to a last valid one, so its envelope is all False.
    Survivors: ``require_nonempty_rows=False`` flipped to True or dropped (then it raised)."""
    m = torch.tensor([[True, False, True, False], [False, False, False, False], [True, True, False, False]])
    want = torch.tensor([[True, True, True, False], [False, False, False, False], [True, True, False, False]])
    assert torch.equal(envelope(m), want)


def _critic_free(conv: Convention, group_index: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The pipeline's raw advantages for 6 rows (T = 4, ragged), KL in the loss (scores alone)."""
    mask = torch.arange(4).expand(6, 4) < torch.tensor([4, 2, 3, 1, 4, 2]).unsqueeze(1)
    lp = torch.where(mask, -0.5, 9.0).to(torch.float64)
    scores = torch.tensor([1.0, -0.5, 2.0, 0.25, -1.5, 0.75], dtype=torch.float64)
    rq = rollout_quantities(
        scores=scores, old_logprobs=lp, ref_logprobs=lp, old_values=None, mask=mask,
        hp=Hyperparams(), conv=conv, group_index=group_index,
    )  # fmt: skip
    return rq.advantages, {"mask": mask, "scores": scores}


def test_reinforce_pp_baseline_without_step_4_whitening_is_the_raw_baseline() -> None:
    """``advantage=reinforce++-baseline`` with ``whiten_advantages=none``: each valid token holds
    ``s_i − mean(s over i's group)`` (the group function must leave the whitening to step 4).
    Groups {0, 2, 4}: mean 0.5; {1, 3, 5}: mean 1/6. Survivor: ``whiten=False`` → True."""
    conv = Convention.of(advantage="reinforce++-baseline", whiten_advantages="none", kl_in="loss")
    adv, x = _critic_free(conv, torch.tensor([0, 1, 0, 1, 0, 1]))
    means = [0.5, 1 / 6, 0.5, 1 / 6, 0.5, 1 / 6]
    want = torch.tensor([[float(x["scores"][i]) - means[i]] * 4 for i in range(6)], dtype=torch.float64)
    torch.testing.assert_close(torch.where(x["mask"], adv, 0.0), torch.where(x["mask"], want, 0.0))


def test_group_singleton_reaches_the_group_function() -> None:
    """``group_singleton=score`` (verl/SkyRL GRPO): a prompt with one response gets ``μ := 0,
    σ := 1``, i.e. ``s/(1 + ε)`` (rows 1, 3, 5), instead of an error; the group {0, 2, 4} (scores
    1, 2, −1.5: mean 0.5, unbiased std √3.25) is normalised as usual. Survivor: the ``singleton=``
    argument dropped (the default refuses the singleton)."""
    conv = Convention.of(advantage="grpo", whiten_advantages="none", kl_in="loss", group_singleton="score")
    adv, x = _critic_free(conv, torch.tensor([0, 1, 0, 2, 0, 3]))
    std = math.sqrt(((1.0 - 0.5) ** 2 + (2.0 - 0.5) ** 2 + (-1.5 - 0.5) ** 2) / 2)
    row = {0: (1.0 - 0.5) / (std + 1e-6), 2: (2.0 - 0.5) / (std + 1e-6), 4: (-1.5 - 0.5) / (std + 1e-6)}
    row.update({i: float(x["scores"][i]) / (1 + 1e-6) for i in (1, 3, 5)})
    want = torch.tensor([[row[i]] * 4 for i in range(6)], dtype=torch.float64)
    torch.testing.assert_close(torch.where(x["mask"], adv, 0.0), torch.where(x["mask"], want, 0.0))


def test_a_singleton_under_group_singleton_error_names_the_prompt() -> None:
    """The refusal names the prompts with one response, as the ``group_index`` values the user
    wrote (prompts 3 and 8 here), and says which setting to change. Survivors: the parsing of the
    core's message (``split`` indices and separators) and its ``'have one response'`` test."""
    conv = Convention.of(advantage="grpo", whiten_advantages="none", kl_in="loss")
    with pytest.raises(ConventionError) as info:
        _critic_free(conv, torch.tensor([0, 3, 0, 8, 0, 0]))
    msg = str(info.value)
    assert type(info.value) is ConventionError
    assert msg.startswith("group_index: prompts [3, 8] have one response under group_singleton=error ("), msg


def test_critic_free_advantages_called_alone_is_single_process() -> None:
    """``critic_free_advantages`` without ``distributed`` (as ``--detect``'s estimator stage calls
    it) is the single-process step 3: GRPO over {0, 2, 4} and {1, 3, 5} with KL in the loss, the
    score of a row alone. Survivor: the ``distributed=False`` default flipped (then it refused)."""
    mask = torch.arange(3).expand(6, 3) < torch.tensor([3, 2, 1, 3, 2, 1]).unsqueeze(1)
    s = torch.tensor([1.0, 4.0, 2.0, 6.0, 3.0, 8.0], dtype=torch.float64)
    zero = torch.zeros(6, 3, dtype=torch.float64)
    adv = critic_free_advantages(
        scores=s, kl=zero, rewards=zero, mask=mask, value_mask_=mask, group_index=torch.tensor([0, 1] * 3),
        hp=Hyperparams(), conv=Convention.of(advantage="grpo", group_kl="to_go", kl_in="loss"),
    )  # fmt: skip
    # group {1, 2, 3}: mean 2, unbiased std 1; group {4, 6, 8}: mean 6, unbiased std 2
    a, b = 1 / (1 + 1e-6), 2 / (2 + 1e-6)
    per_row = [-a, -b, 0.0, 0.0, a, b]
    want = torch.tensor([[a] * 3 for a in per_row], dtype=torch.float64)
    torch.testing.assert_close(torch.where(mask, adv, 0.0), torch.where(mask, want, 0.0))


def test_score_map_applies_a_bias_alone_and_a_scale_alone() -> None:
    """``map_scores``: ``(s + b)·k`` whenever ``b ≠ 0`` *or* ``k ≠ 1`` (the affine step is skipped
    only for the identity). Bias alone: ``[1, −2] + 0.5 = [1.5, −1.5]``; scale alone:
    ``[1, −2]·3 = [3, −6]``. Survivor: the ``or`` of the skip condition turned into ``and`` (a
    bias alone or a scale alone was then ignored)."""
    s = torch.tensor([1.0, -2.0], dtype=torch.float64)
    assert map_scores(s, bias=0.5).tolist() == [1.5, -1.5]
    assert map_scores(s, scale=3.0).tolist() == [3.0, -6.0]
    assert map_scores(s, bias=0.5, clip=1.2).tolist() == [1.2, -1.2]  # unbiased: [1.0, -1.2]


def test_score_map_stage_defaults_are_the_identity_map() -> None:
    """The score map stage under the default convention (``score_bias = 0``, ``score_scale = 1``,
    no clip) gives ``s`` itself; with ``score_clip=1`` alone ``clip([0.5, −3, 2], ±1) = [0.5, −1, 1]``.
    Survivors: the default bias ``0.0 → 1`` (then ``[1.5, −2, 3]``) and the default scale ``1.0 → 0``
    (then all 0)."""
    s = torch.tensor([0.5, -3.0, 2.0], dtype=torch.float64)
    hp, ev = Hyperparams(), Evaluation()
    assert score_map_stage({"scores": s}, Convention(), hp, ev)["mapped_scores"].tolist() == [0.5, -3.0, 2.0]
    clipped = score_map_stage({"scores": s}, Convention.of(score_clip=1.0), hp, ev)["mapped_scores"]
    assert clipped.tolist() == [0.5, -1.0, 1.0]


@pytest.mark.parametrize(("holes", "want0"), [("zero", 1.5), ("through", 3.5), ("skip", 2.0)])
def test_reinforce_pp_in_the_pipeline_crosses_holes_by_gae_holes(holes: str, want0: float) -> None:
    """``critic_free_advantages`` under ``advantage=reinforce++`` passes ``conv.adv.gae_holes`` to the
    returns. One row, mask ``[1, 0, 1]``, rewards ``[1, 4, 2]`` (4 on the hole), γ = 0.5, at t = 0:
    skip ``1 + 0.5·2 = 2``; zero (the hole a step with reward 0) ``1 + 0.5·0 + 0.25·2 = 1.5``;
    through (the hole's reward read) ``1 + 0.5·4 + 0.25·2 = 3.5``; at t = 2 always 2.
    Survivor: ``holes=conv.adv.gae_holes`` dropped (every convention then crossed holes as skip)."""
    mask = torch.tensor([[True, False, True]])
    rewards = torch.tensor([[1.0, 4.0, 2.0]], dtype=torch.float64)
    adv = critic_free_advantages(
        scores=torch.tensor([2.0], dtype=torch.float64), kl=torch.zeros_like(rewards), rewards=rewards,
        mask=mask, value_mask_=mask, group_index=None, hp=Hyperparams(gamma=0.5),
        conv=Convention.of(advantage="reinforce++", gae_holes=holes),
    )  # fmt: skip
    assert adv[0, 0].item() == pytest.approx(want0, abs=1e-12)
    assert adv[0, 2].item() == pytest.approx(2.0, abs=1e-12)


def test_gspo_in_the_pipeline_clips_at_the_hyperparameter_cliprange() -> None:
    """``policy_term`` under ``policy_loss=gspo`` clips the sequence ratio at ``hp.cliprange``.
    One row of 2 tokens, ``log π − log π_old = 0.15`` each, A = 1: the sequence ratio is
    ``e^0.15 ≈ 1.1618``; with ε = 0.1 the loss is ``−min(1.1618, 1.1) = −1.1`` per token (token mean
    −1.1) and every token clips. Survivor: ``clip_low=hp.cliprange`` dropped (GSPO's own default
    0.2 then gave −1.1618, unclipped)."""
    mask = torch.ones(1, 2, dtype=torch.bool)
    logp = torch.full((1, 2), 0.15, dtype=torch.float64)
    out = policy_term(
        logp, torch.zeros_like(logp), torch.ones_like(logp), mask,
        hp=Hyperparams(cliprange=0.1), conv=Convention.of(policy_loss="gspo"),
    )  # fmt: skip
    assert out.loss.item() == pytest.approx(-1.1, abs=1e-12)
    assert out.clipfrac.item() == 1.0


def test_gpg_on_a_batch_of_zero_scores_is_zero_not_nan() -> None:
    """GPG's ``α = B / max(#{s ≠ 0}, 1)`` (verl ``compute_gpg_outcome_advantage``): a batch whose
    scores are all 0 has α = B = 4 and ``α(s − μ_G) = 0`` everywhere. Survivors: the ``max(·, 1)``
    dropped or its bound made 0 or −1 (then α = 4/0 = inf and ``inf · 0`` gave NaN)."""
    a = group_scalar_advantages(
        torch.zeros(4, dtype=torch.float64), torch.tensor([0, 0, 1, 1]), estimator="gpg"
    )
    assert a.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_gspo_in_the_pipeline_forwards_every_option_to_the_core() -> None:
    """``policy_term`` under ``policy_loss=gspo`` is :func:`refppo.core.gspo.gspo_policy_loss` with
    ``clip_low = hp.cliprange``, ``clip_high = hp.cliprange_high``, ``agg = conv.agg.loss``,
    ``log_ratio_max = conv.policy.log_ratio_clamp`` and the normalisers (``seq_count``, ``horizon``).
    Row 0: sequence log-ratio 0.3 (κ = 0.28 clamps it), A = +1, clipped at 1 + 0.25; row 1: −0.5,
    A = −1, clipped at 1 − 0.1. Each option binds: the core with that one option at its default
    gives another result (the controls). Survivors: each of those keywords dropped."""
    mask = torch.tensor([[True, True, True], [True, True, False]])
    logp = torch.tensor([[0.3, 0.3, 0.3], [-0.5, -0.5, 9.0]], dtype=torch.float64)
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]], dtype=torch.float64)
    hp = Hyperparams(cliprange=0.1, cliprange_high=0.25, horizon=5.0)
    conv = Convention.of(policy_loss="gspo", loss_agg="seq-mean-token-sum-norm", log_ratio_clamp=0.28)
    got = policy_term(logp, old, adv, mask, hp=hp, conv=conv, norm=Normalisers(seq_count=4.0))
    opts: dict[str, Any] = {
        "clip_low": 0.1, "clip_high": 0.25, "agg": "seq-mean-token-sum-norm", "log_ratio_max": 0.28,
        "seq_count": 4.0, "horizon": 5.0,
    }  # fmt: skip

    def core(**kw: Any) -> tuple[float, list[list[float]], list[list[float]]]:
        o = gspo_policy_loss(logp, old, adv, mask, **kw)
        return o.loss.item(), o.per_token.tolist(), o.ratio.tolist()

    assert (got.loss.item(), got.per_token.tolist(), got.ratio.tolist()) == core(**opts)
    for name in opts:
        control = core(**{k: v for k, v in opts.items() if k != name})
        assert control != core(**opts), f"{name} does not bind in this case"


@pytest.mark.parametrize("holes", ["zero", "through"])
def test_reinforce_pp_advantages_cross_holes_by_holes(holes: str) -> None:
    """``reinforce_pp_advantages(..., holes=)`` whitens the returns of :func:`discounted_returns`
    under that ``holes``: equal to the naive twin under the same ``holes``, and (control) not to
    the default ``skip`` on this holed mask with γ = 0.5 and a reward on each hole.
    Survivor: ``holes=holes`` dropped inside ``reinforce_pp_advantages`` (always ``skip``)."""
    mask = torch.tensor([[True, False, True, True], [True, True, False, True]])
    r = torch.tensor([[1.0, 4.0, -2.0, 0.5], [0.25, -1.0, 3.0, 2.0]], dtype=torch.float64)
    got = reinforce_pp_advantages(r, mask, gamma=0.5, holes=holes)
    want = reinforce_pp_advantages_naive(r, mask, gamma=0.5, holes=holes)
    skip = reinforce_pp_advantages_naive(r, mask, gamma=0.5)
    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-12)
    assert not torch.allclose(want[mask], skip[mask])


def test_policy_grad_twin_under_dual_clip_with_a_wide_low_clip() -> None:
    """``policy_grad_naive``, A = −1, ε_low = 0.8 (lo = 0.2), dual clip c = 3, ρ = 0.25 (inside the
    clip range): ``ℓ = min(max(ρ, clip(ρ)), c) = 0.25`` so ``∂ℓ/∂l = −A·ρ = 0.25`` (token-sum),
    the same as autograd through :func:`clipped_policy_loss`. Survivor: the clipped branch
    ``−A·clip(ρ)`` turned into ``−A / clip(ρ)`` (= 4 > c here, so the dual cap took the gradient
    to 0; elsewhere the branch order is unchanged)."""
    m = torch.ones(1, 1, dtype=torch.bool)
    lp = torch.full((1, 1), math.log(0.25), dtype=torch.float64)
    old, adv = torch.zeros_like(lp), -torch.ones_like(lp)
    x = lp.clone().requires_grad_(True)
    clipped_policy_loss(x, old, adv, m, clip_low=0.8, dual_clip=3.0, agg="token-sum").loss.backward()
    twin = policy_grad_naive(lp, old, adv, m, clip_low=0.8, dual_clip=3.0, agg="token-sum")
    assert x.grad is not None
    assert x.grad.item() == pytest.approx(0.25, abs=1e-15)
    assert twin.item() == pytest.approx(0.25, abs=1e-15)


def test_policy_grad_twin_beyond_the_log_ratio_clamp_is_zero_for_a_huge_ratio() -> None:
    """``policy_grad_naive`` with κ = 0.5 and ``log π − log π_old = 800``: the clamp blocks the
    gradient (0, as autograd gives), and ``e^κ`` is what the ratio reads, so no overflow.
    Survivor: the clamp's upper bound dropped inside the twin (``math.exp(800)`` overflowed)."""
    m = torch.ones(1, 1, dtype=torch.bool)
    lp = torch.zeros(1, 1, dtype=torch.float64)
    old, adv = torch.full((1, 1), -800.0, dtype=torch.float64), -torch.ones(1, 1, dtype=torch.float64)
    twin = policy_grad_naive(lp, old, adv, m, agg="token-sum", log_ratio_clamp=0.5)
    assert twin.tolist() == [[0.0]]


def test_gae_by_rows_refuses_an_empty_response_axis_in_one_line_naming_the_shape() -> None:
    """``gae_by_rows`` on a ``[3, 0]`` mask: the core's one-line ShapeError naming the whole
    shape ``[3, 0]`` (the block size ``RBE // max(T, 1)`` keeps T = 0 out of the division).
    Survivors: ``max(T, 1)`` → ``max(T, 0)`` (ZeroDivisionError) and → ``max(T, −1)`` (one-row
    blocks, so the error named ``[1, 0]``, not the input)."""
    m = torch.zeros(3, 0, dtype=torch.bool)
    r = torch.zeros(3, 0, dtype=torch.float64)
    with pytest.raises(ShapeError, match=re.escape("T >= 1), got shape [3, 0]")):
        gae_by_rows(r, r, m, gamma=1.0, lam=1.0, holes="skip")
