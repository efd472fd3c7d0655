"""``refppo.pipeline`` and ``refppo.ppo`` after their split (:mod:`refppo.split_module`): the old
module's names are the parts' very objects, and assigning one on the old module (a test's
monkeypatch) also assigns it in the part that looks it up at call time; undoing the patch restores
both. Without the forwarding 22 existing tests that patch ``refppo.pipeline``/``refppo.ppo`` names
(``ROW_BLOCK_ELEMENTS``, ``gae``, ``token_kl``, ``rollout_quantities``, ...) fail: their patch would
change the re-exported copy only."""

from __future__ import annotations

import pytest
import torch

import refppo.pipeline as pl
import refppo.pipeline_blocks as blocks
import refppo.pipeline_rollout as rollout
import refppo.pipeline_update as update
import refppo.ppo as ppo
import refppo.train.iteration as train_iteration
import refppo.train.update as train_update
import refppo.train.update_config as train_update_config
from refppo.conventions import GaeHoles


def test_the_old_names_are_the_parts_objects() -> None:
    assert pl.rollout_quantities is rollout.rollout_quantities
    assert pl.critic_free_advantages is rollout.critic_free_advantages
    assert pl.update_quantities is update.update_quantities
    assert pl.Normalisers is update.Normalisers
    assert pl.gae_by_rows is blocks.gae_by_rows and pl.update_rows is blocks.update_rows
    assert pl.ROW_BLOCK_ELEMENTS == blocks.ROW_BLOCK_ELEMENTS
    assert ppo.ppo_update is train_update.ppo_update and ppo.ptx_loss is train_update.ptx_loss
    assert ppo.iteration is train_iteration.iteration
    assert ppo.rollout_metrics is train_iteration.rollout_metrics
    assert ppo.PPOUpdateConfig is train_update_config.PPOUpdateConfig
    assert ppo.MinibatchRecord is train_update_config.MinibatchRecord


def test_a_patch_of_row_block_elements_reaches_the_row_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 24 elements per block and T = 12, GAE over 5 rows runs in blocks of 2 rows: 3 calls."""
    calls: list[int] = []
    real = blocks.gae

    def counting(rewards: torch.Tensor, *a: object, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(rewards.shape[0])
        return real(rewards, *a, **kw)  # type: ignore[arg-type]  # forwarded as given

    monkeypatch.setattr(pl, "ROW_BLOCK_ELEMENTS", 24)
    monkeypatch.setattr(pl, "gae", counting)
    assert blocks.ROW_BLOCK_ELEMENTS == 24 and blocks.gae is counting
    x = torch.ones(5, 12)
    pl.gae_by_rows(x, x, x.bool(), gamma=1.0, lam=1.0, holes=GaeHoles.SKIP)
    assert calls == [2, 2, 1]
    assert pl.update_rows(torch.ones(5, 12, dtype=torch.bool)) == 2
    monkeypatch.undo()
    assert blocks.ROW_BLOCK_ELEMENTS == pl.ROW_BLOCK_ELEMENTS == 1 << 18
    assert blocks.gae is real and pl.gae is real


def test_a_patch_reaches_only_the_parts_holding_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    sentinel = object()
    monkeypatch.setattr(ppo, "rollout_quantities", sentinel)
    assert train_iteration.rollout_quantities is sentinel  # iteration looks it up there
    assert pl.rollout_quantities is rollout.rollout_quantities  # the pipeline itself is untouched
    assert not hasattr(train_update, "rollout_quantities")  # not added where it was not
    monkeypatch.setattr(pl, "not_a_pipeline_name", 1, raising=False)
    assert not any(hasattr(m, "not_a_pipeline_name") for m in (rollout, update, blocks))
    monkeypatch.undo()
    assert train_iteration.rollout_quantities is rollout.rollout_quantities
