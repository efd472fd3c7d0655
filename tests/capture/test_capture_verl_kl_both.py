"""verl's trainer config with ``use_kl_in_reward`` and ``actor.use_kl_loss`` both on (issue #23
item 5): the adapter writes ``kl_in=both`` with the reward's ``kl_ctrl.kl_coef`` / ``kl_penalty`` and
the loss's own ``kl_loss_coef`` / ``kl_loss_type`` (verl 0.9.1 ``ray_trainer.apply_kl_penalty``,
``workers/utils/losses.py::ppo_loss``), where it refused the config before."""

from __future__ import annotations

from typing import Any

import pytest

from refppo.capture.adapters.verl import verl_hparams


def _cfg() -> dict[str, Any]:
    return {
        "algorithm": {"use_kl_in_reward": True, "kl_penalty": "kl", "kl_ctrl": {"kl_coef": 0.05}},
        "actor_rollout_ref": {
            "actor": {"use_kl_loss": True, "kl_loss_type": "low_var_kl", "kl_loss_coef": 0.1}
        },
    }


def test_both_kl_sites_keep_their_own_beta_and_estimator() -> None:
    hp, conv = verl_hparams(_cfg())
    assert (hp["kl_coef"], hp["kl_loss_coef"]) == (0.05, 0.1)
    assert (conv["kl_in"], conv["kl_estimator"], conv["kl_loss_estimator"]) == ("both", "k1", "k3")
    assert (
        verl_hparams(_cfg(), kl_coef=0.02)[0]["kl_coef"] == 0.02
    )  # the controller moves the reward's β only
    one = _cfg()
    one["algorithm"]["use_kl_in_reward"] = False
    hp1, conv1 = verl_hparams(one)
    assert "kl_loss_coef" not in hp1 and "kl_loss_estimator" not in conv1 and conv1["kl_in"] == "loss"


def test_unknown_kl_loss_type_is_one_line() -> None:
    cfg = _cfg()
    cfg["actor_rollout_ref"]["actor"]["kl_loss_type"] = "full"
    with pytest.raises(ValueError, match="'full' has no refppo counterpart"):
        verl_hparams(cfg)
