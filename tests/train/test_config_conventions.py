"""The trainer's ``[ppo]`` keys are derived from the grouped Convention (its flat keys, less the two
that describe how an observed trainer logs and masks: ``approx_kl``, ``vf_mask``) and stay exactly
those of the release before the grouping: the same names in the same order, the same config hash
(old run folders resume: tests/train/test_resume_compat.py), the same ``--help-config`` rows."""

from __future__ import annotations

import pytest

from refppo.pipeline.settings import CONFIG_KEYS, FLAT_ORDER
from refppo.train.config.doc import config_keys
from refppo.train.config.schema import TrainConfig, load_config
from refppo.train.config.sections import ConfigError
from refppo.train.rundir import config_hash, without_keys

PPO_KEYS_BEFORE = [
    "epochs",
    "minibatches",
    "micro_batches",
    "max_grad_norm",
    "gamma",
    "lam",
    "kl_coef",
    "cliprange",
    "cliprange_high",
    "cliprange_value",
    "vf_coef",
    "ent_coef",
    "whiten_eps",
    "horizon",
    "kl_estimator",
    "kl_in",
    "score_at",
    "whiten_advantages",
    "whiten_variance",
    "loss_agg",
    "value_loss",
    "dual_clip",
    "log_ratio_clamp",
    "kl_log_ratio_clamp",
    "kl_value_clamp",
    "value_loss_agg",
    "whiten_eps_at",
    "whiten_rewards",
    "gae_padding",
    "kl_loss_agg",
    "entropy_agg",
    "value_clip_form",
    "policy_loss",
    "gae_holes",
    "whiten_holes",
    "advantage",
    "group_std",
    "group_std_level",
    "group_singleton",
    "group_kl",
    "group_eps",
    "score_bias",
    "score_scale",
    "score_clip",
]
"""``TrainConfig().to_dict()["ppo"]`` of commit 5511172 (before the grouped Convention), measured."""
HASH_BEFORE = "610fb5599c345a6040ce5019928abc13728647242ad23c8d83bcabe9a45ee330"
"""``config_hash(TrainConfig().to_dict(), ())`` of commit 5511172, measured."""


SEAM_ADDED = (
    "ppo.rollout_is",
    "ppo.rollout_is_agg",
    "ppo.rollout_is_mode",
    "ppo.rollout_is_low",
    "ppo.rollout_is_high",
    "ppo.rollout_rs",
    "ppo.rollout_rs_stat",
    "ppo.rollout_rs_order",
    "ppo.rollout_rs_reduce",
    "ppo.rollout_rs_low",
    "ppo.rollout_rs_high",
    "ppo.rollout_rs_effect",
    "seam.enabled",
    "seam.dtype",
    "seam.logprobs",
    "seam.staleness",
    "seam.staleness_min",
)
"""The keys the seam mode added since (issue #22 item 5; the gates ``rollout_rs*``: item 2),
appended after the others."""


def test_ppo_keys_and_the_default_hash_are_unchanged() -> None:
    """Apart from the seam mode's keys, which an older run's config lacks (accepted at their
    defaults on ``--resume``: tests/train/test_resume_compat.py), the default config is the one of
    5511172: the same ``[ppo]`` keys in the same order, the same hash without the added keys."""
    data = TrainConfig().to_dict()
    added = [k for k in data["ppo"] if k not in PPO_KEYS_BEFORE]
    assert list(data["ppo"]) == PPO_KEYS_BEFORE + added
    assert [f"ppo.{k}" for k in added] + [f"seam.{k}" for k in data["seam"]] == list(SEAM_ADDED)
    assert config_hash(without_keys(data, SEAM_ADDED), ()) == HASH_BEFORE
    assert [k for k in FLAT_ORDER if k in CONFIG_KEYS] == list(CONFIG_KEYS)
    rows = [r[0] for r in config_keys() if r[0].startswith("ppo.")]
    assert rows == [f"ppo.{k}" for k in PPO_KEYS_BEFORE] + [k for k in SEAM_ADDED if k.startswith("ppo.")]


@pytest.mark.parametrize("item", ["ppo.approx_kl=k1", "ppo.vf_mask=response"])
def test_the_observed_trainers_keys_are_not_trainer_keys(item: str) -> None:
    with pytest.raises(ConfigError, match=r"unknown key '(approx_kl|vf_mask)' in \[ppo\]"):
        load_config(None, [item])


def test_a_convention_value_error_names_its_section_key() -> None:
    with pytest.raises(ConfigError, match=r"^ppo\.dual_clip: expected c > 1 or None, got 0\.5$"):
        load_config(None, ["ppo.dual_clip=0.5"])
    cfg = load_config(None, ["ppo.score_clip=2.0", "ppo.loss_agg=token-sum"])
    assert cfg.ppo.convention.score.clip == 2.0 and cfg.ppo.convention.agg.loss.value == "token-sum"
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
