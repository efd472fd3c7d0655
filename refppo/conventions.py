"""Conventions as typed enums, shared by the core, the trainer's config and the oracle's presets.

Each enum's values are the names users type (``--set kl_estimator=k3``, TOML configs, dump
sidecars). :func:`parse` turns a string into a member and, on an unknown name, raises a
:class:`~refppo.errors.ConventionError` that lists the valid names (verl's getters do the same;
unlike verl's registries nothing is ever silently overwritten: these are closed enums).
"""

from __future__ import annotations

from enum import Enum, StrEnum
from typing import TypeVar

from refppo.errors import ConventionError


class KLEstimator(StrEnum):
    """Per-token estimator of KL(π‖π_ref) from the log-ratio ``d = log π − log π_ref``.

    - ``k1``: ``d`` (unbiased, can be negative);
    - ``k2``: ``½ d²`` (non-negative, biased);
    - ``k3``: ``exp(−d) + d − 1`` (non-negative, unbiased, "low variance"; Schulman 2020);
    - ``abs``: ``|d|``;
    - ``k1+``, ``k3+``, ``abs+``: straight-through — the value of the base estimator, the gradient
      of ``½ d²`` (``∂/∂ log π = d``, unclamped): verl 0.9.1 ``core_algos.kl_penalty`` with a ``+``
      suffix (``k2+``/``mse+`` are ``k2`` itself there). Only a KL in the loss is differentiated.

    Names as in verl ``core_algos.kl_penalty`` (``kl``/``k1``, ``mse``/``k2``, ``low_var_kl``/``k3``,
    ``abs``) and OpenRLHF ``models/utils.py::compute_approx_kl`` (k1, k2, k3).
    """

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"
    ABS = "abs"
    K1_ST = "k1+"
    K3_ST = "k3+"
    ABS_ST = "abs+"

    @property
    def base(self) -> KLEstimator:
        """The estimator whose value this one has (itself, or the one without the ``+``)."""
        return KLEstimator(self.value.removesuffix("+"))

    @property
    def straight_through(self) -> bool:
        """The gradient is ``½ d²``'s, not the value's (the ``+`` variants)."""
        return self.value.endswith("+")


class KLPlacement(StrEnum):
    """Where the KL penalty enters.

    - ``reward``: ``r_t −= β·KL_t`` with KL from the rollout-time (old) log-probs (InstructGPT,
      TRL, DeepSpeed-Chat, OpenRLHF default, verl ``use_kl_in_reward``);
    - ``loss``: no KL in the reward; ``β·agg(KL(π_θ‖π_ref))`` on the *current* log-probs is added
      to the actor loss (verl ``use_kl_loss``, OpenRLHF ``algo.kl.use_loss``, GRPO);
    - ``both``: the two at once, one β and one estimator (verl 0.9.1 with ``use_kl_in_reward`` and
      ``actor.use_kl_loss`` both on, ``kl_ctrl.kl_coef = kl_loss_coef``, ``kl_penalty = kl_loss_type``:
      ``ray_trainer.apply_kl_penalty`` and ``dp_actor.update_policy``).
    """

    REWARD = "reward"
    LOSS = "loss"
    BOTH = "both"

    @property
    def in_reward(self) -> bool:
        """``r_t −= β·KL_t`` (``reward`` or ``both``)."""
        return self is not KLPlacement.LOSS

    @property
    def in_loss(self) -> bool:
        """A KL loss on the current log-probs in the total (``loss`` or ``both``)."""
        return self is not KLPlacement.REWARD


class ScorePosition(StrEnum):
    """Which response position receives the reward-model score.

    For a row with ``L`` valid tokens (positions ``0..L−1``) and padded length ``T``::

        position      0   1   2  ...  L-1   L   ...  T-1
        mask          1   1   1  ...   1    0   ...   0
        last_valid                     ^                     (verl, OpenRLHF, refppo default)
        after_last_valid                    ^                (TRL ppov2/PPOTrainer, DeepSpeed-Chat;
                                                              falls back to L-1 when L == T)
        last_position                                  ^     (lm-human-preferences, fixed length)

    ``after_last_valid_unless_first``: ``after_last_valid`` except where the last valid token is
    position 0 (a one-token response): that row keeps its score at 0, as ``last_valid`` would::

        p = ℓ + 1  if 0 < ℓ < T − 1,   else ℓ          (ℓ: the last valid position)

    (torchtune 0.6.1 ``recipes/ppo_full_finetune_single_device.py::PPOFullFinetuneRecipeSingleDevice.
    generate_trajectory``: ``value_seq_idxs = where((seq_lens > 0) & (seq_lens < max_generated_tokens
    − 1), seq_lens + 1, seq_lens)``).
    """

    LAST_VALID = "last_valid"
    AFTER_LAST_VALID = "after_last_valid"
    LAST_POSITION = "last_position"
    AFTER_LAST_VALID_UNLESS_FIRST = "after_last_valid_unless_first"


class Whitening(StrEnum):
    """Advantage whitening over the valid tokens of the whole batch.

    - ``none``;
    - ``masked``: ``(A − μ)/sqrt(σ² + eps)``;
    - ``masked_no_shift``: ``(A − μ)/sqrt(σ² + eps) + μ`` (the mean is added back, as
      ``masked_whiten(shift_mean=False)`` in TRL ``trl/core.py`` and lm-human-preferences);
    - ``center``: ``A − μ`` (no scaling);
    - ``scale``: ``A / sqrt(ms + eps)`` with ``ms = Σ m A² / (N−1)`` (or ``/N``): no centring.

    How ``eps`` enters is :class:`WhitenEps`; ``N−1`` or ``N`` is :class:`Variance`.
    """

    NONE = "none"
    MASKED = "masked"
    MASKED_NO_SHIFT = "masked_no_shift"
    CENTER = "center"
    """``A − μ``: centred, not scaled (AReaL ``adv_norm`` with ``std_level: null``)."""
    SCALE = "scale"
    """``A / rms(A)``: scaled by the root mean square ``sqrt(Σ m A² / (N−1 or N))``, not centred
    (AReaL ``adv_norm`` with ``mean_level: null``: its std is taken around a zero mean)."""


class Variance(StrEnum):
    """Masked variance: ``unbiased`` (Bessel, ``/(N−1)``: verl, TRL) or ``population``.

    ``population`` divides by ``N`` (OpenRLHF, the N+ reproduction code).
    """

    UNBIASED = "unbiased"
    POPULATION = "population"


class WhitenEps(StrEnum):
    """Where the whitening's ``eps`` enters the scale (``σ²`` the variance, ``σ`` its square root).

    - ``variance``: ``1/sqrt(σ² + eps)`` (verl ``masked_whiten``, TRL, SkyRL ``masked_whiten``, refppo);
    - ``clamp``: ``1/sqrt(max(σ², eps))`` (OpenRLHF ``compute_advantages_and_returns``,
      SkyRL ``normalize_advantages_dict``: ``clamp(var, min=1e-8).rsqrt()``);
    - ``std``: ``1/(σ + eps)`` (AReaL ``areal/utils/data.py::Normalization``, eps 1e-5).
    """

    VARIANCE = "variance"
    CLAMP = "clamp"
    STD = "std"


class GaePadding(StrEnum):
    """How GAE treats the right padding of the value mask.

    - ``masked``: the recursion stops at the last valid slot (``V`` beyond it counts 0; refppo,
      verl, OpenRLHF, TRL, AReaL);
    - ``through``: the recursion runs over all ``T`` positions with the values as given, padding
      included (rewards are 0 there), so ``δ_{L−1} = r + γ·V[L] − V[L−1]`` reads the first padded
      value. SkyRL-train 0.3.1 ``skyrl_train/utils/ppo_utils.py::compute_gae_advantage_return``
      (adapted from TRL but without TRL's value masking).
    """

    MASKED = "masked"
    THROUGH = "through"


class GaeHoles(StrEnum):
    """How GAE crosses interior mask holes (multi-turn tool/observation tokens, mask 0 between 1s).

    For a valid position ``t`` whose next valid position is ``u = t + h + 1`` (``h ≥ 1`` holes)::

        skip:     δ_t = r_t + γ·V_u − V_t,              Â_t = δ_t + γλ·Â_u
                  (the recursion over the valid positions only: the holes are transparent, their
                  rewards and values are never read; verl 0.9.1
                  ``verl/trainer/ppo/core_algos.py::compute_gae_advantage_return``, which carries
                  ``nextvalues`` and ``lastgaelam`` across masked positions; refppo default)
        zero:     the plain recursion over every position up to the row's last valid one, with
                  ``r`` and ``V`` set to 0 on the holes: ``δ_t = r_t − V_t``, each hole but the last
                  adds a factor γλ and the last one ``γ·V_u``:
                  ``Â_t = r_t − V_t + (γλ)^h·(γ·V_u + γλ·Â_u)``
                  (OpenRLHF 0.11.2 ``trainer/ppo_utils/experience_maker.py::get_advantages_and_returns``:
                  ``values = action_mask * values``, ``rewards = action_mask * rewards``, agent mode)
        through:  the plain recursion over every position up to the row's last valid one with ``r``
                  and ``V`` as given on the holes (the critic's values at the tool tokens are read):
                  each hole is a time step (SkyRL-train 0.3.1
                  ``skyrl_train/utils/ppo_utils.py::compute_gae_advantage_return``, which receives the
                  right-padded ``response_mask``, not the ``loss_mask`` with the holes)

    On a right-padded mask (no holes) the three are the same computation, bit for bit. Outputs are 0
    outside the positions the recursion visits (the holes for ``skip``, the padding for all).
    """

    SKIP = "skip"
    ZERO = "zero"
    THROUGH = "through"


class GaeBootstrap(StrEnum):
    """What GAE reads after a row's last valid token, ``V_{t_L}`` (:func:`refppo.core.gae.gae`).

    - ``none``: 0 on every row, each row an ended episode (verl, OpenRLHF, TRL, SkyRL; default);
    - ``truncated``: on rows cut at the generation limit (``truncated`` [B], else the rows whose
      last position ``T − 1`` is valid) the dumped ``bootstrap_values`` [B], the critic's value of
      the state after the last token; 0 on the rest (AReaL 1.0.4
      ``areal/trainer/ppo/actor.py::PPOActor._compute_advantages``:
      ``nextvalues = values[:, max_seqlen − 1] * seq_no_eos_mask``).
    """

    NONE = "none"
    TRUNCATED = "truncated"


class ScoreSlotKL(StrEnum):
    """Whether the score slot outside the mask (``score_at`` ``after_last_valid`` or
    ``last_position``) carries a KL penalty too.

    - ``none``: ``r_p = s`` there, the KL only on the mask's tokens (TRL; refppo default);
    - ``kl``: ``r_p = s − β·KL_p``, the KL of the token at the slot as well (DeepSpeed-Chat
      ``dschat/rlhf/ppo_trainer.py::DeepSpeedPPOTrainer.compute_rewards``: ``rewards = −β·(log π −
      log π_ref)`` on every position and ``rewards[j, start:ends[j]][−1] += score``; the slot's token
      is the EOS when pad = eos). The dump then holds real ``old_logprobs``/``ref_logprobs`` at the slot.

    Equal under ``score_at=last_valid`` (the slot is a valid token).
    """

    NONE = "none"
    KL = "kl"


class WhitenHoles(StrEnum):
    """Which tokens the advantage whitening's moments run over when the mask has interior holes.

    - ``exclude``: the valid tokens only (the mask; verl 0.9.1 ``masked_whiten(advantages,
      response_mask)``, OpenRLHF 0.11.2 ``compute_advantages_and_returns`` over ``action_mask``;
      refppo default);
    - ``include``: the envelope of each row, every position up to its last valid token, holes
      included (SkyRL-train 0.3.1 ``trainer.py::compute_advantages_and_returns`` whitens over the
      right-padded ``response_mask`` while its losses use ``loss_mask``).

    Equal on a right-padded mask. ``include`` whitens the advantages the recursion left at the holes
    (0 under ``gae_holes=skip``).
    """

    EXCLUDE = "exclude"
    INCLUDE = "include"


class LossAgg(StrEnum):
    """How a ``[B, T]`` loss matrix ``L`` with mask ``m`` becomes a scalar (names as in verl ``agg_loss``).

    - ``token-mean``: ``Σ_bt m L / Σ_bt m``; ``token-sum``: ``Σ_bt m L`` (verl 0.9.1 ``agg_loss``);
    - ``seq-mean-token-mean``: ``(1/B) Σ_b (Σ_t m L / Σ_t m)``; ``seq-mean-token-sum``: ``(1/B) Σ_bt m L``;
    - ``seq-mean-token-sum-norm``: ``(1/B) Σ_b (Σ_t m L / H)``, a constant horizon ``H`` (default ``T``;
      Dr. GRPO; verl 0.9.1 ``agg_loss``, SkyRL-train 0.3.1 ``reduce_loss``). ``B``: the step's global
      sequence count when it is split (``seq_count``), as for the other seq modes;
    - ``prompt-mean``: ``(1/P) Σ_p (Σ_{b∈p,t} m L / N_p)`` over the prompts of ``group_index`` (SkyRL
      0.4.0 ``prompt_mean``; per-term core functions refuse it: :data:`refppo.agg_conventions.MASK_AGGS`).
    """

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"
    TOKEN_SUM = "token-sum"
    PROMPT_MEAN = "prompt-mean"


class ValueLoss(StrEnum):
    """``clipped``: ``½ max((V−R)², (V_clip−R)²)`` (all peers; ``V_clip`` by :class:`ValueClipForm`);
    ``unclipped``: ``½ (V−R)²``."""

    CLIPPED = "clipped"
    UNCLIPPED = "unclipped"


class ValueClipForm(StrEnum):
    """How the clipped value ``V^clip`` of a clipped value loss is computed (equal in exact arithmetic).

    - ``around_old``: ``clip(V, V_old − ε_v, V_old + ε_v)``: inside the range it is ``V`` itself, bit
      for bit (verl 0.9.1 ``core_algos.py::compute_value_loss`` via
      ``verl/utils/torch_functional.py::clip_by_value``; TRL ``PPOTrainer.train``; DeepSpeed-Chat
      ``critic_loss_fn``; refppo default);
    - ``delta``: ``V_old + clip(V − V_old, −ε_v, ε_v)``: inside the range it can land one rounding
      step off ``V``, so a token where ``V_clip`` should tie with ``V`` can count as clipped
      (OpenRLHF 0.11.2 ``openrlhf/models/loss.py::ValueLoss``; SkyRL-train 0.3.1
      ``skyrl_train/utils/ppo_utils.py::ppo_critic_loss``; AReaL 1.0.4
      ``areal/utils/functional/functional.py::ppo_critic_loss_fn``).

    It changes ``vf_clipfrac`` (by whole tokens) and ``vf_loss`` (by rounding) in float32/bf16.
    """

    AROUND_OLD = "around_old"
    DELTA = "delta"


class ApproxKL(StrEnum):
    """The logged ``approx_kl`` metric, ``d = l − l^old``: ``k1`` ``mean_valid(−d)`` (verl 0.9.1
    ``compute_policy_loss`` ``ppo_kl``, OpenRLHF; refppo default); ``k2_all_positions``
    ``½·Σ_valid d²/(B·T)`` (TRL ``approxkl``: an unmasked mean, padding 0 through INVALID_LOGPROB);
    ``neg_k1`` ``mean_valid(d)`` (AReaL 1.0.4 ``ppo_actor_loss_fn``: the opposite sign); ``k1_clamped``
    ``mean_valid(−clamp(d, ±log_ratio_clamp))`` (RLinf 0.3.0 ``losses.py::compute_ppo_actor_loss``)."""

    K1 = "k1"
    K2_ALL_POSITIONS = "k2_all_positions"
    NEG_K1 = "neg_k1"
    K1_CLAMPED = "k1_clamped"


class VfMask(StrEnum):
    """The mask of the value loss: ``value`` (the response mask plus the score slot: refppo, TRL
    ``padding_mask_p1``; default) or ``response`` (DeepSpeed-Chat ``critic_loss_fn``: ``action_mask``)."""

    VALUE = "value"
    RESPONSE = "response"


E = TypeVar("E", bound=Enum)


def parse(enum_cls: type[E], value: str | E, *, what: str | None = None) -> E:
    """Return the member of ``enum_cls`` named ``value``; on an unknown name list the valid ones."""
    if isinstance(value, enum_cls):
        return value
    for member in enum_cls:
        if member.value == value:
            return member
    valid = ", ".join(repr(m.value) for m in enum_cls)
    label = what or enum_cls.__name__
    raise ConventionError(f"{label}: unknown name {value!r}; valid names are {valid}")


class AdvantageEstimator(StrEnum):
    """How the advantage is estimated (:mod:`refppo.core.gae`, :mod:`refppo.core.group`).

    - ``gae``: GAE with a critic (refppo default);
    - ``grpo``: ``(s − μ_G)/(σ_G + ε)`` within each prompt's group (verl ``grpo``, OpenRLHF
      ``group_norm``);
    - ``dr-grpo``: ``s − μ_G`` (verl ``grpo`` with ``norm_adv_by_std_in_grpo=False``, OpenRLHF
      ``dr_grpo``);
    - ``rloo``: ``s_i − mean_{j≠i} s_j`` (verl ``rloo``, OpenRLHF ``rloo``);
    - ``reinforce++``: discounted returns of the token rewards, whitened over the batch (verl
      ``reinforce_plus_plus``, OpenRLHF ``reinforce``);
    - ``reinforce++-baseline``: ``s − μ_G``, whitened over the batch (verl
      ``reinforce_plus_plus_baseline``, OpenRLHF ``reinforce_baseline``);
    - ``opo``: ``s − Σ_G L_j s_j / Σ_G L_j``, the length-weighted group mean (verl ``opo``);
    - ``gpg``: ``α·(s − μ_G)``, ``α = B / #{j : s_j ≠ 0}`` over the batch (verl ``gpg``);
    - ``grpo-passk``: ``(s_max − s_2nd)/(σ_G + ε)`` for the group's unique best row, 0 elsewhere
      (verl ``grpo_passk``); ``group_std``, ``group_eps`` and ``group_std_level`` apply as for ``grpo``;
    - ``flash-reinforce``: ``s − (1/B) Σ_j s_j``, the batch mean, no group (OpenRLHF
      ``flash_reinforce``).
    """

    GAE = "gae"
    GRPO = "grpo"
    DR_GRPO = "dr-grpo"
    RLOO = "rloo"
    REINFORCE_PP = "reinforce++"
    REINFORCE_PP_BASELINE = "reinforce++-baseline"
    OPO = "opo"
    GPG = "gpg"
    GRPO_PASSK = "grpo-passk"
    FLASH_REINFORCE = "flash-reinforce"


class PolicyLoss(StrEnum):
    """The policy surrogate (:mod:`refppo.core.policy`, :mod:`refppo.core.gspo`, :mod:`refppo.core.cispo`).

    - ``vanilla``: token ratio ``ρ_t = exp(l_t − l^old_t)`` (PPO; with ``rollout_is``: AReaL's decoupled);
    - ``gspo``: GSPO's sequence ratio ``s_b = exp(mean_t m·(l − l^old))`` (Zheng et al. 2025) in its token
      form ``sg(s_b)·π_t/sg(π_t)`` (verl 0.9.1 ``core_algos.py::compute_policy_loss_gspo``): clipped per
      sequence, no dual-clip; ``log_ratio_clamp`` is the *upper* clamp of ``log s`` (verl: 10);
    - ``cispo``: ``−sg(clip(ρ_t, 1−ε_low, 1+ε_high))·A_t·l_t`` (verl 0.9.1, SkyRL 0.3.1), no dual-clip."""

    VANILLA = "vanilla"
    GSPO = "gspo"
    CISPO = "cispo"


__all__ = [
    "AdvantageEstimator",
    "ApproxKL",
    "GaeBootstrap",
    "GaeHoles",
    "GaePadding",
    "KLEstimator",
    "KLPlacement",
    "LossAgg",
    "PolicyLoss",
    "ScorePosition",
    "ScoreSlotKL",
    "ValueClipForm",
    "ValueLoss",
    "Variance",
    "VfMask",
    "WhitenEps",
    "WhitenHoles",
    "Whitening",
    "parse",
]
