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

Where the code lives (this module re-exports every name it had before the split, the same
objects; assigning one of them, e.g. a test's ``monkeypatch.setattr(pipeline, "gae", spy)``, also
assigns it in the module that looks it up: :mod:`refppo.split_module`)::

    refppo/pipeline_rollout.py   steps 0–4: value_mask, clipped_scores, mapped_scores,
                                 RolloutQuantities, reward_quantities, rollout_quantities,
                                 critic_free_advantages
    refppo/pipeline_update.py    steps 5–9: UpdateQuantities, Normalisers, policy_term,
                                 update_quantities
    refppo/pipeline_blocks.py    ROW_BLOCK_ELEMENTS, gae_by_rows, update_rows (row blocks)
"""

from __future__ import annotations

from refppo import pipeline_blocks, pipeline_rollout, pipeline_update
from refppo.conventions import AdvantageEstimator as AdvantageEstimator
from refppo.conventions import GaeHoles as GaeHoles
from refppo.conventions import GaePadding as GaePadding
from refppo.conventions import GroupKL as GroupKL
from refppo.conventions import KLPlacement as KLPlacement
from refppo.conventions import PolicyLoss as PolicyLoss
from refppo.conventions import ScorePosition as ScorePosition
from refppo.conventions import Variance as Variance
from refppo.conventions import WhitenHoles as WhitenHoles
from refppo.conventions import Whitening as Whitening
from refppo.core.by_rows import entropy_bonus_by_rows as entropy_bonus_by_rows
from refppo.core.by_rows import kl_loss_by_rows as kl_loss_by_rows
from refppo.core.by_rows import policy_loss_by_rows as policy_loss_by_rows
from refppo.core.by_rows import value_loss_by_rows as value_loss_by_rows
from refppo.core.gae import envelope as envelope
from refppo.core.gae import gae as gae
from refppo.core.group import discounted_returns as discounted_returns
from refppo.core.group import group_advantages as group_advantages
from refppo.core.gspo import gspo_policy_loss as gspo_policy_loss
from refppo.core.kl import token_kl as token_kl
from refppo.core.masked import AllReduce as AllReduce
from refppo.core.normalize import normalize as normalize
from refppo.core.objective import entropy_bonus as entropy_bonus
from refppo.core.objective import kl_loss as kl_loss
from refppo.core.objective import total_loss as total_loss
from refppo.core.policy import PolicyLossOutput as PolicyLossOutput
from refppo.core.policy import clipped_policy_loss as clipped_policy_loss
from refppo.core.rewards import score_positions as score_positions
from refppo.core.rewards import token_rewards as token_rewards
from refppo.core.score_map import map_scores as map_scores
from refppo.core.value import value_loss as value_loss
from refppo.errors import ConventionError as ConventionError
from refppo.errors import SingletonGroupError as SingletonGroupError
from refppo.pipeline_blocks import ROW_BLOCK_ELEMENTS as ROW_BLOCK_ELEMENTS
from refppo.pipeline_blocks import gae_by_rows as gae_by_rows
from refppo.pipeline_blocks import update_rows as update_rows
from refppo.pipeline_rollout import RolloutQuantities as RolloutQuantities
from refppo.pipeline_rollout import clipped_scores as clipped_scores
from refppo.pipeline_rollout import critic_free_advantages as critic_free_advantages
from refppo.pipeline_rollout import mapped_scores as mapped_scores
from refppo.pipeline_rollout import reward_quantities as reward_quantities
from refppo.pipeline_rollout import rollout_quantities as rollout_quantities
from refppo.pipeline_rollout import value_mask as value_mask
from refppo.pipeline_update import Normalisers as Normalisers
from refppo.pipeline_update import UpdateQuantities as UpdateQuantities
from refppo.pipeline_update import policy_term as policy_term
from refppo.pipeline_update import update_quantities as update_quantities
from refppo.split_module import forward_assignments

# Convention and Hyperparams live in refppo.step_settings; re-exported here, their home for callers
from refppo.step_settings import Convention as Convention
from refppo.step_settings import Hyperparams as Hyperparams
from refppo.step_settings import ScoreMap as ScoreMap
from refppo.validate import check_mask as check_mask

forward_assignments(__name__, pipeline_rollout, pipeline_update, pipeline_blocks)
