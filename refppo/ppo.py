"""The PPO loop on real models: rollout → scoring → rollout quantities → K epochs of updates.

Public API (stable; the trainer, tools/make_golden.py and the tests call it)::

    PPOUpdateConfig                    frozen: ppo_epochs, num_minibatches, micro_batch_size,
                                       max_grad_norm, ptx_coef, dropout_in_update, shuffle
    PtxBatch                           frozen: input_ids [N, S], attention_mask [N, S] (SFT/pretrain ids)
    MinibatchRecord                    what ``on_minibatch`` receives after each optimizer step
    ppo_update(actor, critic, actor_optimizer, critic_optimizer, scored, quantities, *, hp, conv,
               cfg, generator, world_size=1, all_reduce=None, ptx_batch=None,
               on_minibatch=None, capture=None) -> dict[str, float]
    CaptureRequest                     frozen: epoch, minibatch, recorder, path (one step as a v2 dump)
    IterationResult                    frozen: metrics, scored, quantities
    iteration(actor, reference, critic, reward, actor_optimizer, critic_optimizer, prompt_ids,
              prompt_mask, *, rollout_cfg, update_cfg, hp, conv, generator, world_size=1,
              all_reduce=None, ptx_batch=None, batch=None, on_minibatch=None) -> IterationResult
    rollout_metrics(scored, quantities, hp, conv) -> dict[str, float]
    ptx_loss(actor, ptx) -> Tensor

Numbered skeleton of :func:`iteration` (lm-human-preferences / TRL ppov2)::

    1. responses  = generate_rollout(actor, prompts)        (or ``batch=`` to replay given tokens)
    2. scored     = score_rollout(...)                      π_old, π_ref log-probs, V_old, scores
                                                            (eval mode, no_grad, ONE pass each)
    3. quantities = refppo.pipeline.rollout_quantities(...) kl → token rewards → GAE → whitening
    4. for epoch in range(ppo_epochs):                      rows shuffled by ``generator``
         for minibatch in split(perm, num_minibatches):     loud failure on uneven splits
           normalisers = global token/seq counts of the minibatch (all_reduce'd across ranks)
           for micro in split(minibatch, micro_batch_size):
             logp, H = response_logprobs(actor, micro)      SAME dropout setting as π_old (eval)
             V       = response_values(critic, micro)
             loss    = update_quantities(..., norm=normalisers).loss · world_size
             backward(loss)                                  gradients accumulate
           backward(ptx_coef · ptx_loss)                     optional, InstructGPT PPO-ptx
           clip grad norms (actor and critic separately); optimizer step(s); zero grads

Design decisions:

- **Optimizers.** ``actor_optimizer`` and ``critic_optimizer`` are separate (TRL/OpenRLHF/verl
  keep two). Pass ``critic_optimizer=None`` when ``actor_optimizer`` holds the parameters of both
  models (one joint optimizer). Gradient clipping is always per model: ``max_grad_norm`` bounds
  the actor's and the critic's gradient norms separately. The actor and the critic share no
  parameters, so the single backward of ``pg + vf_coef·vf`` gives each model exactly its own
  loss's gradient.
- **Exact accumulation.** Every micro-batch's loss uses the WHOLE minibatch's normalisers
  (:class:`refppo.pipeline.Normalisers`), so the sum of the micro losses is the minibatch loss in
  every ``loss_agg`` mode and the accumulated gradient equals the one-shot gradient.
- **DDP hook.** The trainer wraps actor and critic in ``DistributedDataParallel`` itself and
  passes ``all_reduce`` (a SUM all-reduce of a float64 tensor, e.g.
  ``lambda t: (dist.all_reduce(t), t)[1]``) and ``world_size``. The counts
  ``[tokens, sequences, value tokens]`` are all-reduced, so the normalisers are global; DDP
  averages gradients (divides by world_size), hence each loss is multiplied by ``world_size``:
  the resulting gradient equals single-process training on the concatenated batch. The PPO-ptx
  term is a per-rank mean and is NOT scaled (DDP's average of per-rank means). The loss metrics
  returned are this rank's share (with global normalisers their sum over ranks is the global
  value); clip fractions and approx-KL are this rank's token means. In :func:`iteration` the same
  hook makes the advantage whitening of step 3 global (mean and variance all-reduced over every
  rank's rows, as verl), so a DDP iteration equals one process on the concatenated batch.
- **Dropout.** The current log-probs are recomputed in eval mode (``dropout_in_update=False``,
  as TRL), like the cached old log-probs, so the ratio of the first minibatch of the first epoch
  is 1 and clipfrac/approx-KL are 0 there. With ``dropout_in_update=True`` the models are in
  train mode during the update (old log-probs stay dropout-free).
- **Old policy.** No copy of the actor is kept: π_old enters only through the cached
  ``scored.old_logprobs`` (see spec/models.md; tests/unit/test_old_policy.py compares it with a
  deep-copied snapshot network at every epoch and minibatch).

Where the code lives (this module re-exports every name it had before the split, the same
objects; assigning one of them, e.g. ``monkeypatch.setattr(ppo, "rollout_quantities", spy)``,
also assigns it in the module that looks it up: :mod:`refppo.split_module`)::

    refppo/train/update_config.py  PPOUpdateConfig, CaptureRequest, PtxBatch, MinibatchRecord
    refppo/train/update.py         ppo_update (step 4) and ptx_loss
    refppo/train/iteration.py      iteration (steps 1–4), rollout_metrics, IterationResult
"""

from __future__ import annotations

from refppo.capture import StepRecorder as StepRecorder
from refppo.conventions import AdvantageEstimator as AdvantageEstimator
from refppo.conventions import KLPlacement as KLPlacement
from refppo.core.kl import token_kl as token_kl
from refppo.core.masked import AllReduce as AllReduce
from refppo.core.masked import masked_mean as masked_mean
from refppo.core.masked import masked_sum as masked_sum
from refppo.errors import HyperparameterError as HyperparameterError
from refppo.errors import ShapeError as ShapeError
from refppo.models import Reward as Reward
from refppo.models import SequenceBatch as SequenceBatch
from refppo.models import eval_mode as eval_mode
from refppo.models import position_ids_from_mask as position_ids_from_mask
from refppo.models import response_logprobs as response_logprobs
from refppo.models import response_values as response_values
from refppo.pipeline import Convention as Convention
from refppo.pipeline import Hyperparams as Hyperparams
from refppo.pipeline import Normalisers as Normalisers
from refppo.pipeline import RolloutQuantities as RolloutQuantities
from refppo.pipeline import ScoreMap as ScoreMap
from refppo.pipeline import UpdateQuantities as UpdateQuantities
from refppo.pipeline import rollout_quantities as rollout_quantities
from refppo.pipeline import update_quantities as update_quantities
from refppo.rollout import RolloutConfig as RolloutConfig
from refppo.rollout import ScoredRollout as ScoredRollout
from refppo.rollout import generate_rollout as generate_rollout
from refppo.rollout import score_rollout as score_rollout
from refppo.split_module import forward_assignments
from refppo.train import iteration as _iteration_module
from refppo.train import update as _update_module
from refppo.train import update_config as _update_config_module
from refppo.train.iteration import IterationResult as IterationResult
from refppo.train.iteration import iteration as iteration
from refppo.train.iteration import rollout_metrics as rollout_metrics
from refppo.train.update import ppo_update as ppo_update
from refppo.train.update import ptx_loss as ptx_loss
from refppo.train.update_config import CaptureRequest as CaptureRequest
from refppo.train.update_config import MinibatchRecord as MinibatchRecord
from refppo.train.update_config import PPOUpdateConfig as PPOUpdateConfig
from refppo.train.update_config import PtxBatch as PtxBatch

forward_assignments(__name__, _iteration_module, _update_module, _update_config_module)

__all__ = [
    "AllReduce",
    "CaptureRequest",
    "IterationResult",
    "MinibatchRecord",
    "PPOUpdateConfig",
    "PtxBatch",
    "iteration",
    "ppo_update",
    "ptx_loss",
    "rollout_metrics",
]
