"""The verified PPO core: one pure function per step, each with its naive twin beside it.

=================================  =====================================  ==========================
step                               vectorized                             naive twin
=================================  =====================================  ==========================
masked reductions / whitening      ``masked.masked_{sum,mean,var,whiten}``  ``*_naive`` in the same module
log-probs, entropy from logits     ``logprobs.logprobs_from_logits``,     ``*_naive``
                                   ``logprobs.entropy_from_logits``
per-token KL estimators            ``kl.token_kl``                        ``kl.token_kl_naive``
token-level rewards                ``rewards.token_rewards``              ``rewards.token_rewards_naive``
GAE advantages and returns         ``gae.gae``                            ``gae.gae_naive``
critic-free advantages (GRPO,      ``group.group_advantages``,            ``group.*_naive``
Dr. GRPO, RLOO, REINFORCE++)       ``group.reinforce_pp_advantages``
ratio, clipped surrogate           ``policy.policy_ratio``,               ``policy.clipped_policy_loss_naive``
                                   ``policy.clipped_policy_loss``
value loss (clipped/unclipped)     ``value.value_loss``                   ``value.value_loss_naive``
loss aggregation                   ``aggregate.aggregate_loss``           ``aggregate.aggregate_loss_naive``
entropy bonus, KL loss, total      ``objective.{entropy_bonus,kl_loss,    ``*_naive``
                                   total_loss}``
per-token gradients of the losses  torch autograd through the above    ``grad.*_grad_naive``,
                                                                         ``grad.objective_grads_naive``
=================================  =====================================  ==========================

Equations: spec/ppo.md. Every tensor is response-aligned ``[B, T]`` (see :mod:`refppo.types`).
"""

from refppo.core.aggregate import aggregate_loss, aggregate_loss_naive
from refppo.core.gae import gae, gae_naive
from refppo.core.grad import (
    kl_loss_grad_naive,
    objective_grads_naive,
    policy_grad_naive,
    value_grad_naive,
)
from refppo.core.group import (
    group_advantages,
    group_advantages_naive,
    reinforce_pp_advantages,
    reinforce_pp_advantages_naive,
)
from refppo.core.kl import token_kl, token_kl_naive
from refppo.core.logprobs import (
    entropy_from_logits,
    entropy_from_logits_naive,
    logprobs_from_logits,
    logprobs_from_logits_naive,
)
from refppo.core.masked import (
    masked_mean,
    masked_mean_naive,
    masked_sum,
    masked_sum_naive,
    masked_var,
    masked_var_naive,
    masked_whiten,
    masked_whiten_naive,
)
from refppo.core.objective import (
    entropy_bonus,
    entropy_bonus_naive,
    kl_loss,
    kl_loss_naive,
    total_loss,
    total_loss_naive,
)
from refppo.core.policy import (
    PolicyLossNaive,
    PolicyLossOutput,
    clipped_policy_loss,
    clipped_policy_loss_naive,
    policy_ratio,
)
from refppo.core.rewards import score_positions, token_rewards, token_rewards_naive
from refppo.core.value import ValueLossNaive, ValueLossOutput, value_loss, value_loss_naive

__all__ = [
    "PolicyLossNaive",
    "PolicyLossOutput",
    "ValueLossNaive",
    "ValueLossOutput",
    "aggregate_loss",
    "aggregate_loss_naive",
    "clipped_policy_loss",
    "clipped_policy_loss_naive",
    "entropy_bonus",
    "entropy_bonus_naive",
    "entropy_from_logits",
    "entropy_from_logits_naive",
    "gae",
    "gae_naive",
    "group_advantages",
    "group_advantages_naive",
    "kl_loss",
    "kl_loss_grad_naive",
    "kl_loss_naive",
    "logprobs_from_logits",
    "logprobs_from_logits_naive",
    "masked_mean",
    "masked_mean_naive",
    "masked_sum",
    "masked_sum_naive",
    "masked_var",
    "masked_var_naive",
    "masked_whiten",
    "masked_whiten_naive",
    "objective_grads_naive",
    "policy_grad_naive",
    "policy_ratio",
    "reinforce_pp_advantages",
    "reinforce_pp_advantages_naive",
    "score_positions",
    "token_kl",
    "token_kl_naive",
    "token_rewards",
    "token_rewards_naive",
    "total_loss",
    "total_loss_naive",
    "value_grad_naive",
    "value_loss",
    "value_loss_naive",
]
