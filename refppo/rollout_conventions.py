"""Conventions of the rollout correction (the behaviour/proximal seam) as typed enums.

Symbols: ``l^prox`` the trainer's recompute before the update (``old_logprobs``), ``l^beh`` the
inference engine's log-probs of the sampled tokens (``rollout_logprobs``), ``d_t = l^prox_t − l^beh_t``
(0 on padding). The core steps are in :mod:`refppo.core.rollout_correction` and
:mod:`refppo.core.rollout_losses`; equations and the peers' variants in spec/rollout-correction.md.

A sibling of :mod:`refppo.conventions` (same layer), imported from here; ``parse`` is that module's.
"""

from __future__ import annotations

from enum import StrEnum


class ISLevel(StrEnum):
    """Granularity of the importance weight ``w = π^prox/π^beh``.

    - ``token``: ``w_t = exp(d_t)`` per token (verl 0.9.1 ``rollout_is: token``; SkyRL-train 0.3.1
      ``use_tis``; TRL 1.16.0 ``token_*`` modes; AReaL 1.0.4 ``rejection_sampling.level: token``;
      OpenRLHF 0.11.2 ``is_correction_level: token``; oat-llm 0.2.4 ``tis_c``);
    - ``sequence``: one weight per row, broadcast to its valid tokens, its log by :class:`ISAgg`.
    """

    TOKEN = "token"
    SEQUENCE = "sequence"


class ISAgg(StrEnum):
    """How a sequence-level weight aggregates the row's log-ratios (``L_b`` valid tokens).

    - ``product``: ``w_b = exp(Σ_t m·d_t) = Π_t w_t`` (verl 0.9.1 ``rollout_is: sequence``; TRL 1.16.0
      ``sequence_*`` modes);
    - ``geometric``: ``w_b = exp((1/L_b)·Σ_t m·d_t)``, the geometric mean (AReaL 1.0.4
      ``level: sequence`` with ``metric: ratio``; OpenRLHF 0.11.2's ``seq`` gate).

    Equal on one-token rows. Only read when the level is ``sequence``.
    """

    PRODUCT = "product"
    GEOMETRIC = "geometric"


class ISMode(StrEnum):
    """What happens to a weight outside ``[C_low, C_high]`` (either bound optional).

    - ``truncate``: ``w ← clamp(w, C_low, C_high)`` (TIS; verl's single-float threshold (upper only),
      SkyRL ``tis_imp_ratio_cap``, TRL ``*_truncate``, AReaL ``action: clamp``, OpenRLHF ``clip``);
    - ``mask``: ``w ← 0`` outside the closed band, kept as it is inside (MIS / IcePop; verl's
      ``"lower_upper"`` threshold, TRL ``*_mask``, AReaL ``action: mask``, OpenRLHF ``mask``).
    """

    TRUNCATE = "truncate"
    MASK = "mask"


class RSStat(StrEnum):
    """The per-token statistic of a rejection gate, of ``x_t = ±d_t`` (:class:`RSOrder`).

    - ``ratio``: ``exp(x)``; its sequence reduction runs in log space (``exp(Σ x)``, ``exp(mean x)``,
      ``exp(max x)``: AReaL 1.0.4 ``metric: ratio``);
    - ``k1``: ``x``;  ``k2``: ``½x²``;  ``k3``: ``exp(−x) − 1 + x`` (reduced arithmetically).

    With ``x = −d`` (``behaviour`` order) these are verl 0.9.1 ``rollout_rs`` ``*_k1/k2/k3`` (its k1
    bounds are ratio bounds compared in log space: refppo's ``ratio`` with ``behaviour`` order); with
    ``x = d`` (``proximal`` order) AReaL 1.0.4 ``kl_k1/k2/k3`` (``KLEstimator._compute_approx_kl``).
    """

    RATIO = "ratio"
    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


class RSOrder(StrEnum):
    """The sign of the log-ratio a rejection gate reads: ``behaviour``: ``x = l^beh − l^prox``
    (verl 0.9.1 ``rollout_corr_helper.py``: ``token_k1 = −log_ratio``); ``proximal``:
    ``x = l^prox − l^beh`` (AReaL 1.0.4, OpenRLHF 0.11.2 ratio gate)."""

    BEHAVIOUR = "behaviour"
    PROXIMAL = "proximal"


class RSReduce(StrEnum):
    """How a sequence-level gate reduces the per-token statistic over the row's valid tokens:
    ``sum``, ``mean`` or ``max`` (the veto: a row whose largest token statistic is out of bounds is
    rejected whole; verl ``seq_sum_*``, ``seq_mean_*``, ``seq_max_*``; AReaL ``agg``)."""

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"


class Rejected(StrEnum):
    """What a rejected token is to the loss's aggregation.

    - ``zero``: its weight is 0; the normalisers still count it (verl's IcePop weights, TRL ``*_mask``,
      OpenRLHF ``mask``, AReaL 1.0.4 ``ppo_actor_loss_fn``, which divides by the original mask count);
    - ``drop``: it leaves the loss mask, so token and sequence counts shrink, and a row with no kept
      token leaves the sequence count (verl 0.9.1 ``rollout_rs``: the modified ``response_mask`` that
      ``agg_loss`` reads).
    """

    ZERO = "zero"
    DROP = "drop"


class RSEffect(StrEnum):
    """What a rejection gate's keep mask does to the step (``rollout_rs_effect``).

    - ``weight``: it multiplies the importance weight of the policy term (a rejected token has weight
      0 and still counts in the normalisers; AReaL 1.0.4, OpenRLHF 0.11.2);
    - ``drop_mask``: it replaces the response mask for every stage after the reward (GAE, returns,
      advantage whitening, the policy / value / entropy / KL losses and their normalisers, the
      gradient): ``m' = m·keep`` (verl 0.9.1 ``ray_trainer.py``: ``compute_rollout_correction_and_
      add_to_batch`` writes ``response_mask`` before ``compute_advantage``; the KL-in-reward before it
      reads the original mask).
    """

    WEIGHT = "weight"
    DROP_MASK = "drop_mask"


__all__ = [
    "ISAgg",
    "ISLevel",
    "ISMode",
    "RSEffect",
    "RSOrder",
    "RSReduce",
    "RSStat",
    "Rejected",
]
