"""Critic-free advantages: group baselines (GRPO, Dr. GRPO, RLOO, OPO, GPG, GRPO pass@k), the batch
baseline (Flash-REINFORCE) and whitened returns (REINFORCE++).

Row ``i`` answers prompt ``g(i)`` (``group_index``); its group is ``G_i = {j : g(j) = g(i)}``,
``n = |G_i|``, with outcome score ``s_i``. The scalar advantage ``a_i`` of each estimator::

    grpo                  a_i = (s_i − μ_G) / (σ_G + ε)         μ_G = (1/n) Σ_{j∈G} s_j
                                                                 σ_G² = Σ_{j∈G} (s_j − μ_G)² / (n−1)
                                                                        (or / n: unbiased_std=False)
    grpo, std_level=batch a_i = (s_i − μ_G) / (σ_B + ε)         σ_B² = Σ_{j∈batch} (s_j − μ_B)² / (B−1)
                                                                 (TRL scale_rewards="batch")
    grpo, batch-centred   a_i = (s_i − μ_G) / (σ_C + ε)         σ_C² = Σ_{j∈batch} (s_j − μ_G(j))² / (B−1)
                                                                 (AReaL mean_level group, std_level batch)
    grpo, no std scaling  a_i = s_i − μ_G                        (verl norm_adv_by_std_in_grpo=False)
    dr-grpo               a_i = s_i − μ_G                        (Liu et al. 2025, "Dr. GRPO")
    rloo                  a_i = s_i − (1/(n−1)) Σ_{j∈G, j≠i} s_j (Ahmadian et al. 2024)
    reinforce++-baseline  a_i = s_i − μ_G, then whitened over the batch's valid tokens
    opo                   a_i = s_i − Σ_{j∈G} L_j s_j / Σ_{j∈G} L_j   L_j = row j's valid tokens
                                                                 (verl ``opo``: length-weighted mean)
    gpg                   a_i = α·(s_i − μ_G)                    α = B / max(#{j : s_j ≠ 0}, 1) over
                                                                 the batch (verl ``gpg``)
    grpo-passk            a_i = (s_i − s_2nd(G)) / (σ_G + ε)     for the group's unique best row
                                                                 (s_i = max_G s), 0 for every other
                                                                 row (verl ``grpo_passk``); σ_G, ε
                                                                 and std_level as for grpo
    flash-reinforce       a_i = s_i − (1/B) Σ_{j∈batch} s_j      the batch mean: no group_index
                                                                 (OpenRLHF ``flash_reinforce``)

``a_i`` is broadcast over the row's valid tokens (``A_{i,t} = a_i·m_{i,t}``); padded positions
are exactly 0 and never read. An optional per-token ``token_penalty`` ``p`` (e.g. ``−β·KL_t``)
is added as its return-to-go, ``A_{i,t} = a_i + Σ_{k≥t, m_k=1} p_{i,k}`` (OpenRLHF 0.11.2
``experience_maker.py::compute_advantages_and_returns``: ``compute_reward`` then
``get_cumulative_returns`` with γ = 1). verl instead folds the KL into the score
(``scores = token_level_rewards.sum(-1)``): pass ``scores = s − β·Σ_t KL_t`` and no penalty.

REINFORCE++ (Hu 2025, :func:`reinforce_pp_advantages`) needs no group: the discounted
return-to-go of the token rewards ``R_t = Σ_{k≥t} γ^{k−t} r_k`` (across interior holes by ``holes``,
as GAE's ``gae_holes``), whitened over the batch's valid tokens: ``A = (R − μ)/sqrt(σ² + ε)`` (verl)
or ``(R − μ)/sqrt(max(σ², ε))`` (OpenRLHF).

A group of one (``n = 1``) has no leave-one-out mean and no unbiased std; ``singleton`` says what
happens: ``error`` (refppo default; OpenRLHF ``cli/train_ppo_ray.py`` asserts
``n_samples_per_prompt > 1``), ``score`` (μ := 0, σ := 1, so ``a_i = s_i/(1+ε)`` or ``s_i``, and
``α·s_i`` under ``gpg``; refused under ``grpo-passk``, which has no second-best score there: verl
0.9.1 ``compute_grpo_outcome_advantage``, ``compute_rloo_outcome_advantage``,
``compute_reinforce_plus_plus_baseline_outcome_advantage``; SkyRL-train 0.3.1 likewise), ``zero``
(``a_i = 0``: verl ``compute_rloo_vectorized_outcome_advantage``, OpenRLHF ``dr_grpo``/
``reinforce_baseline`` arithmetic).

Equal scores in a group (σ = 0): ``ε`` keeps ``(s−μ)/(σ+ε)`` finite; it is exactly 0 when the
group mean rounds back to ``s`` (e.g. 0/1 rewards). In float32 a mean that rounds one ulp off ``s``
divided by ``σ + ε`` with ``ε = 1e-6`` can be far from 0: ε is a guard against division by 0, not
a tolerance (the peers share this: verl/SkyRL divide the same ``torch.mean``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from refppo.conventions import AdvantageEstimator, GaeHoles, parse
from refppo.core._group_checks import (
    _check_lengths,
    _check_options,
    _check_scalar_inputs,
    _checked_group_index,
    _checked_group_inputs,
    _checked_returns_inputs,
)
from refppo.core._group_stats import batch_stats, group_sigma, passk_margin
from refppo.core.checks import check_mask, check_nonneg
from refppo.core.gae import gae

# the naive twins live in group_naive.py, re-exported here (tests and callers import them from here)
from refppo.core.group_naive import (
    Singleton,
    WhitenEps,
)
from refppo.core.masked import AllReduce, masked_moments
from refppo.errors import HyperparameterError, SingletonGroupError
from refppo.group_conventions import GroupStdLevel
from refppo.types import ResponseMask, SeqFloat, TokenFloat


def _whiten(x: Tensor, m: Tensor, unbiased: bool, eps: float, form: str) -> Tensor:
    """``(x−μ)·rsqrt(σ²+ε)`` (``add``) or ``(x−μ)·rsqrt(max(σ², ε))`` (``clamp``); 0 on padding."""
    mu, var = masked_moments(x, m, unbiased=unbiased)
    denom = var + eps if form == "add" else torch.clamp(var, min=eps)
    return torch.where(m, (x - mu) * torch.rsqrt(denom), torch.zeros((), dtype=x.dtype, device=x.device))


def group_scalar_advantages(
    scores: SeqFloat,
    group_index: Tensor | None,
    *,
    estimator: AdvantageEstimator | str = AdvantageEstimator.GRPO,
    scale_by_std: bool = True,
    unbiased_std: bool = True,
    eps: float = 1e-6,
    singleton: Singleton = "error",
    lengths: SeqFloat | None = None,
    all_reduce: AllReduce | None = None,
    std_level: GroupStdLevel | str = GroupStdLevel.GROUP,
) -> SeqFloat:
    """Per-row scalar advantage ``a`` ``[B]`` before broadcasting (module docstring's table).

    ``scale_by_std`` only applies to ``grpo`` and ``grpo-passk`` (verl ``norm_adv_by_std_in_grpo``);
    ``eps`` is added to the std, ``(s−μ)/(σ+ε)`` (verl ``epsilon=1e-6``, OpenRLHF ``group_norm``
    1e-9, SkyRL 1e-6). ``reinforce++-baseline`` returns the centred score (its whitening is
    token-level). ``lengths`` ``[B]``: the valid tokens of each row (``opo`` only).
    ``flash-reinforce`` needs no ``group_index`` (None allowed). ``all_reduce``: the batch-level
    sums of ``gpg`` (``B``, ``#{s ≠ 0}``) and ``flash-reinforce`` (``B``, ``Σ s``) over every rank,
    so each rank's rows equal one process on the whole batch (groups are per rank: the caller
    keeps each group on one rank). ``std_level``: the rows of ``grpo``'s (and ``grpo-passk``'s) σ,
    ``group``, ``batch`` or ``batch-centred`` (module docstring; the batch levels' sums all-reduced
    too); a group of one under ``singleton='score'`` keeps ``σ := 1`` at every level.
    """
    est = parse(AdvantageEstimator, estimator, what="estimator")
    level = parse(GroupStdLevel, std_level, what="std_level")
    s = _check_scalar_inputs(est, scores, eps, singleton, lengths)
    if est is AdvantageEstimator.FLASH_REINFORCE:
        return _flash_reinforce(s, group_index, all_reduce)
    grp = _groups(est, s, group_index, singleton)
    sigma = None
    if scale_by_std and est in (AdvantageEstimator.GRPO, AdvantageEstimator.GRPO_PASSK):
        sigma = group_sigma(s, grp.mu, grp.inv, level, unbiased_std, all_reduce)
    a, raw = _centred(est, s, grp, sigma, eps, lengths, all_reduce)
    zero = torch.zeros_like(a)
    return torch.where(grp.single, raw if singleton == "score" else zero, a)


def _flash_reinforce(s: Tensor, group_index: Tensor | None, all_reduce: AllReduce | None) -> Tensor:
    """``flash-reinforce``: ``a_i = s_i − (1/B) Σ_j s_j`` over the whole batch (every rank's)."""
    _checked_group_index(AdvantageEstimator.FLASH_REINFORCE, group_index, s)
    n_sum = batch_stats(torch.stack([torch.ones_like(s).sum(), s.sum()]), all_reduce)
    return s - n_sum[1] / n_sum[0]


@dataclass(frozen=True)
class _Groups:
    """The batch's ``K`` groups, renumbered ``0..K−1`` by sorted prompt id: ``inv`` ``[B]`` (long)
    each row's group, ``n_i`` ``[B]`` its size ``n``, ``total`` ``[K]`` each group's ``Σ_{j∈G} s_j``,
    ``mu`` ``[B]`` each row's ``μ_G``, ``single`` ``[B]`` (bool) the rows alone in their group."""

    inv: Tensor
    K: int
    n_i: Tensor
    total: Tensor
    mu: Tensor
    single: Tensor


def _groups(est: AdvantageEstimator, s: Tensor, group_index: Tensor | None, singleton: str) -> _Groups:
    """The groups of ``group_index`` (checked), refusing groups of one by ``singleton``."""
    g = _checked_group_index(est, group_index, s)
    assert g is not None  # a group estimator: None refused above
    _, inv = torch.unique(g, return_inverse=True)
    K = int(inv.max()) + 1
    n = torch.bincount(inv, minlength=K).to(s.dtype)
    n_i = n[inv]
    single = n_i == 1
    if singleton == "error" and bool(single.any()):
        ids = g[single].tolist()[:8]
        raise SingletonGroupError(
            ids, f"group_index: groups {ids} have one response (pass singleton='score' or 'zero')"
        )
    if est is AdvantageEstimator.GRPO_PASSK and singleton == "score" and bool(single.any()):
        raise HyperparameterError(
            "singleton: grpo-passk has no second-best score in a group of one; use 'error' (verl) or 'zero'"
        )
    total = torch.zeros(K, dtype=s.dtype, device=s.device).index_add(0, inv, s)
    return _Groups(inv, K, n_i, total, (total / n)[inv], single)


def _centred(
    est: AdvantageEstimator,
    s: Tensor,
    grp: _Groups,
    sigma: Tensor | None,
    eps: float,
    lengths: SeqFloat | None,
    all_reduce: AllReduce | None,
) -> tuple[Tensor, Tensor]:
    """``(a, raw)`` ``[B]``: each row's advantage by ``est`` (module docstring's table; ``σ`` scales
    ``grpo``/``dr-grpo``/``reinforce++-baseline`` when given), and ``raw``, its value for a group of
    one under ``singleton='score'`` (``μ := 0``, ``σ := 1``)."""
    inv, K = grp.inv, grp.K
    if est is AdvantageEstimator.RLOO:
        return s - (grp.total[inv] - s) / torch.clamp(grp.n_i - 1, min=1), s
    if est is AdvantageEstimator.OPO:
        L = _lengths(lengths, s)
        num = torch.zeros(K, dtype=s.dtype, device=s.device).index_add(0, inv, L * s)
        den = torch.zeros(K, dtype=s.dtype, device=s.device).index_add(0, inv, L)
        return s - (num / den)[inv], s
    if est is AdvantageEstimator.GRPO_PASSK:
        return passk_margin(s, inv, K, sigma, eps), s
    if est is AdvantageEstimator.GPG:
        b_nz = batch_stats(torch.stack([torch.ones_like(s).sum(), (s != 0).to(s.dtype).sum()]), all_reduce)
        alpha = b_nz[0] / torch.clamp(b_nz[1], min=1)
        return alpha * (s - grp.mu), alpha * s
    a = s - grp.mu
    if sigma is None:
        return a, s
    return a / (sigma + eps), s / (1.0 + eps)


def _lengths(lengths: SeqFloat | None, s: Tensor) -> Tensor:
    """``opo``'s ``L`` in ``s``'s dtype (given and checked: :func:`_check_scalar_inputs`)."""
    assert lengths is not None
    return _check_lengths(lengths, s.shape[0]).to(s.dtype)


def group_advantages(
    scores: SeqFloat,
    group_index: Tensor | None,
    mask: ResponseMask,
    *,
    estimator: AdvantageEstimator | str = AdvantageEstimator.GRPO,
    scale_by_std: bool = True,
    unbiased_std: bool = True,
    eps: float = 1e-6,
    singleton: Singleton = "error",
    token_penalty: TokenFloat | None = None,
    whiten_unbiased: bool = True,
    whiten_eps: float = 1e-8,
    whiten_eps_form: WhitenEps = "add",
    whiten: bool = True,
    all_reduce: AllReduce | None = None,
    std_level: GroupStdLevel | str = GroupStdLevel.GROUP,
) -> TokenFloat:
    """Token advantages ``[B, T]``: ``a_i`` (:func:`group_scalar_advantages`) on valid tokens, 0 on padding.

    ``opo``'s lengths ``L_i`` are the valid tokens of ``mask``'s rows; ``all_reduce``: the batch
    sums of ``gpg``, ``flash-reinforce`` and the batch ``std_level``s over every rank
    (:func:`group_scalar_advantages`).

    ``token_penalty`` ``[B, T]`` (optional) adds its return-to-go ``Σ_{k≥t} p_k`` (OpenRLHF).
    ``reinforce++-baseline`` whitens the result over the batch's valid tokens with
    ``whiten_unbiased`` (verl: True; OpenRLHF: False) and ``whiten_eps_form`` (verl ``add``:
    ``rsqrt(σ²+1e-8)``; OpenRLHF ``clamp``: ``rsqrt(max(σ², 1e-8))``). ``whiten=False`` leaves
    that whitening to the caller (:func:`refppo.pipeline.step.rollout_quantities` applies its own step 4,
    the ``whiten_*`` conventions, so one set of keys says how every advantage is whitened).
    """
    m, p = _checked_group_inputs(
        scores, group_index, mask, estimator=estimator, std_level=std_level, eps=eps, singleton=singleton,
        token_penalty=token_penalty, whiten_eps=whiten_eps, whiten_eps_form=whiten_eps_form,
    )  # fmt: skip
    a = group_scalar_advantages(
        scores, group_index, estimator=estimator, scale_by_std=scale_by_std,
        unbiased_std=unbiased_std, eps=eps, singleton=singleton, all_reduce=all_reduce,
        std_level=std_level, lengths=_row_lengths(estimator, scores, m),
    )  # fmt: skip
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    adv = torch.where(m, a.unsqueeze(1).expand(m.shape), zero)
    if p is not None:
        adv = adv + gae(p, torch.zeros_like(p), m, gamma=1.0, lam=1.0)[0]
    if whiten and parse(AdvantageEstimator, estimator) is AdvantageEstimator.REINFORCE_PP_BASELINE:
        adv = _whiten(adv, m, whiten_unbiased, whiten_eps, whiten_eps_form)
    return adv


def _row_lengths(estimator: AdvantageEstimator | str, scores: object, m: Tensor) -> Tensor | None:
    """``opo``'s ``L_i``: the valid tokens of each row of the checked mask (None for the other
    estimators, which do not read them)."""
    if not isinstance(scores, Tensor) or parse(AdvantageEstimator, estimator, what="estimator") is not (
        AdvantageEstimator.OPO
    ):
        return None
    return m.sum(dim=1).to(scores.dtype)


def discounted_returns(
    rewards: TokenFloat, mask: ResponseMask, *, gamma: float = 1.0, holes: GaeHoles | str = GaeHoles.SKIP
) -> TokenFloat:
    """REINFORCE++'s returns ``[B, T]``, 0 after each row's last valid token; across holes by ``holes``::

        skip     R_t = Σ_{i≥0} γ^i r_{u_i}, u_0 = t < u_1 < … the valid positions from t (holes
                 transparent: verl 0.9.1 ``compute_reinforce_plus_plus_outcome_advantage`` carries
                 ``running_return`` across ``response_mask = 0``)
        zero     R_t = Σ_{k=t}^{last} γ^{k−t} m_k r_k  (each hole a time step with reward 0: OpenRLHF
                 0.11.2 ``get_cumulative_returns`` on ``action_mask * rewards``)
        through  R_t = Σ_{k=t}^{last} γ^{k−t} r_k  (each hole a time step, its reward read)

    :func:`refppo.core.gae.gae` with ``V = 0, λ = 1`` and the same ``holes`` (one path);
    :func:`reinforce_pp_advantages` whitens it. With ``zero``/``through`` the holes carry their
    return too (as GAE's); the policy loss never reads them.
    """
    r, m, gamma = _checked_returns_inputs(rewards, mask, gamma, holes)
    return gae(r, torch.zeros_like(r), m, gamma=gamma, lam=1.0, holes=holes)[0]


def reinforce_pp_advantages(
    rewards: TokenFloat,
    mask: ResponseMask,
    *,
    gamma: float = 1.0,
    whiten_unbiased: bool = True,
    whiten_eps: float = 1e-8,
    whiten_eps_form: WhitenEps = "add",
    holes: GaeHoles | str = GaeHoles.SKIP,
) -> TokenFloat:
    """REINFORCE++: ``R_t = Σ_{k≥t} γ^{k−t} r_k`` over valid tokens, whitened over the batch; ``[B, T]``.

    ``holes``: how the return crosses interior mask holes (:func:`discounted_returns`).

    ``rewards`` are token rewards (score plus ``−β·KL_t``, :func:`refppo.core.rewards.token_rewards`).
    The return is :func:`refppo.core.gae.gae` with ``V = 0, λ = 1`` (one path). Sources: verl 0.9.1
    ``compute_reinforce_plus_plus_outcome_advantage`` (unbiased, ``add``); OpenRLHF 0.11.2
    ``reinforce`` (population, ``clamp``).
    """
    _check_options("error", whiten_eps_form)
    check_nonneg("whiten_eps", whiten_eps)
    m = check_mask("mask", mask)
    ret = discounted_returns(rewards, m, gamma=gamma, holes=holes)
    return _whiten(ret, m, whiten_unbiased, whiten_eps, whiten_eps_form)
