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
prompt-level mean (SkyRL 0.4.0)    ``aggregate.prompt_mean_loss``         ``aggregate.prompt_mean_loss_naive``
``loss_agg=prompt-mean``            ``aggregate.prompt_mean_masked``       ``aggregate.prompt_mean_naive``
logged clip fraction (counts,      ``clipfrac.{clip_fraction,             ``clipfrac.*_naive``
row-mean: oat)                     clipfrac_row_mean}``
entropy bonus, KL loss, total      ``objective.{entropy_bonus,kl_loss,    ``*_naive``
                                   total_loss}``
per-token gradients of the losses  torch autograd through the above    ``grad.*_grad_naive``,
                                                                         ``refppo.pipeline.grad_naive``
rollout-correction weights, gates  ``rollout_correction.{is_weights,      ``*_naive`` in the same module
                                   rejection_mask}``
weighted / decoupled surrogate     ``rollout_losses.{corrected,           ``*_naive``
                                   decoupled}_policy_loss``
CISPO, weighted REINFORCE          ``cispo.{cispo_policy_loss,            ``*_naive``
                                   weighted_logprob_loss}``
=================================  =====================================  ==========================

Equations: spec/ppo.md (the rollout correction: spec/rollout-correction.md). Every tensor is
response-aligned ``[B, T]`` (see :mod:`refppo.types`).
"""
