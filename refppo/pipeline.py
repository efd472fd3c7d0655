"""One PPO step in pipeline order, from cached rollout tensors to the losses — ONE path.

The trainer (:mod:`refppo.trainer`), the oracle (``tools/diff_against.py``) and the golden
trajectories all call these two functions, so what the oracle checks is what the trainer runs.

Pipeline order (the numbered skeleton of lm-human-preferences / TRL ppov2)::

    0. scores        = clip((scores + b)·k, ±C)                         (``score_map``: identity
                                                                        by default; AReaL, OpenRLHF)
    1. kl            = token_kl(old_logprobs, ref_logprobs)            (KL placed in the reward)
    2. token_rewards = [0, …, 0, score] − β·kl                        (score at ``score_at``)
    2b. token_rewards = normalize(token_rewards)                      (``whiten_rewards``, TRL)
    3. advantages, returns = GAE(token_rewards, old_values)            (``gae_padding``,
                                                                        ``gae_holes``)
    4. advantages    = normalize(advantages)                           (``whiten_advantages``,
                                                                        ``whiten_holes``,
                                                                        ``whiten_eps_at``; global
                                                                        under DDP)
    --- per PPO epoch / minibatch, with the current policy and critic ---
    5. ratio         = exp(logprobs − old_logprobs)
    6. pg_loss, pg_clipfrac, approx_kl = clipped surrogate            (``policy_loss``: token ratio,
                                                                        or GSPO's sequence ratio)
    7. vf_loss, vf_clipfrac = value loss around old_values           (``value_loss_agg``, default
                                                                        ``loss_agg``; clipped value
                                                                        by ``value_clip_form``)
    8. entropy_loss, kl_loss (KL in the loss, on the current log-probs)
    9. loss          = pg_loss + vf_coef·vf_loss − ent_coef·entropy_loss + kl_coef·kl_loss

Masks: ``mask`` marks response tokens. With ``score_at=after_last_valid`` (TRL, DeepSpeed-Chat)
the score sits one slot after the last valid token; that slot then joins the *value* mask used by
GAE and the value loss (TRL ``padding_mask_p1``), while the policy loss keeps ``mask``.
``mask`` may have interior holes (multi-turn tool-output tokens, 0 between 1s): every loss and KL
term runs over its valid tokens only, the score's ``last_valid`` is the row's last 1, and GAE and
the whitening cross the holes by ``gae_holes`` and ``whiten_holes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from refppo.conventions import (
    AdvantageEstimator,
    GaeHoles,
    GaePadding,
    GroupKL,
    KLPlacement,
    PolicyLoss,
    ScorePosition,
    Variance,
    WhitenHoles,
    Whitening,
)
from refppo.core.by_rows import (
    entropy_bonus_by_rows,
    kl_loss_by_rows,
    policy_loss_by_rows,
    value_loss_by_rows,
)
from refppo.core.gae import envelope, gae
from refppo.core.group import discounted_returns, group_advantages
from refppo.core.gspo import gspo_policy_loss
from refppo.core.kl import token_kl
from refppo.core.masked import AllReduce
from refppo.core.normalize import normalize
from refppo.core.objective import entropy_bonus, kl_loss, total_loss
from refppo.core.policy import PolicyLossOutput, clipped_policy_loss
from refppo.core.rewards import score_positions, token_rewards
from refppo.core.score_map import map_scores
from refppo.core.value import value_loss
from refppo.errors import ConventionError, SingletonGroupError

# Convention and Hyperparams live in refppo.step_settings; re-exported here, their home for callers
from refppo.step_settings import Convention as Convention
from refppo.step_settings import Hyperparams as Hyperparams
from refppo.step_settings import ScoreMap as ScoreMap
from refppo.validate import check_mask


def value_mask(mask: Tensor, score_at: ScorePosition) -> Tensor:
    """The mask used by GAE and the value loss: ``mask`` plus the score slot when it is outside it.

    ``after_last_valid`` adds position ``L`` (TRL ``padding_mask_p1``); ``last_position`` adds ``T−1``.
    """
    m = check_mask("response_mask", mask)
    pos = score_positions(m, score_at)
    # m | one_hot(pos), without the [B, T] int64 one-hot: a copy of m with each row's slot set
    return m.clone().scatter_(1, pos.unsqueeze(1), True)


def clipped_scores(scores: Tensor, score_clip: float | None, bias: float = 0.0, scale: float = 1.0) -> Tensor:
    """Step 0: ``clip((s + bias)·scale, ±score_clip)`` (:func:`refppo.core.score_map.map_scores`;
    bias 0 and scale 1 leave ``s`` as is). The oracle's fast paths call it by this name."""
    return map_scores(scores, bias=bias, scale=scale, clip=score_clip)


def mapped_scores(scores: Tensor, score_map: ScoreMap | None) -> Tensor:
    """Step 0 under ``score_map`` (None: the identity, ``scores`` itself)."""
    if score_map is None:
        return scores
    return clipped_scores(scores, score_map.clip, score_map.bias, score_map.scale)


@dataclass(frozen=True)
class RolloutQuantities:
    """Steps 1–4: computed once per rollout from cached tensors. All ``[B, T]``."""

    kl: Tensor
    """Per-token KL (old vs ref) — the one that enters the reward (zeros if KL is in the loss)."""
    token_rewards: Tensor
    advantages_raw: Tensor
    """GAE advantages before whitening."""
    advantages: Tensor
    """As fed to the policy loss (after whitening)."""
    returns: Tensor
    """``advantages_raw + old_values``: the value targets."""
    value_mask: Tensor
    """Mask of GAE and the value loss (see :func:`value_mask`)."""


def reward_quantities(
    *,
    scores: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    hp: Hyperparams,
    conv: Convention,
    all_reduce: AllReduce | None = None,
    kl: Tensor | None = None,
    score_map: ScoreMap | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Steps 0–2 of the module docstring: ``(kl, token_rewards, value_mask)``, all ``[B, T]``.

    The per-token KL of the old vs reference log-probs (always, also when KL is placed in the loss),
    the token rewards (score at ``score_at``, ``−β·KL`` when KL is in the reward, then the optional
    reward whitening over the value mask) and the value mask. :func:`rollout_quantities` continues
    from here; the oracle's diagnosis pre-test stops here (the same calls, so the same values).
    ``kl``: step 1's result when the caller already holds it (this very ``token_kl`` call, made for
    another setting with the same estimator and clamps: the oracle's candidates share it).
    ``score_map``: step 0 (:func:`mapped_scores`; None: the scores as given).
    """
    m = check_mask("response_mask", mask)
    scores = mapped_scores(scores, score_map)
    if kl is None:
        kl = token_kl(
            old_logprobs,
            ref_logprobs,
            m,
            conv.kl_estimator,
            log_ratio_clamp=conv.kl_log_ratio_clamp,
            value_clamp=conv.kl_value_clamp,
        )
    beta = hp.kl_coef if conv.kl_in is KLPlacement.REWARD else 0.0
    rewards = token_rewards(scores, kl if beta > 0 else None, m, beta, score_at=conv.score_at)
    vmask = value_mask(m, conv.score_at)
    if conv.whiten_rewards is not Whitening.NONE:
        rewards = normalize(
            rewards,
            vmask,
            conv.whiten_rewards,
            unbiased=conv.whiten_variance is Variance.UNBIASED,
            eps=hp.whiten_eps,
            eps_at=conv.whiten_eps_at,
            all_reduce=all_reduce,
        )
    return kl, rewards, vmask


def rollout_quantities(
    *,
    scores: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    old_values: Tensor | None,
    mask: Tensor,
    hp: Hyperparams,
    conv: Convention,
    all_reduce: AllReduce | None = None,
    group_index: Tensor | None = None,
    groups_on_rank: bool = False,
    score_map: ScoreMap | None = None,
    kl: Tensor | None = None,
) -> RolloutQuantities:
    """Steps 0–4 of the module docstring (steps 0–2: :func:`reward_quantities`).

    ``all_reduce`` (a SUM all-reduce across ranks; None on one process): the tensors are this
    rank's rows and the whitening moments (step 4) are all-reduced, so each rank's advantages equal
    its rows of one process whitening the whole global batch (as verl). Steps 1–3 are per row and
    need no communication. Every rank must call it (the whitening is a collective).

    Step 3 is GAE for ``conv.advantage = gae`` (needs ``old_values``); otherwise the critic-free
    estimator of :func:`critic_free_advantages` (``old_values`` unused, may be None; the group
    estimators need ``group_index`` ``[B]``, the prompt each row answers). Critic-free
    ``returns`` are the raw advantages (verl and OpenRLHF return them as the returns).
    ``groups_on_rank``: with ``all_reduce``, the caller guarantees that every group's rows are on
    this rank (the trainer samples whole groups per rank and checks it), so the per-process group
    statistics are the global ones; without it a group estimator under ``all_reduce`` is refused.
    ``kl``: step 1's result when the caller already holds it (as :func:`reward_quantities`).
    """
    m = check_mask("response_mask", mask)
    scores = mapped_scores(scores, score_map)  # step 0, once: the critic-free estimators read it too
    kl, rewards, vmask = reward_quantities(
        scores=scores,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        mask=m,
        hp=hp,
        conv=conv,
        all_reduce=all_reduce,
        kl=kl,
    )
    unbiased = conv.whiten_variance is Variance.UNBIASED
    if conv.advantage is AdvantageEstimator.GAE:
        if old_values is None:
            raise ConventionError(
                "advantage=gae needs old_values (the critic's rollout values); a critic-free estimator "
                "(advantage=grpo, dr-grpo, rloo, reinforce++, reinforce++-baseline, opo, gpg, grpo-passk, "
                "flash-reinforce) does not"
            )
        gae_mask = vmask if conv.gae_padding is GaePadding.MASKED else torch.ones_like(vmask)
        adv_raw, returns = gae_by_rows(
            rewards, old_values, gae_mask, gamma=hp.gamma, lam=hp.lam, holes=conv.gae_holes
        )
    else:
        adv_raw = critic_free_advantages(
            scores=scores, kl=kl, rewards=rewards, mask=m, value_mask_=vmask, group_index=group_index,
            hp=hp, conv=conv, distributed=all_reduce is not None and not groups_on_rank,
            all_reduce=all_reduce,
        )  # fmt: skip
        returns = adv_raw
    adv = normalize(
        adv_raw,
        m if conv.whiten_holes is WhitenHoles.EXCLUDE else envelope(m),
        conv.whiten_advantages,
        unbiased=unbiased,
        eps=hp.whiten_eps,
        eps_at=conv.whiten_eps_at,
        all_reduce=all_reduce,
    )
    if conv.kl_in is KLPlacement.LOSS:
        kl = torch.zeros_like(kl)
    return RolloutQuantities(kl, rewards, adv_raw, adv, returns, vmask)


ROW_BLOCK_ELEMENTS = 1 << 18
"""Elements per row block of :func:`gae_by_rows` and of :func:`update_quantities` without autograd
(1 MiB of float32: GAE's scan and each loss hold about eight block-sized temporaries at once, and
glibc keeps freed blocks of this size in its heap, so smaller blocks leave less resident)."""


def gae_by_rows(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float, holes: GaeHoles | str
) -> tuple[Tensor, Tensor]:
    """:func:`refppo.core.gae.gae` called on blocks of about :data:`ROW_BLOCK_ELEMENTS` rows'
    elements, written into ``[B, T]`` outputs: the same values bit for bit (GAE reads each row
    alone, with elementwise operations only: see ``_discounted_reverse_cumsum``), with the scan's
    temporaries (about seven ``[B, T]`` tensors) allocated per block. One call for a small batch.
    """
    B, T = mask.shape
    step = max(1, ROW_BLOCK_ELEMENTS // max(T, 1))
    if step >= B:
        return gae(rewards, values, mask, gamma=gamma, lam=lam, holes=holes)
    adv = torch.empty_like(rewards)
    ret = torch.empty_like(rewards)
    for i in range(0, B, step):
        rows = slice(i, min(i + step, B))
        adv[rows], ret[rows] = gae(rewards[rows], values[rows], mask[rows], gamma=gamma, lam=lam, holes=holes)
    return adv, ret


def critic_free_advantages(
    *,
    scores: Tensor,
    kl: Tensor,
    rewards: Tensor,
    mask: Tensor,
    value_mask_: Tensor,
    group_index: Tensor | None,
    hp: Hyperparams,
    conv: Convention,
    distributed: bool = False,
    all_reduce: AllReduce | None = None,
) -> Tensor:
    """Step 3 without a critic: the raw advantages ``[B, T]`` of ``conv.advantage`` (before step 4).

    - ``reinforce++``: ``R_t = Σ_{k≥t} γ^{k−t} r_k`` of the token ``rewards`` over the value mask,
      across interior holes by ``conv.gae_holes`` (:func:`refppo.core.group.discounted_returns`; verl 0.9.1
      ``compute_reinforce_plus_plus_outcome_advantage``, OpenRLHF 0.11.2 ``reinforce``);
    - group estimators (:func:`refppo.core.group.group_advantages`, whitening left to step 4):
      with ``group_kl=fold`` the score of row i is ``Σ_t r_{i,t}`` over the value mask (KL and score
      together, verl ``token_level_rewards.sum(-1)``); with ``to_go`` it is ``scores`` and
      ``−β·KL_t`` is added as its return-to-go (OpenRLHF), β = 0 when the KL is in the loss;
      ``opo``'s lengths are the valid tokens of ``mask``;
    - ``flash-reinforce`` (the batch-mean baseline) needs no ``group_index``; its batch sums,
      ``gpg``'s and ``grpo``'s batch std (``conv.group_std_level`` ``batch``/``batch-centred``) go
      through ``all_reduce`` (every rank's rows, as one process on the whole batch).
    """
    if conv.advantage is AdvantageEstimator.REINFORCE_PP:
        return discounted_returns(rewards, value_mask_, gamma=hp.gamma, holes=conv.gae_holes)
    what = f"advantage={conv.advantage.value}"
    batch_only = conv.advantage is AdvantageEstimator.FLASH_REINFORCE
    if group_index is None and not batch_only:
        raise ConventionError(f"{what} needs group_index [B] (the prompt each row answers)")
    if distributed and not batch_only:
        raise ConventionError(
            f"{what} under a data-parallel all_reduce: the group statistics are per process here; "
            "a group split over ranks would be mis-normalised (not supported yet)"
        )
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    penalty = None
    if conv.group_kl is GroupKL.FOLD:
        s = torch.where(value_mask_, rewards, zero).sum(dim=1)
    else:
        s = scores.to(rewards.dtype)
        if conv.kl_in is KLPlacement.REWARD and hp.kl_coef > 0:
            penalty = torch.where(mask, -hp.kl_coef * kl, zero)
    try:
        return group_advantages(
            s,
            group_index,
            mask,
            estimator=conv.advantage,
            unbiased_std=conv.group_std is Variance.UNBIASED,
            std_level=conv.group_std_level,
            eps=conv.group_eps,
            singleton=conv.group_singleton.value,
            token_penalty=penalty,
            whiten=False,
            all_reduce=all_reduce,
        )
    except SingletonGroupError as exc:
        raise ConventionError(
            f"group_index: prompts {exc.groups} have one response under group_singleton=error "
            "(set group_singleton=score, as verl/SkyRL GRPO, or zero, as verl rloo_vectorized)"
        ) from None


@dataclass(frozen=True)
class UpdateQuantities:
    """Steps 5–9 for one (mini/micro-)batch. Losses are 0-dim and differentiable."""

    loss: Tensor
    pg_loss: Tensor
    vf_loss: Tensor
    entropy_loss: Tensor
    kl_loss: Tensor
    ratio: Tensor
    pg_clipfrac: Tensor
    pg_clipfrac_lower: Tensor
    approx_kl: Tensor
    vf_clipfrac: Tensor

    def stats(self) -> dict[str, float]:
        """The scalars as Python floats (detached) for logging."""
        names: tuple[str, ...] = ("loss", "pg_loss", "vf_loss", "entropy_loss", "kl_loss", "pg_clipfrac")
        names = (*names, "pg_clipfrac_lower", "approx_kl", "vf_clipfrac")
        return {n: float(getattr(self, n).detach()) for n in names}


@dataclass(frozen=True)
class Normalisers:
    """Global normalisers when one optimizer step is split into micro-batches or ranks.

    ``token_count``/``seq_count`` are the valid-token and sequence counts of the WHOLE step
    (policy mask), ``value_token_count`` the valid-token count of the value mask. None: local.
    """

    token_count: float | None = None
    seq_count: float | None = None
    value_token_count: float | None = None

    def kwargs(self, horizon: float | None, *, value: bool = False) -> dict[str, float]:
        """The normaliser keyword arguments of the policy terms (``value``: the value term's, whose
        ``token_count`` is ``value_token_count`` when given), ``horizon`` = ``hp.horizon``; None
        entries are left out (local counts, the padded length)."""
        out = {"token_count": self.token_count, "seq_count": self.seq_count, "horizon": horizon}
        if value and self.value_token_count is not None:
            out["token_count"] = self.value_token_count
        return {k: v for k, v in out.items() if v is not None}


def policy_term(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    hp: Hyperparams,
    conv: Convention,
    norm: Normalisers | None = None,
    rows: int | None = None,
) -> PolicyLossOutput:
    """Step 5–6 of the module docstring: the policy loss of ``conv.policy_loss`` (per token and
    aggregated), as :func:`update_quantities` computes it; the oracle's gradient diagnosis reads
    its per-token loss ``ℓ`` [B, T] (``∂pg/∂A``, :mod:`refppo.oracle.grad_diagnose`).
    ``rows``: evaluate by blocks of that many rows (:mod:`refppo.core.by_rows`: the same values bit
    for bit, no autograd graph); None: the whole batch at once."""
    pol_norm = (norm or Normalisers()).kwargs(hp.horizon)
    if rows is not None:
        gspo = conv.policy_loss is PolicyLoss.GSPO
        return policy_loss_by_rows(
            rows, logprobs, old_logprobs, advantages, mask, gspo=gspo, clip_low=hp.cliprange,
            clip_high=hp.cliprange_high, dual_clip=None if gspo else conv.dual_clip, agg=conv.loss_agg,
            log_ratio_clamp=conv.log_ratio_clamp, **pol_norm,
        )  # fmt: skip
    if conv.policy_loss is PolicyLoss.GSPO:
        return gspo_policy_loss(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            clip_low=hp.cliprange,
            clip_high=hp.cliprange_high,
            agg=conv.loss_agg,
            log_ratio_max=conv.log_ratio_clamp,
            **pol_norm,
        )
    return clipped_policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=hp.cliprange,
        clip_high=hp.cliprange_high,
        dual_clip=conv.dual_clip,
        agg=conv.loss_agg,
        log_ratio_clamp=conv.log_ratio_clamp,
        **pol_norm,
    )


def update_rows(mask: Tensor, *inputs: Tensor | None) -> int | None:
    """Rows per block of :func:`update_quantities`: about :data:`ROW_BLOCK_ELEMENTS` elements' worth
    when there is no autograd graph to build (grad mode off, or no input requires a gradient);
    None (the whole batch at once) under autograd or for a batch of at most
    :data:`ROW_BLOCK_ELEMENTS` elements."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
        return None
    B, T = mask.shape
    step = max(1, ROW_BLOCK_ELEMENTS // max(T, 1))
    return None if step >= B else step


def update_quantities(
    *,
    logprobs: Tensor,
    values: Tensor | None,
    old_logprobs: Tensor,
    old_values: Tensor | None,
    advantages: Tensor,
    returns: Tensor,
    mask: Tensor,
    value_mask_: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    hp: Hyperparams,
    conv: Convention,
    norm: Normalisers | None = None,
) -> UpdateQuantities:
    """Steps 5–9 of the module docstring.

    ``values``/``old_values`` None (a critic-free step, ``conv.advantage`` ≠ ``gae``): no value
    loss, ``vf_loss`` and ``vf_clipfrac`` are 0 and the total loss has no value term.
    Without an autograd graph (no input requires a gradient, or grad mode is off: the oracle's
    recompute) a batch over :data:`ROW_BLOCK_ELEMENTS` elements is evaluated by blocks of rows
    (:func:`update_rows`, :mod:`refppo.core.by_rows`): the same values bit for bit, without the
    whole-batch per-token temporaries. The trainer's differentiated call takes the whole batch.
    """
    m = check_mask("response_mask", mask)
    vm = m if value_mask_ is None else check_mask("value_mask", value_mask_)
    nm = norm or Normalisers()
    pol_norm = nm.kwargs(hp.horizon)
    val_norm = nm.kwargs(hp.horizon, value=True)
    rows = update_rows(
        m, logprobs, values, old_logprobs, old_values, advantages, returns, ref_logprobs, entropy
    )
    pg = policy_term(logprobs, old_logprobs, advantages, m, hp=hp, conv=conv, norm=nm, rows=rows)
    # Keep what is returned; the per-token loss [B, T] is not, so it is freed before the value
    # loss allocates its own (under autograd the graph keeps what the backward pass needs).
    pg_loss, pg_ratio, pg_clipfrac, pg_clipfrac_lower, pg_approx_kl = (
        pg.loss, pg.ratio, pg.clipfrac, pg.clipfrac_lower, pg.approx_kl
    )  # fmt: skip
    del pg
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    if values is None or old_values is None:
        if conv.advantage is AdvantageEstimator.GAE:
            raise ConventionError("advantage=gae needs values and old_values for the value loss")
        vf_loss, vf_clipfrac = zero, zero
    else:
        vf_fn = value_loss if rows is None else partial(value_loss_by_rows, rows)
        vf = vf_fn(
            values,
            old_values,
            returns,
            vm,
            clip=hp.cliprange_value,
            kind=conv.value_loss,
            agg=conv.loss_agg if conv.value_loss_agg is None else conv.value_loss_agg,
            clip_form=conv.value_clip_form,
            **val_norm,
        )
        vf_loss, vf_clipfrac = vf.loss, vf.clipfrac
        del vf
    ent_agg = conv.loss_agg if conv.entropy_agg is None else conv.entropy_agg
    if entropy is None:
        ent = zero
    elif rows is None:
        ent = entropy_bonus(entropy, m, ent_agg, **pol_norm)
    else:
        ent = entropy_bonus_by_rows(rows, entropy, m, ent_agg, **pol_norm)
    if conv.kl_in is KLPlacement.LOSS:
        if ref_logprobs is None:
            raise ConventionError("kl_in=loss needs ref_logprobs for the KL loss on the current log-probs")
        kl_fn = kl_loss if rows is None else partial(kl_loss_by_rows, rows)
        kll = kl_fn(
            logprobs,
            ref_logprobs,
            m,
            conv.kl_estimator,
            conv.loss_agg if conv.kl_loss_agg is None else conv.kl_loss_agg,
            log_ratio_clamp=conv.kl_log_ratio_clamp,
            value_clamp=conv.kl_value_clamp,
            **pol_norm,
        )
    else:
        kll = zero
    loss = total_loss(
        pg_loss,
        vf_loss,
        ent,
        kll,
        vf_coef=hp.vf_coef,
        ent_coef=hp.ent_coef,
        kl_coef=hp.kl_coef if conv.kl_in is KLPlacement.LOSS else 0.0,
    )
    return UpdateQuantities(
        loss=loss,
        pg_loss=pg_loss,
        vf_loss=vf_loss,
        entropy_loss=ent,
        kl_loss=kll,
        ratio=pg_ratio,
        pg_clipfrac=pg_clipfrac,
        pg_clipfrac_lower=pg_clipfrac_lower,
        approx_kl=pg_approx_kl,
        vf_clipfrac=vf_clipfrac,
    )
