"""What defines a golden trajectory: the cases, their tolerances, the fields stored and compared.

A :class:`GoldenCase` fixes the tiny models (arch, sizes, seeds 0/1/2 for actor/critic/reward),
the prompts, the seed of the sampler, and every PPO setting (and, for a corrected run, the seam
mode's engine: ``seam``); :data:`CASES` are the stored ones (``spec/golden/ppo_<case>``),
:func:`variant` derives a case with other hyperparameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from refppo.conventions import AdvantageEstimator, Whitening
from refppo.models.rollout import RolloutConfig
from refppo.models.tiny import Arch
from refppo.pipeline.settings import FLAT, Convention, Hyperparams
from refppo.train.config.seam import SeamConfig
from refppo.train.update_config import PPOUpdateConfig

TENSOR_FIELDS = (
    "prompt_ids",
    "prompt_mask",
    "response_ids",
    "response_mask",
    "old_logprobs",
    "ref_logprobs",
    "old_values",
    "raw_scores",
    "scores",
    "kl",
    "token_rewards",
    "advantages",
    "returns",
)
SEAM_FIELDS = ("rollout_logprobs", "policy_version")
"""Stored besides :data:`TENSOR_FIELDS` by a case with ``seam``: the engine's log-probs of the sampled
tokens ``[B, T]`` and the version of the policy that sampled each row ``[B]``."""
EXACT_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "perm", "policy_version")

COMPARED_METRICS = (
    "score",
    "kl",
    "loss",
    "pg_loss",
    "vf_loss",
    "entropy",
    "pg_clipfrac",
    "approx_kl",
    "vf_clipfrac",
    "actor_grad_norm",
    "critic_grad_norm",
)
SEAM_METRICS = ("seam_staleness", "seam_kl", "seam_abs_log_ratio")
"""Compared besides :data:`COMPARED_METRICS` by a case with ``seam``
(:func:`refppo.train.seam.seam_metrics`)."""


@dataclass(frozen=True)
class Tolerances:
    """``|a − b| <= atol + rtol·|b|`` for tensors and scalars; checksums: ``|ΔΣp| <= ck·Σ|p|``,
    ``|ΔΣp²| <= ck·Σp²``. Clip fractions are counts over a few dozen tokens and compared to
    ``frac_atol``."""

    atol: float
    rtol: float
    checksum: float
    frac_atol: float


CPU_REPLAY = Tolerances(atol=1e-5, rtol=1e-5, checksum=2e-4, frac_atol=0.0)
"""Same seed, batched path, CPU, kernels pinned to AVX2 (:mod:`refppo.cpu_numerics`). Bit-identical
with 1 thread on the generating machine; unpinned, another CPU model moved whitened advantages by up
to 5.4e-5; with 2
threads tensors moved by <= 8.4e-7 and checksums by <= 3.9e-5 relative. The checksum margin is
wide because Adam turns rounding noise into lr-sized steps where the exact gradient is 0 (e.g.
the attention key bias: softmax is invariant to it)."""
NAIVE = Tolerances(atol=5e-4, rtol=5e-4, checksum=5e-4, frac_atol=0.07)
"""Per-prefix naive path vs the goldens (float64 Python twins + Adam amplifying ~1e-7 gradient
differences; a clip-fraction may flip one token whose ratio sits on 1±ε)."""
CUDA_REPLAY = Tolerances(atol=1e-3, rtol=1e-3, checksum=1e-4, frac_atol=0.07)
"""Batched path on a CUDA device (different kernels and reduction orders)."""


@dataclass(frozen=True)
class GoldenCase:
    """Everything that defines one golden trajectory."""

    name: str
    arch: Arch
    vocab_size: int = 32
    hidden: int = 32
    layers: int = 2
    heads: int = 2
    dropout: float = 0.1
    prompts: tuple[tuple[int, ...], ...] = ((1, 5, 6), (1, 7, 8, 9, 10), (1, 3), (1, 11, 12, 13))
    seed: int = 1234
    iterations: int = 3
    lr: float = 3e-3
    rollout: RolloutConfig = field(
        default_factory=lambda: RolloutConfig(max_new_tokens=8, temperature=0.9, missing_eos_penalty=1.0)
    )
    update: PPOUpdateConfig = field(
        default_factory=lambda: PPOUpdateConfig(
            ppo_epochs=2, num_minibatches=2, micro_batch_size=1, max_grad_norm=1.0
        )
    )
    hp: Hyperparams = field(default_factory=lambda: Hyperparams(kl_coef=0.05, ent_coef=0.01, vf_coef=0.1))
    conv: Convention = field(default_factory=Convention)
    group_size: int = 1
    """Responses per prompt: each prompt's row is repeated ``group_size`` times (consecutive rows,
    ``group_index`` = the prompt's position); the group estimators need ≥ 2."""
    seam: SeamConfig | None = None
    """A corrected run (spec/trainer.md "The seam mode"): the rollout by the trainer's own
    :class:`refppo.train.seam.RolloutEngine` (``seam.dtype``, ``seam.staleness``), its log-probs read
    by the ``rollout_correction`` stage under ``conv.rollout``; None: the policy samples itself."""

    @property
    def critic_free(self) -> bool:
        """``conv.adv.estimator`` is not GAE: no critic model, optimizer or value loss."""
        return self.conv.adv.estimator is not AdvantageEstimator.GAE

    def rows(self) -> tuple[list[list[int]], Tensor]:
        """The prompt of every row and ``group_index`` ``[B]`` (B = prompts × ``group_size``)."""
        rows = [list(p) for p in self.prompts for _ in range(self.group_size)]
        gi = torch.arange(len(self.prompts)).repeat_interleave(self.group_size)
        return rows, gi

    def to_dict(self) -> dict[str, Any]:
        def dc(x: Any) -> dict[str, Any]:
            return {k: getattr(x, k) for k in x.__dataclass_fields__}

        out = {
            "name": self.name,
            "arch": self.arch,
            "vocab_size": self.vocab_size,
            "hidden": self.hidden,
            "layers": self.layers,
            "heads": self.heads,
            "dropout": self.dropout,
            "prompts": [list(p) for p in self.prompts],
            "seed": self.seed,
            "iterations": self.iterations,
            "optimizer": {"kind": "Adam", "lr": self.lr, "separate_actor_critic": not self.critic_free},
            "model_seeds": {"actor": 0, "critic": 1, "reward": 2},
            "rollout": dc(self.rollout),
            "update": dc(self.update),
            "hp": self.hp.to_dict(),  # kl_loss_coef left out while None (added after the goldens)
            "conv": self.conv.to_dict(),
        }
        if self.group_size != 1:  # the PPO goldens' documents stay as written
            out["group_size"] = self.group_size
        if self.seam is not None:
            # (keys added since the golden was written are left out while None, their default)
            out["seam"] = {k: v for k, v in dc(self.seam).items() if k != "enabled" and v is not None}
        return out

    @property
    def tensor_fields(self) -> tuple[str, ...]:
        """The stored fields of each iteration besides ``perm``."""
        return TENSOR_FIELDS + (SEAM_FIELDS if self.seam is not None else ())


SEAM_TIS_CAP = 1.02
"""The TIS cap of the ``seam_gpt2`` golden. The bfloat16 engine's rounding alone moves
``π^prox/π^beh`` by ≤ 1.5e-3 (iteration 1: the engine holds the policy's own weights); staleness
moves it by up to 1.26 and 1.64 in iterations 2 and 3, where the cap binds on 7 of 21 and 18 of 32
tokens."""

CASES: dict[str, GoldenCase] = {
    "gpt2": GoldenCase(name="gpt2", arch="gpt2"),
    "llama": GoldenCase(name="llama", arch="llama"),
    # critic-free: GRPO over groups of 4 responses to each of the 4 prompts (16 rows), no
    # advantage whitening beyond the group's own (verl/OpenRLHF GRPO), KL folded into the score
    "grpo_gpt2": GoldenCase(
        name="grpo_gpt2",
        arch="gpt2",
        group_size=4,
        conv=Convention.of(advantage=AdvantageEstimator.GRPO, whiten_advantages=Whitening.NONE),
        update=PPOUpdateConfig(ppo_epochs=2, num_minibatches=2, micro_batch_size=2, max_grad_norm=1.0),
    ),
    # a corrected run (issue #22 item 5): a bfloat16 engine one iteration stale samples; token TIS
    # with the cap C = 1.02 weighs the surrogate by min(π^prox/π^beh, C)
    "seam_gpt2": GoldenCase(
        name="seam_gpt2",
        arch="gpt2",
        seam=SeamConfig(enabled=True, dtype="bfloat16", staleness=1),
        conv=Convention.of(rollout_is="token", rollout_is_high=SEAM_TIS_CAP),
    ),
}


def variant(case: GoldenCase, **changes: Any) -> GoldenCase:
    """``case`` with hyperparameters (``hp`` fields) or conventions (``conv`` fields) changed."""
    hp_f = {k: v for k, v in changes.items() if k in Hyperparams.__dataclass_fields__}
    conv_f = {k: v for k, v in changes.items() if k in FLAT}
    unknown = set(changes) - set(hp_f) - set(conv_f)
    if unknown:
        raise ValueError(f"variant: unknown fields {sorted(unknown)}")
    return replace(case, hp=replace(case.hp, **hp_f), conv=case.conv.with_updates(conv_f))
