"""One PPO step in pipeline order, from cached rollout tensors to the losses — ONE path.

The trainer (:mod:`refppo.train.iteration`), the oracle (:mod:`refppo.oracle.check.recompute`) and
the golden trajectories walk the one stage table (:mod:`refppo.pipeline.stages`), so what the oracle
checks is what the trainer runs.

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

Modules::

    stages       Stage, STAGES (the stage table: keys read, quantities made, functions, naive
                 twins, how each is evaluated), walk
    stage_graph  upstream, downstream, keys_upstream: queries on the table's dependency graph
    step         the walks: reward_quantities, rollout_quantities(_naive), update_quantities(_naive),
                 RolloutQuantities, UpdateQuantities
    rollout      the rollout stages' functions (steps 0–4), value_mask, critic_free_advantages
    update       the update stages' functions (steps 5–9), policy_token_loss, policy_term
    naive, naive_group, naive_update   the stages' naive twins
    grad_naive   the naive twin of the update's gradients
    settings     Convention (flat keys derived from its groups: FLAT, FLAT_ORDER), Hyperparams
    groups       the Convention's groups (ScoreMap, KLConvention, ..., ValueConvention)
    blocks       Evaluation, Normalisers, ROW_BLOCK_ELEMENTS, gae_by_rows, update_rows
"""
