"""Critic-free advantages: group baselines (GRPO, Dr. GRPO, RLOO) and whitened returns (REINFORCE++).

Row ``i`` answers prompt ``g(i)`` (``group_index``); its group is ``G_i = {j : g(j) = g(i)}``,
``n = |G_i|``, with outcome score ``s_i``. The scalar advantage ``a_i`` of each estimator::

    grpo                  a_i = (s_i − μ_G) / (σ_G + ε)         μ_G = (1/n) Σ_{j∈G} s_j
                                                                 σ_G² = Σ_{j∈G} (s_j − μ_G)² / (n−1)
                                                                        (or / n: unbiased_std=False)
    grpo, no std scaling  a_i = s_i − μ_G                        (verl norm_adv_by_std_in_grpo=False)
    dr-grpo               a_i = s_i − μ_G                        (Liu et al. 2025, "Dr. GRPO")
    rloo                  a_i = s_i − (1/(n−1)) Σ_{j∈G, j≠i} s_j (Ahmadian et al. 2024)
    reinforce++-baseline  a_i = s_i − μ_G, then whitened over the batch's valid tokens

``a_i`` is broadcast over the row's valid tokens (``A_{i,t} = a_i·m_{i,t}``); padded positions
are exactly 0 and never read. An optional per-token ``token_penalty`` ``p`` (e.g. ``−β·KL_t``)
is added as its return-to-go, ``A_{i,t} = a_i + Σ_{k≥t, m_k=1} p_{i,k}`` (OpenRLHF 0.11.2
``experience_maker.py::compute_advantages_and_returns``: ``compute_reward`` then
``get_cumulative_returns`` with γ = 1). verl instead folds the KL into the score
(``scores = token_level_rewards.sum(-1)``): pass ``scores = s − β·Σ_t KL_t`` and no penalty.

REINFORCE++ (Hu 2025, :func:`reinforce_pp_advantages`) needs no group: the discounted
return-to-go of the token rewards ``R_t = Σ_{k≥t} γ^{k−t} r_k`` (interior holes transparent), whitened
over the batch's valid tokens: ``A = (R − μ)/sqrt(σ² + ε)`` (verl) or ``(R − μ)/sqrt(max(σ², ε))``
(OpenRLHF).

A group of one (``n = 1``) has no leave-one-out mean and no unbiased std; ``singleton`` says what
happens: ``error`` (refppo default; OpenRLHF ``cli/train_ppo_ray.py`` asserts
``n_samples_per_prompt > 1``), ``score`` (μ := 0, σ := 1, so ``a_i = s_i/(1+ε)`` or ``s_i``: verl
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

import math
from typing import Literal

import torch
from torch import Tensor

from refppo.conventions import AdvantageEstimator, parse
from refppo.core import _pyfloat as pf
from refppo.core.gae import gae
from refppo.core.masked import masked_moments
from refppo.errors import DtypeError, HyperparameterError, MaskError, ShapeError, SingletonGroupError
from refppo.types import ResponseMask, SeqFloat, TokenFloat
from refppo.validate import check_b, check_bt, check_float, check_mask, check_nonneg, check_unit_interval

Singleton = Literal["error", "score", "zero"]
WhitenEps = Literal["add", "clamp"]
GROUP_ESTIMATORS = (
    AdvantageEstimator.GRPO,
    AdvantageEstimator.DR_GRPO,
    AdvantageEstimator.RLOO,
    AdvantageEstimator.REINFORCE_PP_BASELINE,
)


def _check_group_index(group_index: object, B: int, device: torch.device) -> Tensor:
    if not isinstance(group_index, Tensor):
        raise DtypeError(f"group_index: expected a torch.Tensor, got {type(group_index).__name__}")
    if group_index.dtype.is_floating_point or group_index.dtype == torch.bool or group_index.is_complex():
        raise DtypeError(
            f"group_index: expected an integer tensor (prompt ids), got dtype {group_index.dtype}"
        )
    if group_index.shape != (B,):
        shape = "[" + ", ".join(str(s) for s in group_index.shape) + "]"
        raise ShapeError(f"group_index: expected shape [B] = [{B}] (batch), got {shape}")
    if group_index.device != device:
        raise ShapeError(f"group_index: expected device {device}, got {group_index.device}")
    return group_index


def _check_options(singleton: str, whiten_eps_form: str) -> None:
    if singleton not in ("error", "score", "zero"):
        raise HyperparameterError(f"singleton: expected 'error', 'score' or 'zero', got {singleton!r}")
    if whiten_eps_form not in ("add", "clamp"):
        raise HyperparameterError(f"whiten_eps_form: expected 'add' or 'clamp', got {whiten_eps_form!r}")


def _whiten(x: Tensor, m: Tensor, unbiased: bool, eps: float, form: str) -> Tensor:
    """``(x−μ)·rsqrt(σ²+ε)`` (``add``) or ``(x−μ)·rsqrt(max(σ², ε))`` (``clamp``); 0 on padding."""
    mu, var = masked_moments(x, m, unbiased=unbiased)
    denom = var + eps if form == "add" else torch.clamp(var, min=eps)
    return torch.where(m, (x - mu) * torch.rsqrt(denom), torch.zeros((), dtype=x.dtype, device=x.device))


def group_scalar_advantages(
    scores: SeqFloat,
    group_index: Tensor,
    *,
    estimator: AdvantageEstimator | str = AdvantageEstimator.GRPO,
    scale_by_std: bool = True,
    unbiased_std: bool = True,
    eps: float = 1e-6,
    singleton: Singleton = "error",
) -> SeqFloat:
    """Per-row scalar advantage ``a`` ``[B]`` before broadcasting (module docstring's table).

    ``scale_by_std`` only applies to ``grpo`` (verl ``norm_adv_by_std_in_grpo``); ``eps`` is added
    to the std, ``(s−μ)/(σ+ε)`` (verl ``epsilon=1e-6``, OpenRLHF ``group_norm`` 1e-9, SkyRL 1e-6).
    ``reinforce++-baseline`` returns the centred score (its whitening is token-level).
    """
    est = parse(AdvantageEstimator, estimator, what="estimator")
    if est not in GROUP_ESTIMATORS:
        raise HyperparameterError(
            f"estimator: {est.value!r} is not a group estimator (see reinforce_pp_advantages)"
        )
    s = check_float("scores", scores)
    if s.dim() != 1 or s.shape[0] == 0:
        raise ShapeError(f"scores: expected shape [B] (batch) with B >= 1, got {list(s.shape)}")
    g = _check_group_index(group_index, s.shape[0], s.device)
    check_nonneg("eps", eps)
    _check_options(singleton, "add")
    _, inv = torch.unique(g, return_inverse=True)
    K = int(inv.max()) + 1
    n = torch.bincount(inv, minlength=K).to(s.dtype)
    n_i = n[inv]
    if singleton == "error" and bool((n_i == 1).any()):
        ids = g[n_i == 1].tolist()[:8]
        raise SingletonGroupError(
            ids, f"group_index: groups {ids} have one response (pass singleton='score' or 'zero')"
        )
    total = torch.zeros(K, dtype=s.dtype, device=s.device).index_add(0, inv, s)
    mu = (total / n)[inv]
    single = n_i == 1
    if est is AdvantageEstimator.RLOO:
        a = s - (total[inv] - s) / torch.clamp(n_i - 1, min=1)
    else:
        a = s - mu
        if est is AdvantageEstimator.GRPO and scale_by_std:
            sq = torch.zeros(K, dtype=s.dtype, device=s.device).index_add(0, inv, (s - mu) ** 2)
            dof = torch.clamp(n - 1, min=1) if unbiased_std else n
            a = a / (torch.sqrt(sq / dof)[inv] + eps)
    if singleton == "score":
        raw = s / (1.0 + eps) if (est is AdvantageEstimator.GRPO and scale_by_std) else s
        a = torch.where(single, raw, a)
    else:
        a = torch.where(single, torch.zeros_like(a), a)
    return a


def group_advantages(
    scores: SeqFloat,
    group_index: Tensor,
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
) -> TokenFloat:
    """Token advantages ``[B, T]``: ``a_i`` (:func:`group_scalar_advantages`) on valid tokens, 0 on padding.

    ``token_penalty`` ``[B, T]`` (optional) adds its return-to-go ``Σ_{k≥t} p_k`` (OpenRLHF).
    ``reinforce++-baseline`` whitens the result over the batch's valid tokens with
    ``whiten_unbiased`` (verl: True; OpenRLHF: False) and ``whiten_eps_form`` (verl ``add``:
    ``rsqrt(σ²+1e-8)``; OpenRLHF ``clamp``: ``rsqrt(max(σ², 1e-8))``). ``whiten=False`` leaves
    that whitening to the caller (:func:`refppo.pipeline.rollout_quantities` applies its own step 4,
    the ``whiten_*`` conventions, so one set of keys says how every advantage is whitened).
    """
    m = check_mask("mask", mask)
    _check_options(singleton, whiten_eps_form)
    check_nonneg("whiten_eps", whiten_eps)
    if isinstance(scores, Tensor) and scores.shape[:1] != m.shape[:1]:
        check_b("scores", scores, m.shape[0], m.device)
    a = group_scalar_advantages(
        scores, group_index, estimator=estimator, scale_by_std=scale_by_std,
        unbiased_std=unbiased_std, eps=eps, singleton=singleton,
    )  # fmt: skip
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    adv = torch.where(m, a.unsqueeze(1).expand(m.shape), zero)
    if token_penalty is not None:
        p = check_bt("token_penalty", token_penalty, m)
        if p.dtype != a.dtype:
            raise DtypeError(
                f"expected one floating dtype for all inputs, got scores={a.dtype}, token_penalty={p.dtype}"
            )
        adv = adv + gae(p, torch.zeros_like(p), m, gamma=1.0, lam=1.0)[0]
    if whiten and parse(AdvantageEstimator, estimator) is AdvantageEstimator.REINFORCE_PP_BASELINE:
        adv = _whiten(adv, m, whiten_unbiased, whiten_eps, whiten_eps_form)
    return adv


def discounted_returns(rewards: TokenFloat, mask: ResponseMask, *, gamma: float = 1.0) -> TokenFloat:
    """``R_t = Σ_{k≥t, m_k=1} γ^{(#valid between)} r_k`` ``[B, T]``, 0 on padding: REINFORCE++'s returns.

    :func:`refppo.core.gae.gae` with ``V = 0, λ = 1`` (one path); :func:`reinforce_pp_advantages`
    whitens it.
    """
    m = check_mask("mask", mask)
    r = check_bt("rewards", rewards, m)
    gamma = check_unit_interval("gamma", gamma)
    return gae(r, torch.zeros_like(r), m, gamma=gamma, lam=1.0)[0]


def reinforce_pp_advantages(
    rewards: TokenFloat,
    mask: ResponseMask,
    *,
    gamma: float = 1.0,
    whiten_unbiased: bool = True,
    whiten_eps: float = 1e-8,
    whiten_eps_form: WhitenEps = "add",
) -> TokenFloat:
    """REINFORCE++: ``R_t = Σ_{k≥t} γ^{k−t} r_k`` over valid tokens, whitened over the batch; ``[B, T]``.

    ``rewards`` are token rewards (score plus ``−β·KL_t``, :func:`refppo.core.rewards.token_rewards`).
    The return is :func:`refppo.core.gae.gae` with ``V = 0, λ = 1`` (one path). Sources: verl 0.9.1
    ``compute_reinforce_plus_plus_outcome_advantage`` (unbiased, ``add``); OpenRLHF 0.11.2
    ``reinforce`` (population, ``clamp``).
    """
    _check_options("error", whiten_eps_form)
    check_nonneg("whiten_eps", whiten_eps)
    m = check_mask("mask", mask)
    ret = discounted_returns(rewards, m, gamma=gamma)
    return _whiten(ret, m, whiten_unbiased, whiten_eps, whiten_eps_form)


# ----------------------------------------------------------------------------------------------
# Naive twins: one Python float at a time, as the papers write them.
# ----------------------------------------------------------------------------------------------


def _whiten_naive(
    rows: list[list[float]], ms: list[list[bool]], unbiased: bool, eps: float, form: str
) -> list[list[float]]:
    vals = [v for row, mr in zip(rows, ms, strict=True) for v, ok in zip(row, mr, strict=True) if ok]
    n = len(vals)
    if unbiased and n < 2:
        raise MaskError(f"mask: an unbiased variance needs at least 2 valid tokens, got {n}")
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1 if unbiased else n)
    scale = 1.0 / math.sqrt(var + eps if form == "add" else max(var, eps))
    return [
        [(v - mean) * scale if ok else 0.0 for v, ok in zip(row, mr, strict=True)]
        for row, mr in zip(rows, ms, strict=True)
    ]


def group_advantages_naive(
    scores: SeqFloat,
    group_index: Tensor,
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
) -> TokenFloat:
    """Naive twin of :func:`group_advantages`: each response against the others of its prompt."""
    est = parse(AdvantageEstimator, estimator)
    s, gs, ms = pf.vec(scores), [int(v) for v in group_index.tolist()], pf.mask_rows(mask)
    pen = pf.rows(token_penalty) if token_penalty is not None else None
    out: list[list[float]] = []
    for i in range(len(s)):
        group = [s[j] for j in range(len(s)) if gs[j] == gs[i]]
        others = [s[j] for j in range(len(s)) if gs[j] == gs[i] and j != i]
        n = len(group)
        if n == 1:
            if singleton == "error":
                raise SingletonGroupError([gs[i]], f"group_index: groups [{gs[i]}] have one response")
            scaled = est is AdvantageEstimator.GRPO and scale_by_std
            a = 0.0 if singleton == "zero" else (s[i] / (1.0 + eps) if scaled else s[i])
        elif est is AdvantageEstimator.RLOO:
            a = s[i] - sum(others) / (n - 1)  # the mean of the OTHER responses
        else:
            mean = sum(group) / n
            a = s[i] - mean
            if est is AdvantageEstimator.GRPO and scale_by_std:
                std = math.sqrt(sum((x - mean) ** 2 for x in group) / (n - 1 if unbiased_std else n))
                a = a / (std + eps)
        row = []
        T = len(ms[i])
        for t in range(T):
            if not ms[i][t]:
                row.append(0.0)
                continue
            to_go = sum(pen[i][k] for k in range(t, T) if ms[i][k]) if pen is not None else 0.0
            row.append(a + to_go)
        out.append(row)
    if est is AdvantageEstimator.REINFORCE_PP_BASELINE:
        out = _whiten_naive(out, ms, whiten_unbiased, whiten_eps, whiten_eps_form)
    return pf.tensor_like(out, scores)


def reinforce_pp_advantages_naive(
    rewards: TokenFloat,
    mask: ResponseMask,
    *,
    gamma: float = 1.0,
    whiten_unbiased: bool = True,
    whiten_eps: float = 1e-8,
    whiten_eps_form: WhitenEps = "add",
) -> TokenFloat:
    """Naive twin of :func:`reinforce_pp_advantages`: ``R_t = Σ_l γ^l r_{t_{i+l}}``, then whitened."""
    rs, ms = pf.rows(rewards), pf.mask_rows(mask)
    returns = []
    for r_row, m_row in zip(rs, ms, strict=True):
        valid = [t for t in range(len(m_row)) if m_row[t]]
        row = [0.0] * len(m_row)
        for i, t in enumerate(valid):
            row[t] = sum(gamma**l_ * r_row[valid[i + l_]] for l_ in range(len(valid) - i))
        returns.append(row)
    return pf.tensor_like(_whiten_naive(returns, ms, whiten_unbiased, whiten_eps, whiten_eps_form), rewards)
