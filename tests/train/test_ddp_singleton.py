"""A group of one under torchrun fails on every rank in one line; it does not hang (closing_d).

The core refuses a group of one (``group_singleton=error``, :class:`refppo.errors.SingletonGroupError`)
on the rank that holds it, before ``gpg``'s batch all-reduce (and the batch σ's): the other ranks
would wait in that all-reduce. refppo's sampling cannot make such a group
(:func:`test_the_sampling_gives_every_group_exactly_group_size_rows_on_one_rank`), but a layout that
did must fail, not hang: :func:`refppo.train.group.check_groups_on_rank` (a collective every rank
calls in :func:`refppo.train.prompts.draw`) refuses it on every rank.

The 2-rank gloo run: rank 0's sampling is patched to give prompt 1 a single row, then each rank
runs the trainer's ``prompts.draw`` and, should that pass, one critic-free ``gpg`` iteration
(test_ddp_grpo's) under DDP. Both ranks must report the same one-line :class:`GroupError` from
``draw`` and exit; the harness kills any rank still running after :data:`TIMEOUT_S` and fails
(on the code before the fix, rank 0 raises the core's ConventionError alone and rank 1 waits in
the all-reduce until rank 0's exit closes the gloo connection, a RuntimeError "Connection closed by
peer": measured; a rank 0 that stayed alive, or NCCL, would leave it waiting). Worker:
``python test_ddp_singleton.py RANK WORLD INIT OUT``.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import test_ddp as ddp  # the shared rendezvous, seeded models and teardown

from refppo.train import group, prompts
from refppo.train.config.sections import ConfigError
from refppo.train.dist import DistContext
from refppo.train.tasks.presets import preset
from refppo.train.tasks.words import WordsTask

pytestmark = pytest.mark.e2e

TIMEOUT_S = 240.0
"""A rank still running after this long is hung (a clean run takes a few seconds)."""
REAL_EXPAND = group.expand_groups
SETS = ("ppo.advantage=gpg", "rollout.group_size=2", "task.reward=rule", "ppo.kl_in=loss")


def _one_row_on_rank0(texts: list[str], group_size: int, rank: int = 0) -> tuple[list[str], torch.Tensor]:
    rows, index = REAL_EXPAND(texts, group_size, rank)
    if rank == 0:  # [0, 0, 1, 1] -> [0, 0, 0, 1]: prompt 1 has one response, on rank 0 only
        index = index.clone()
        index[2] = index[0]
    return rows, index


def worker(rank: int, world: int, init: str, out: str) -> None:
    import test_ddp_grpo as dg

    dist = ddp._join(init, rank, world)
    cfg = preset("test", *SETS)
    group.expand_groups = _one_row_on_rank0  # type: ignore[assignment]  # draw reads it from the module
    try:
        task = WordsTask(cfg.task.prompt_words, cfg.task.response_words)
        _, gi = prompts.draw(
            cfg, task, random.Random(rank), None, DistContext(rank, world), torch.device("cpu")
        )
    except group.GroupError as e:
        Path(f"{out}.rank{rank}").write_text(json.dumps({"error": str(e)}))
        ddp._leave(dist)  # every rank refused here: in step, so the teardown is clean
        return
    finally:
        group.expand_groups = REAL_EXPAND  # type: ignore[assignment]
    actor0, reference, _, scored = ddp._setup()

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    shard = scored.select(dg.WHOLE[rank])
    try:
        wrap = torch.nn.parallel.DistributedDataParallel
        dg._iterate(actor0, reference, shard.batch, dg.CONVS["gpg"], gi, world, all_reduce, wrap)
    except Exception as e:  # the old behaviour: this rank refuses alone, its peer waits
        Path(f"{out}.rank{rank}").write_text(json.dumps({"late_error": f"{type(e).__name__}: {e}"}))
        ddp._finish(3)
    Path(f"{out}.rank{rank}").write_text(json.dumps({"ran": True}))
    ddp._leave(dist)


def _run_ranks(tmp_path: Path, out: Path) -> list[str]:
    """Start the ranks and wait up to TIMEOUT_S for all; kill what is left. Returns one status line
    per rank ('exit N' or 'hung: killed after ...'), each process reaped."""
    init = (tmp_path / "rendezvous").as_uri()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    logs = [tmp_path / f"rank{r}.log" for r in range(ddp.WORLD)]
    procs = []
    for r, log in enumerate(logs):
        with log.open("wb") as fh:
            argv = [sys.executable, __file__, str(r), str(ddp.WORLD), init, str(out)]
            procs.append(subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    status = []
    for p, log in zip(procs, logs, strict=True):
        hung = p.poll() is None
        if hung:
            p.kill()
        p.wait()
        tail = log.read_text(errors="replace")[-2000:]
        status.append(
            f"hung: killed after {TIMEOUT_S:.0f}s\n{tail}" if hung else f"exit {p.returncode}\n{tail}"
        )
    return status


def test_a_group_of_one_on_one_rank_fails_on_every_rank_instead_of_hanging(tmp_path: Path) -> None:
    out = tmp_path / "single"
    status = _run_ranks(tmp_path, out)
    assert all(s.startswith("exit 0") for s in status), "\n".join(status)
    results = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(ddp.WORLD)]
    want = (
        "groups [1] have one response (group 1 on rank 0) under ppo.group_singleton=error: refused on "
        "every rank before the update (set ppo.group_singleton=score or zero)"
    )
    assert results == [{"error": want}] * ddp.WORLD, results


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("g", [2, 3, 4])
@pytest.mark.parametrize("p", [1, 3])
def test_the_sampling_gives_every_group_exactly_group_size_rows_on_one_rank(
    world: int, g: int, p: int
) -> None:
    """Why the hang cannot happen today: each rank's rows, :func:`refppo.train.group.expand_groups` of
    its ``P`` prompts, give every group id exactly ``G`` rows, all on that rank."""
    ids: dict[int, list[int]] = {}
    for rank in range(world):
        rows, index = group.expand_groups([f"prompt {rank} {i}" for i in range(p)], g, rank)
        assert len(rows) == p * g == index.numel()
        for gid in index.tolist():
            ids.setdefault(gid, []).append(rank)
    assert len(ids) == world * p
    assert all(len(ranks) == g and len(set(ranks)) == 1 for ranks in ids.values()), ids


@pytest.mark.parametrize(
    "adv", ["grpo", "dr-grpo", "rloo", "reinforce++-baseline", "opo", "gpg", "grpo-passk"]
)
def test_a_group_estimator_with_groups_of_one_is_refused_by_the_config(adv: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"ppo.advantage={adv} needs rollout.group_size >= 2")):
        preset("test", f"ppo.advantage={adv}", "rollout.group_size=1")


if __name__ == "__main__":
    try:
        worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
    except BaseException:
        traceback.print_exc()
        ddp._finish(1)
    ddp._finish(0)
