"""Critic-free estimators under DDP (issue #13 item 5): whole groups per rank, checked.

On 2 gloo processes (the rendezvous, spawn and teardown of tests/train/test_ddp.py: FileStore,
barrier + destroy, ``os._exit``), each rank holds two whole groups of the 8-row batch of
test_ddp's ``_setup`` and runs one critic-free ``refppo.train.iteration.iteration`` (no critic, given rollout
batch) with the ``all_reduce`` hook and ``groups_on_rank=True``, the actor under
``DistributedDataParallel``. For ``grpo``, ``rloo``, ``reinforce++-baseline`` (whose batch
whitening needs the all-reduce), ``flash-reinforce`` (its baseline is the batch mean), ``gpg``
(its ``α`` counts the batch's nonzero scores; a reward zero on two of rank 0's rows only, so
each rank's own α is not the batch's) and ``grpo`` with the std over the batch
(``group_std_level`` ``batch``, ``batch-centred``: all-reduced batch statistics), each rank's
advantages must equal the rows of ONE process running the group estimator of ``refppo.core.group``
directly on the whole batch, and the parameters the single-process iteration reaches. A split
layout (each group's two rows on different ranks) must be refused by
:func:`refppo.train.group.check_groups_on_rank` on both ranks, with the group named.

``python test_ddp_grpo.py RANK WORLD INIT OUT`` is the worker.
"""

from __future__ import annotations

import copy
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import test_ddp as ddp  # the shared spawn/teardown helpers

from refppo.conventions import AdvantageEstimator, KLPlacement, Whitening
from refppo.core.group_naive import group_advantages_naive
from refppo.group_conventions import GroupStdLevel
from refppo.models.rollout import RolloutConfig, score_rollout
from refppo.pipeline.settings import Convention
from refppo.train.group import GroupError, check_groups_on_rank
from refppo.train.iteration import iteration
from refppo.train.update_config import PPOUpdateConfig

pytestmark = pytest.mark.e2e

GROUP_INDEX = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
"""Four prompts answered twice each (B = 8 rows of test_ddp's batch)."""
WHOLE = [torch.arange(0, 4), torch.arange(4, 8)]
"""Rank r's rows when groups are whole: groups {2r, 2r+1}."""
SPLIT = [torch.tensor([0, 2, 4, 6]), torch.tensor([1, 3, 5, 7])]
"""Every group split over the two ranks (must be refused)."""
CONVS = {
    "grpo": Convention.of(advantage=AdvantageEstimator.GRPO, whiten_advantages=Whitening.NONE),
    "rloo": Convention.of(advantage=AdvantageEstimator.RLOO, whiten_advantages=Whitening.NONE),
    "reinforce++-baseline": Convention.of(advantage=AdvantageEstimator.REINFORCE_PP_BASELINE),
    # grpo's std over the whole batch (TRL scale_rewards="batch", AReaL std_level batch): batch
    # statistics, all-reduced across the ranks
    "grpo-std-batch": Convention.of(
        advantage=AdvantageEstimator.GRPO,
        whiten_advantages=Whitening.NONE,
        group_std_level=GroupStdLevel.BATCH,
    ),
    "grpo-std-batch-centred": Convention.of(
        advantage=AdvantageEstimator.GRPO,
        whiten_advantages=Whitening.NONE,
        group_std_level=GroupStdLevel.BATCH_CENTRED,
    ),
    # batch statistics (all-reduced): flash-reinforce's batch mean (each rank's own mean differs:
    # asserted below), gpg's α = B/#{s ≠ 0}: with the KL in the loss the folded score is the score,
    # and _gpg_reward zeroes two of rank 0's four rows only, so α = 8/6 over the batch but 4/2 on
    # rank 0 and 4/4 on rank 1 (asserted below)
    "flash-reinforce": Convention.of(
        advantage=AdvantageEstimator.FLASH_REINFORCE, whiten_advantages=Whitening.NONE
    ),
    "gpg": Convention.of(
        advantage=AdvantageEstimator.GPG, whiten_advantages=Whitening.NONE, kl_in=KLPlacement.LOSS
    ),
}


def _gpg_reward(p: list[int], r: list[int]) -> float:
    """test_ddp's reward, but exactly 0 where ``Σr mod 7`` is 0 or 2: rows 1 and 2 of the batch,
    both on rank 0 (``WHOLE[0]``; the test asserts it), so gpg's α differs per rank."""
    return 0.0 if sum(r) % 7 in (0, 2) else ddp._reward(p, r)


REWARDS: dict[str, Any] = {"gpg": _gpg_reward}
"""The reward of a case, when not test_ddp's ``_reward``."""


def _scored(name: str) -> Any:
    """test_ddp's seeded models and batch, scored with case ``name``'s reward."""
    actor0, reference, critic, scored = ddp._setup()
    if name in REWARDS:
        scored = score_rollout(actor0, reference, critic, REWARDS[name], scored.batch)
    return actor0, reference, scored


UPDATE = PPOUpdateConfig(
    ppo_epochs=2, num_minibatches=1, micro_batch_size=2, max_grad_norm=1.0, shuffle=False
)
"""One minibatch per epoch: the DDP step's rows are the single process's rows."""


def _iterate(actor: nn.Module, reference: nn.Module, batch: Any, conv: Convention, gi: torch.Tensor,
             world: int, all_reduce: Any, wrap: Any = None,
             reward: Any = ddp._reward) -> torch.Tensor:  # fmt: skip
    """One critic-free iteration replaying ``batch`` scored by ``reward``; returns its advantages."""
    opt = torch.optim.SGD(actor.parameters(), lr=0.5)
    result = iteration(
        wrap(actor) if wrap else actor,
        reference,
        None,
        reward,
        opt,
        None,
        batch.prompt_ids,
        batch.prompt_mask,
        rollout_cfg=RolloutConfig(max_new_tokens=int(batch.response_ids.shape[1])),
        update_cfg=UPDATE,
        hp=ddp.HP,
        conv=conv,
        generator=torch.Generator(),
        world_size=world,
        all_reduce=all_reduce,
        batch=batch,
        group_index=gi,
        groups_on_rank=all_reduce is not None,
    )
    return result.quantities.advantages


def worker(rank: int, world: int, init: str, out: str) -> None:
    dist = ddp._join(init, rank, world)
    actor0, reference, _, scored = ddp._setup()

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    results: dict[str, Any] = {}
    try:
        check_groups_on_rank(GROUP_INDEX[SPLIT[rank]], world, torch.device("cpu"))
        results["split_error"] = ""
    except GroupError as e:
        results["split_error"] = str(e)
    check_groups_on_rank(GROUP_INDEX[WHOLE[rank]], world, torch.device("cpu"))  # must pass
    shard = scored.select(WHOLE[rank])
    for name, conv in CONVS.items():
        actor = copy.deepcopy(actor0)
        wrap = nn.parallel.DistributedDataParallel
        reward = REWARDS.get(name, ddp._reward)
        adv = _iterate(
            actor, reference, shard.batch, conv, GROUP_INDEX[WHOLE[rank]], world, all_reduce, wrap, reward
        )
        results[f"{name}/advantages"] = adv
        results[f"{name}/params"] = {k: v.detach().clone() for k, v in actor.named_parameters()}
    ddp._save(results, f"{out}.rank{rank}")
    ddp._leave(dist)


def _direct(scored: Any, conv: Convention, gi: torch.Tensor = GROUP_INDEX) -> torch.Tensor:
    """The core's naive twin of the group estimator on the whole batch (its batch whitening
    included for ``reinforce++-baseline``); the folded score is score − β·Σ_t KL_t (k1), the score
    itself when the KL is in the loss."""
    m = scored.batch.response_mask
    kl = ((scored.old_logprobs - scored.ref_logprobs).double() * m).sum(1)
    beta = ddp.HP.kl_coef if conv.kl.placement is KLPlacement.REWARD else 0.0
    s = scored.scores.double() - beta * kl
    return group_advantages_naive(
        s, gi, m, estimator=conv.adv.estimator, unbiased_std=True, eps=conv.adv.group_eps,
        whiten_eps=ddp.HP.whiten_eps, std_level=conv.adv.group_std_level,
    )  # fmt: skip


def test_ddp_group_estimators_with_whole_groups_per_rank_equal_single_process(tmp_path: Path) -> None:
    out = tmp_path / "grpo.pt"
    ddp._spawn_workers(tmp_path, out, script=__file__)
    ranks = [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(ddp.WORLD)]
    for res in ranks:  # the split layout is refused on every rank, naming a group
        assert res["split_error"].startswith("group 0 has rows on ranks 0 and 1"), res["split_error"]
    for name, conv in CONVS.items():
        actor0, reference, scored = _scored(name)
        want = _direct(scored, conv)
        actor = copy.deepcopy(actor0)
        single = _iterate(
            actor, reference, scored.batch, conv, GROUP_INDEX, 1, None, None, REWARDS.get(name, ddp._reward)
        )
        assert float((single.double() - want).abs().max()) <= 1e-9, name  # the pipeline = the core
        moved = max(
            float((p - p0).detach().abs().max())
            for p, p0 in zip(actor.parameters(), actor0.parameters(), strict=True)
        )
        assert moved > 1e-3, name
        if name == "flash-reinforce":  # not vacuous: a per-rank mean would give other advantages
            local = _direct(scored.select(WHOLE[0]), conv, GROUP_INDEX[WHOLE[0]])
            assert float((local - want[WHOLE[0]]).abs().max()) > 1e-3
        if name == "gpg":  # not vacuous: zeros on rank 0 only, so each rank's own α gives other advantages
            zero = (scored.scores == 0).nonzero().flatten().tolist()
            assert zero == [1, 2] and set(zero) <= set(WHOLE[0].tolist()), zero
            for r in range(ddp.WORLD):
                local = _direct(scored.select(WHOLE[r]), conv, GROUP_INDEX[WHOLE[r]])
                assert float((local - want[WHOLE[r]]).abs().max()) > 1e-3, r
        for r, res in enumerate(ranks):
            err = float((res[f"{name}/advantages"].double() - want[WHOLE[r]]).abs().max())
            assert err <= ddp.TOL, f"{name}: rank {r} advantages differ from the whole batch by {err:.3e}"
        params = dict(actor.named_parameters())
        worst = max(
            float((params[k].detach() - v).abs().max()) for k, v in ranks[0][f"{name}/params"].items()
        )
        assert worst <= ddp.TOL, f"{name}: DDP vs single process parameters differ by {worst:.3e}"


def test_torchrun_grpo_training_run(tmp_path: Path) -> None:
    """`torchrun --standalone --nproc-per-node 2 -m refppo train --set ppo.advantage=grpo` (gloo,
    CPU): one group of 4 per rank; no critic files in the checkpoint; one log."""
    from torchrun_helpers import torchrun_train  # here, not above: this file also runs as a worker script

    from refppo.train.tasks.presets import TEST

    out = tmp_path / "run"
    args = ["--out", str(out)]
    for s in (*TEST, "task.reward=rule", "task.sft_steps=3", "ppo.advantage=grpo", "rollout.group_size=4"):
        args += ["--set", s]
    torchrun_train(tmp_path / "torchrun.log", *args)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    ck = out / "checkpoints" / "iter_000002"
    names = {p.name for p in ck.iterdir()}
    assert {"rng_rank0.pt", "rng_rank1.pt", "COMPLETE", "optim_policy.pt"} <= names
    assert not any("critic" in n for n in names), names


if __name__ == "__main__":
    try:
        worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
    except BaseException:
        traceback.print_exc()
        ddp._finish(1)
