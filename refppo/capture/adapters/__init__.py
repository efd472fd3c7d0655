"""Dumps from the peers' own containers (spec/dump-format.md, "From a peer's containers").

- :func:`from_verl` — a verl 0.9.1 ``DataProto`` (or its ``TensorDict`` ``.batch``) and the
  actor/critic metrics of ``verl/workers/utils/losses.py::ppo_loss`` / ``value_loss``;
- :func:`from_openrlhf` — an OpenRLHF 0.11.2 ``Experience`` and the outputs of
  ``PolicyLoss`` / ``ValueLoss``;
- :func:`trace_ppo_step` — one PPO step of TRL 1.12.0's ``PPOTrainer.train``, captured with a tracer;
- :func:`from_trl_grpo` — the inputs of TRL's ``GRPOTrainer._compute_loss`` (1.12.0 / 1.16.0).

The three log-prob roles map where the container holds them: behaviour (verl/OpenRLHF
``rollout_log_probs``, TRL ``sampling_per_token_logps`` → ``rollout_logprobs``), proximal (verl
``old_log_probs``, OpenRLHF ``action_log_probs``, TRL ``old_per_token_logps`` → ``old_logprobs``),
current (the update's forward, passed as ``logprobs=``); the reference and the critic are optional
(β = 0, critic-free). SkyRL-train and AReaL have no adapter here (their makers write dumps directly).

Each returns ``{dump key: tensor}`` for :func:`refppo.dump.write.write_dump`; the ``*_hparams`` helpers
return the sidecar. None imports its peer: the containers are read by duck typing, so refppo needs
no peer installed.
"""

from refppo.capture.adapters.openrlhf import from_openrlhf, openrlhf_hparams
from refppo.capture.adapters.trl import trace_ppo_step, trl_hparams
from refppo.capture.adapters.trl_grpo import from_trl_grpo, trl_grpo_hparams
from refppo.capture.adapters.verl import from_verl, verl_hparams

__all__ = [
    "from_openrlhf",
    "from_trl_grpo",
    "from_verl",
    "openrlhf_hparams",
    "trace_ppo_step",
    "trl_grpo_hparams",
    "trl_hparams",
    "verl_hparams",
]
