"""The engine-versus-trainer mathematics (issue #22 item 4): pure functions and their naive twins.

Notation, per valid response token ``t`` of a dump: ``z_t`` the trainer's logits ``[V]`` at the
position that scores ``y_t``, ``τ`` the sampling temperature, ``l^tr_t = log softmax(z_t/τ)[y_t]``
the trainer's forward (refppo's re-score), ``l^eng_t`` the engine's reported log-prob
(``rollout_logprobs``), ``Δ_t = l^eng_t − l^tr_t``.

- :func:`gate_stats`: what practitioners gate on (verl 0.9.1
  ``trainer/ppo/rollout_corr_helper.py::compute_offpolicy_metrics`` for the KL and χ² estimators).
- :func:`share_outside`: the share of tokens whose ratio leaves ``[1 − δ, 1 + δ]`` (also
  :func:`refppo.oracle.rescore.readouts.precision_stats`'s).
- :func:`support_keep` / :func:`support_log_mass`: the kept support of the engine's sampling
  filters and its probability mass ``S_t``; an engine that renormalises over it reports
  ``l^eng_t = l^tr_t − log S_t`` (TRL #6789, #7269). Naive twin: :func:`support_log_mass_naive`.
- :func:`rounded_logprobs`: ``log softmax(fl_d(z)/τ)[y]``, the logits rounded to bf16 / fp16.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOG_RATIO_BOUND = 20.0
"""``|log ρ|`` is clamped to 20 inside the χ² estimators (verl's ``SAFETY_BOUND``): ``e^{40}`` is finite."""


def share_outside(dlogp: Tensor, delta: float) -> float:
    """The share of the tokens ``dlogp`` ``[N]`` (log-ratios Δ) whose ratio ``e^{Δ}`` leaves
    ``[1 − δ, 1 + δ]``: ``#{t: e^{Δ_t} ∉ [1−δ, 1+δ]} / N`` (0 for ``N = 0``)."""
    r = dlogp.exp()
    return float(((r < 1 - delta) | (r > 1 + delta)).sum()) / dlogp.numel() if dlogp.numel() else 0.0


def gate_stats(l_eng: Tensor, l_tr: Tensor, mask: Tensor, delta: float) -> dict[str, float]:
    """Statistics of the engine against the trainer over the valid tokens (``mask`` ``[B, T]``).

    With ``Δ = l^eng − l^tr``, the probability ratio ``r = e^{Δ} = μ_eng/π_tr`` and the importance
    weight ``ρ = 1/r = π_tr/μ_eng``; the sampled tokens are draws from the engine's ``μ``, so
    every mean below is a Monte-Carlo estimate under ``y ~ μ``::

        ratio_mean, ratio_min, ratio_max   over r_t
        share_outside_trust                #{t: r_t ∉ [1−δ, 1+δ]} / N
        kl_k1   = mean_t Δ_t                           ≈ KL(μ_eng ‖ π_tr)
        kl_k3   = mean_t (ρ_t − 1 − log ρ_t)            ≈ KL(μ_eng ‖ π_tr), ≥ 0 term by term
        chi2_token = mean_t ρ̃_t² − 1                   ≈ χ²(π_tr ‖ μ_eng) = Var_μ[ρ]
        chi2_seq   = mean_b exp(2·clamp(Σ_t log ρ_bt)) − 1   (the sequence weight's χ²)
        max_abs_dlogp = max_t |Δ_t|

    ``ρ̃ = exp(clamp(log ρ, ±20))`` (:data:`LOG_RATIO_BOUND`, verl's clamp). Rows without a valid
    token leave ``chi2_seq``'s mean. Float64; ``N = 0`` gives zeros."""
    m = mask.bool()
    d = torch.where(m, l_eng.to(torch.float64) - l_tr.to(torch.float64), 0.0)
    n = int(m.sum())
    if n == 0:
        keys = ("ratio_mean", "ratio_min", "ratio_max", "share_outside_trust", "kl_k1", "kl_k3")
        return {**dict.fromkeys(keys, 0.0), "chi2_token": 0.0, "chi2_seq": 0.0, "max_abs_dlogp": 0.0,
                "trust_delta": delta, "tokens": 0.0}  # fmt: skip
    dv = d[m]
    r, log_rho = dv.exp(), -dv
    rho_c = log_rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    rows = m.any(dim=1)
    seq = (-d).sum(dim=1)[rows].clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return {
        "ratio_mean": float(r.mean()),
        "ratio_min": float(r.min()),
        "ratio_max": float(r.max()),
        "share_outside_trust": share_outside(dv, delta),
        "trust_delta": delta,
        "kl_k1": float(dv.mean()),
        "kl_k3": float((torch.expm1(log_rho) - log_rho).mean()),
        "chi2_token": float((rho_c**2).mean() - 1),
        "chi2_seq": float((2 * seq).exp().mean() - 1),
        "max_abs_dlogp": float(dv.abs().max()),
        "tokens": float(n),
    }


def support_keep(
    logits: Tensor, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0
) -> Tensor:
    """The kept support ``[N, V]`` (bool) of the engine's sampling filters on ``logits [N, V]``.

    vLLM V1's order (``vllm/v1/sample/sampler.py``: temperature, then the argmax-invariant
    ``min_p``, then ``apply_top_k_top_p``), on ``x = z/τ`` in float64, each filter on what the
    previous kept (renormalised):

    - ``min_p > 0``: keep ``v`` iff ``p_v ≥ min_p·max_u p_u``;
    - ``top_k > 0``: keep ``v`` iff ``x_v ≥`` the k-th largest kept ``x`` (ties at the k-th value
      all kept: vLLM ``apply_top_k_top_p`` and HF ``TopKLogitsWarper`` both compare ``<`` the k-th);
    - ``top_p < 1`` (the nucleus): sort the kept probabilities descending, ``c_v`` = the mass
      ranked strictly above ``v``; keep ``v`` iff ``c_v < top_p`` (the top token always). So the
      token whose own mass carries the cumulative sum across ``top_p`` is KEPT, and one whose
      predecessors already reach exactly ``top_p`` is dropped. This is HF ``TopPLogitsWarper`` and
      vLLM ``apply_top_k_top_p``: both sort ascending and drop a token when the ascending
      cumulative sum up to and including it is ``≤ 1 − top_p``, i.e. ``1 − c_v ≤ 1 − top_p``;
      they keep the last (largest) one. Equal probabilities are ranked by the sort (either order).

    HF applies ``min_p`` after top-k / top-p (``generation/utils.py``); the ``min_p`` rule is
    unchanged by renormalisation and keeps the top token, so the orders differ only when
    ``top_p`` and ``min_p`` are both on. ``top_k`` ≤ 0 (0 or −1, vLLM's spelling) and
    ``top_p = 1`` and ``min_p = 0`` are off.
    """
    x = logits.to(torch.float64) / temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if min_p > 0:
        p = x.softmax(-1)
        keep &= p >= min_p * p.amax(-1, keepdim=True)
    if 0 < top_k < x.shape[-1]:
        kth = x.masked_fill(~keep, -math.inf).topk(top_k, dim=-1).values[..., -1:]
        keep &= x >= kth
    if top_p < 1:
        ps, idx = x.masked_fill(~keep, -math.inf).softmax(-1).sort(dim=-1, descending=True)
        above = torch.cat([torch.zeros_like(ps[..., :1]), ps.cumsum(-1)[..., :-1]], dim=-1)
        keep_sorted = above < top_p
        keep_sorted[..., 0] = True
        keep &= torch.zeros_like(keep).scatter(-1, idx, keep_sorted)
    return keep


def support_log_mass(
    logits: Tensor, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0
) -> tuple[Tensor, Tensor]:
    """``(log S [N], keep [N, V])``: ``S = Σ_{v kept} softmax(z/τ)_v``, the mass of the kept support
    (:func:`support_keep`) under the unfiltered distribution at temperature ``τ``. The renormalised
    log-prob of a kept token is ``log softmax(z/τ)[y] − log S``; of a dropped one, ``−∞``."""
    keep = support_keep(logits, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    lp = (logits.to(torch.float64) / temperature).log_softmax(-1)
    return lp.masked_fill(~keep, -math.inf).logsumexp(-1), keep


def support_log_mass_naive(
    logits: list[float], *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0
) -> tuple[float, set[int]]:
    """One position, plain Python: ``(log S, kept token ids)``, the rules of :func:`support_keep`
    walked token by token (probabilities renormalised over what the previous filter kept)."""
    x = [z / temperature for z in logits]
    top = max(x)
    p = [math.exp(v - top) for v in x]
    total = sum(p)
    p = [q / total for q in p]
    kept = set(range(len(x)))
    if min_p > 0:
        biggest = max(p)
        kept = {v for v in kept if p[v] >= min_p * biggest}
    if 0 < top_k < len(x):
        kth = sorted((x[v] for v in kept), reverse=True)[min(top_k, len(kept)) - 1]
        kept = {v for v in kept if x[v] >= kth}
    if top_p < 1:
        mass = sum(p[v] for v in kept)
        order = sorted(kept, key=lambda v: -p[v])
        nucleus: set[int] = set()
        above = 0.0
        for v in order:
            if not nucleus or above < top_p:
                nucleus.add(v)
            above += p[v] / mass
        kept = nucleus
    return math.log(sum(p[v] for v in kept)), kept


def rounded_logprobs(logits: Tensor, tokens: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    """``log softmax(fl_d(z)/τ)[y]`` ``[N]``: the logits ``z [N, V]`` rounded to ``dtype`` (round to
    nearest), the rest in float64 — an engine whose lm-head output is ``d`` and whose sampler
    works in float32 (vLLM: ``logits.float()`` before its log-softmax) reports these up to float32
    rounding. ``tokens [N]``."""
    x = logits.to(dtype).to(torch.float64) / temperature
    return x.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
