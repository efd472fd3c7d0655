"""DDP: one PPO update over a global batch on 2 gloo processes == one process on the same batch.

For every loss-aggregation mode, two ranks each holding half of every minibatch (so token counts
differ per rank), with micro-batching, run ``refppo.train.update.ppo_update`` with its ``world_size`` /
``all_reduce`` hooks under ``DistributedDataParallel``; the resulting parameters must equal those
of one process running ``ppo_update`` over the whole batch. float64, plain SGD (Adam would hide a
constant loss-scale error), tolerance ``TOL`` absolute (see there). This file is also the worker script
(``python test_ddp.py RANK WORLD INIT OUT``, ``INIT`` a ``file://`` rendezvous path).

A second test checks global advantage whitening: on 2 gloo processes, ``rollout_quantities`` with
the ``all_reduce`` hook on each rank's rows equals one process on the whole batch (the per-rank
whitening without the hook does not), and one whole ``refppo.train.iteration.iteration`` (given rollout batch,
no sampling; scoring, rollout quantities and update all on the rank's shard) equals one process
over the whole batch (``python test_ddp.py RANK WORLD INIT OUT iteration``).

A third test runs the real trainer under ``torchrun --standalone --nproc-per-node 2`` (gloo, CPU).

Teardown (issue 12 item 17; a worker used to die at exit with "terminate called without an active
exception"): the workers rendezvous through a ``FileStore`` in the test's tmp dir (no TCP port, no
store-server thread in rank 0 whose exit takes the store from under rank 1), end with
``barrier()`` then ``destroy_process_group()``, check that no other thread is alive, and leave by
``os._exit`` after flushing (see :func:`_finish`). The parent kills every rank as soon as one fails
and prints each rank's exit status, stdout and stderr. torchrun's ``--standalone`` rendezvous binds
port 0 itself (no free-port-then-release race).
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import LossAgg, ScorePosition, Variance, Whitening
from refppo.models.batch import SequenceBatch
from refppo.models.roles import make_reference
from refppo.models.rollout import RolloutConfig, ScoredRollout, score_rollout
from refppo.models.tiny import tiny_critic, tiny_gpt2
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import RolloutQuantities, rollout_quantities
from refppo.train.iteration import iteration
from refppo.train.update import ppo_update
from refppo.train.update_config import PPOUpdateConfig

pytestmark = pytest.mark.e2e

WORLD = 2
B, N_MB, EPOCHS = 8, 2, 2
MB = B // N_MB  # global minibatch rows
TOL = 1e-12
"""Absolute tolerance on parameters, rollout quantities and advantages (float64). Measured: DDP vs
single process differ by <= 5.0e-16 on parameters of size O(1) (summation order of the gloo
all-reduce and of the micro-batches), rollout quantities by <= 2.3e-16. 1e-12 leaves ~2000x margin
while the errors it must catch are far larger: any loss-scale / token-count weighting error moves
the parameters by O(update) (the updates here move them by 0.14-0.29), a float32 round trip anywhere
in the path by ~1e-8."""
HP = Hyperparams(kl_coef=0.05, cliprange=0.2, vf_coef=0.5, ent_coef=0.01)


WORKER_TIMEOUT_S = 1200
"""Guard against a hung rank (not an assertion on speed): a run takes ~40 s on an idle core and
several minutes on the shared 2-core CI machine; past this the ranks are killed and the test fails
with their output."""


def _spawn_workers(tmp_path: Path, out: Path, *extra: str, script: str = __file__) -> None:
    """Run ``WORLD`` ranks of ``script`` (this file unless given) as worker processes and wait for
    all of them.

    Rendezvous: a ``FileStore`` at ``tmp_path/rendezvous`` (fresh per test), so there is no port
    to pick and no race for one. Each rank's stdout/stderr go to files (no pipe can fill and block
    a rank); as soon as one rank exits non-zero the others are killed (they would otherwise wait in
    a collective for the gloo timeout), and the assertion message carries every rank's exit status
    (signal name for a crash such as SIGABRT) and output."""
    init = (tmp_path / "rendezvous").as_uri()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    logs = [tmp_path / f"rank{r}.log" for r in range(WORLD)]
    procs = []
    for r, log in enumerate(logs):
        with log.open("wb") as fh:
            argv = [sys.executable, script, str(r), str(WORLD), init, str(out), *extra]
            procs.append(subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    report = []
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        code = p.returncode
        status = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
        report.append(f"--- rank {r}: {status}\n{log.read_text(errors='replace')[-4000:]}")
    assert all(p.returncode == 0 for p in procs), "\n".join(report)


def _join(init: str, rank: int, world: int) -> Any:
    """Join the gloo group through the ``file://`` store ``init``; returns ``torch.distributed``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    return dist


def _leave(dist: Any) -> None:
    """Clean teardown: every rank reaches the barrier only after its last collective and its
    results file, so no rank closes its gloo connections while a peer still uses them; then
    destroy the group."""
    dist.barrier()
    dist.destroy_process_group()


def _save(obj: Any, path: str) -> None:
    """Atomic, durable ``torch.save`` (temp file in the same dir, fsync, ``os.replace``): the
    parent never reads a half-written results file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _finish(code: int) -> None:
    """End a worker process without interpreter finalisation and C++ static destructors.

    By now the results are on disk (fsync'd) and the group is destroyed and was left behind a
    barrier, so no peer needs this process any more. But a DDP-wrapped model keeps the gloo
    process group alive from C++ past ``destroy_process_group()`` (not freed by ``gc.collect()``
    either), so its threads (``gloo_tcp_loop``, two ``pt_gloo_runloop``) still run when the
    process exits, racing interpreter finalisation and the static destructors: where the
    exit-time abort of issue 12 item 17 ("terminate called without an active exception") comes
    from. ``os._exit`` ends the process without that race. A Python thread still alive here would be
    a bug of the worker itself: it is reported and the exit status is 3."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if code == 0 and others:
        print(f"threads still alive at exit: {others}", file=sys.stderr)
        code = 3
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _setup() -> tuple[nn.Module, nn.Module, nn.Module, ScoredRollout]:
    """Identical (seeded) models and batch on every process, float64."""
    torch.manual_seed(0)
    size: dict[str, Any] = {"hidden": 16, "layers": 1, "heads": 2, "max_positions": 32}
    actor = tiny_gpt2(32, seed=0, **size).double()
    critic = tiny_critic("gpt2", 32, seed=1, **size).double()
    reference = make_reference(actor)
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, 32, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
        for _ in range(B)
    ]
    responses = [
        torch.randint(3, 32, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        for _ in range(B)
    ]
    batch = SequenceBatch.from_lists(prompts, responses)
    scored = score_rollout(actor, reference, critic, _reward, batch)
    return actor, reference, critic, scored


def _reward(p: list[int], r: list[int]) -> float:
    return (sum(r) % 7) / 7.0 - 0.4


def _quantities(scored: ScoredRollout, conv: Convention, all_reduce: Any = None) -> RolloutQuantities:
    return rollout_quantities(
        scores=scored.scores,
        old_logprobs=scored.old_logprobs,
        ref_logprobs=scored.ref_logprobs,
        old_values=scored.old_values,
        mask=scored.batch.response_mask,
        hp=HP,
        conv=conv,
        all_reduce=all_reduce,
    )


def _rows(rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows: half of every global minibatch (ppo_update runs with shuffle=False)."""
    half = MB // WORLD
    return torch.tensor([m * MB + rank * half + j for m in range(N_MB) for j in range(half)])


def _select(q: RolloutQuantities, rows: torch.Tensor) -> RolloutQuantities:
    return RolloutQuantities(*(getattr(q, f.name)[rows] for f in fields(q)))


def _update_cfg(micro: int) -> PPOUpdateConfig:
    return PPOUpdateConfig(
        ppo_epochs=EPOCHS, num_minibatches=N_MB, micro_batch_size=micro, max_grad_norm=1.0, shuffle=False
    )


def _update(
    actor: nn.Module,
    critic: nn.Module,
    scored: ScoredRollout,
    q: RolloutQuantities,
    conv: Convention,
    micro: int,
    world: int,
    all_reduce: Any,
    wrap: Any = None,
) -> None:
    a_opt = torch.optim.SGD(actor.parameters(), lr=0.5)
    c_opt = torch.optim.SGD(critic.parameters(), lr=0.5)
    a, c = (wrap(actor), wrap(critic)) if wrap else (actor, critic)
    cfg = _update_cfg(micro)
    ppo_update(
        a,
        c,
        a_opt,
        c_opt,
        scored,
        q,
        hp=HP,
        conv=conv,
        cfg=cfg,
        generator=torch.Generator(),
        world_size=world,
        all_reduce=all_reduce,
    )


def _params(actor: nn.Module, critic: nn.Module) -> dict[str, torch.Tensor]:
    out = {f"actor.{k}": v.detach().clone() for k, v in actor.named_parameters()}
    out.update({f"critic.{k}": v.detach().clone() for k, v in critic.named_parameters()})
    return out


def worker(rank: int, world: int, init: str, out: str) -> None:
    """One rank: for every loss-aggregation mode, a DDP update on this rank's half of the batch."""
    dist = _join(init, rank, world)
    actor0, _, critic0, scored = _setup()
    rows = _rows(rank)

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    results = {}
    for agg in MASK_AGGS:
        conv = Convention.of(loss_agg=agg)
        q = _quantities(scored, conv)  # whole batch, then split (per-shard + hook: whitening test)
        actor, critic = copy.deepcopy(actor0), copy.deepcopy(critic0)
        _update(
            actor,
            critic,
            scored.select(rows),
            _select(q, rows),
            conv,
            micro=1,
            world=world,
            all_reduce=all_reduce,
            wrap=nn.parallel.DistributedDataParallel,
        )
        results[agg.value] = _params(actor, critic)
    if rank == 0:
        _save(results, out)
    _leave(dist)


def test_ddp_update_equals_single_process_for_every_loss_agg(tmp_path: Path) -> None:
    out = tmp_path / "ddp.pt"
    _spawn_workers(tmp_path, out)
    ddp = torch.load(out, weights_only=True)

    actor0, _, critic0, scored = _setup()
    # precondition of the docstring: the ranks' token counts differ within a minibatch, so
    # token-mean over the global minibatch is not the mean of per-rank token-means
    mask = scored.batch.response_mask
    per_rank = [mask[_rows(r)].reshape(N_MB, MB // WORLD, -1).sum((1, 2)) for r in range(WORLD)]
    assert any(int(a) != int(b) for a, b in zip(*per_rank, strict=True)), per_rank
    init = _params(actor0, critic0)
    for agg in MASK_AGGS:
        conv = Convention.of(loss_agg=agg)
        actor, critic = copy.deepcopy(actor0), copy.deepcopy(critic0)
        _update(
            actor, critic, scored, _quantities(scored, conv), conv, micro=MB // 2, world=1, all_reduce=None
        )
        single = _params(actor, critic)
        moved = max(float((single[k] - init[k]).abs().max()) for k in single)
        assert moved > 1e-3, agg  # the update did something measurable
        worst = max(float((single[k] - ddp[agg.value][k]).abs().max()) for k in single)
        assert worst <= TOL, f"{agg.value}: DDP vs single process differ by {worst:.3e} (> {TOL})"


def test_torchrun_two_process_training_run(tmp_path: Path) -> None:
    """`torchrun --standalone --nproc-per-node 2 -m refppo train` (gloo, CPU) writes one log and
    per-rank RNG state."""
    from torchrun_helpers import torchrun_train  # here, not above: this file also runs as a worker script

    from refppo.train.tasks.presets import TEST

    out = tmp_path / "run"
    args = ["--out", str(out)]
    for s in (*TEST, "task.reward=rule", "task.sft_steps=3"):
        args += ["--set", s]
    torchrun_train(tmp_path / "torchrun.log", *args)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2  # rank 0 only
    ck = out / "checkpoints" / "iter_000002"
    assert (ck / "rng_rank0.pt").exists() and (ck / "rng_rank1.pt").exists() and (ck / "COMPLETE").exists()


# -------------------------------------------------------------- global advantage whitening + iteration

WHITEN_CONVS = {
    "masked-unbiased": Convention(),
    "no_shift-population-after_last": Convention.of(
        whiten_advantages=Whitening.MASKED_NO_SHIFT,
        whiten_variance=Variance.POPULATION,
        score_at=ScorePosition.AFTER_LAST_VALID,
        loss_agg=LossAgg.SEQ_MEAN_TOKEN_SUM,
    ),
}
"""Conventions of the whitening test: both variances, both mean settings, two score positions."""


def _iterate(
    actor: nn.Module,
    reference: nn.Module,
    critic: nn.Module,
    batch: SequenceBatch,
    conv: Convention,
    micro: int,
    world: int,
    all_reduce: Any,
    wrap: Any = None,
) -> torch.Tensor:
    """One ``refppo.train.iteration.iteration`` replaying ``batch`` (no sampling); returns its advantages."""
    a_opt = torch.optim.SGD(actor.parameters(), lr=0.5)
    c_opt = torch.optim.SGD(critic.parameters(), lr=0.5)
    a, c = (wrap(actor), wrap(critic)) if wrap else (actor, critic)
    result = iteration(
        a,
        reference,
        c,
        _reward,
        a_opt,
        c_opt,
        batch.prompt_ids,
        batch.prompt_mask,
        rollout_cfg=RolloutConfig(max_new_tokens=int(batch.response_ids.shape[1])),
        update_cfg=_update_cfg(micro),
        hp=HP,
        conv=conv,
        generator=torch.Generator(),
        world_size=world,
        all_reduce=all_reduce,
        batch=batch,
    )
    return result.quantities.advantages


def worker_iteration(rank: int, world: int, init: str, out: str) -> None:
    """One rank: rollout quantities on its rows (global and per-rank whitening), then one iteration
    on its rows under DDP and, as a control, one ppo_update from the per-rank-whitened quantities.
    Every rank saves ``OUT.rankR``."""
    dist = _join(init, rank, world)
    actor0, reference, critic0, scored = _setup()
    rows = _rows(rank)
    shard = scored.select(rows)

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    results: dict[str, Any] = {"rows": rows}
    for name, conv in WHITEN_CONVS.items():
        glob = _quantities(shard, conv, all_reduce)
        local = _quantities(shard, conv)
        results[f"{name}/quantities"] = {f.name: getattr(glob, f.name) for f in fields(glob)}
        results[f"{name}/local_advantages"] = local.advantages
        actor, critic = copy.deepcopy(actor0), copy.deepcopy(critic0)
        ddp = nn.parallel.DistributedDataParallel
        adv = _iterate(actor, reference, critic, shard.batch, conv, 1, world, all_reduce, wrap=ddp)
        results[f"{name}/iteration_advantages"] = adv
        results[f"{name}/params"] = _params(actor, critic)
        actor, critic = copy.deepcopy(actor0), copy.deepcopy(critic0)
        _update(actor, critic, shard, local, conv, micro=1, world=world, all_reduce=all_reduce, wrap=ddp)
        results[f"{name}/params_local_whitening"] = _params(actor, critic)
    _save(results, f"{out}.rank{rank}")
    _leave(dist)


def test_ddp_global_whitening_and_iteration_equal_single_process(tmp_path: Path) -> None:
    out = tmp_path / "whiten.pt"
    _spawn_workers(tmp_path, out, "iteration")
    ranks = [torch.load(f"{out}.rank{r}", weights_only=True) for r in range(WORLD)]

    actor0, reference, critic0, scored = _setup()
    init = _params(actor0, critic0)
    for name, conv in WHITEN_CONVS.items():
        # rollout quantities: each rank's rows of the single-process result
        single = _quantities(scored, conv)
        for res in ranks:
            rows = res["rows"]
            for f in fields(single):
                want, got = getattr(single, f.name)[rows], res[f"{name}/quantities"][f.name]
                err = float((want.double() - got.double()).abs().max())
                assert err <= TOL, f"{name}: {f.name} of rank rows {rows.tolist()} differ by {err:.3e}"
            # control: whitening each rank's rows on their own is not the global whitening
            local_err = float((single.advantages[rows] - res[f"{name}/local_advantages"]).abs().max())
            assert local_err > 1e-2, f"{name}: per-rank whitening unexpectedly global ({local_err:.3e})"

        # one whole iteration (scoring → rollout quantities → update) on the whole batch
        actor, critic = copy.deepcopy(actor0), copy.deepcopy(critic0)
        adv = _iterate(actor, reference, critic, scored.batch, conv, MB // 2, 1, None)
        after = _params(actor, critic)
        assert max(float((after[k] - init[k]).abs().max()) for k in after) > 1e-3, name
        for res in ranks:
            err = float((adv[res["rows"]] - res[f"{name}/iteration_advantages"]).abs().max())
            assert err <= TOL, f"{name}: iteration advantages differ by {err:.3e}"
        ddp = ranks[0][f"{name}/params"]
        assert all(torch.equal(ddp[k], ranks[1][f"{name}/params"][k]) for k in ddp)  # DDP kept ranks in sync
        worst = max(float((after[k] - ddp[k]).abs().max()) for k in after)
        assert worst <= TOL, f"{name}: DDP iteration vs single process differ by {worst:.3e} (> {TOL})"
        # control: the same DDP update from per-rank-whitened advantages lands elsewhere
        local = ranks[0][f"{name}/params_local_whitening"]
        off = max(float((after[k] - local[k]).abs().max()) for k in after)
        assert off > 1e-3, f"{name}: per-rank whitening gave the global update ({off:.3e})"  # measured 0.065+


if __name__ == "__main__":
    try:
        args = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
        (worker_iteration if sys.argv[5:] == ["iteration"] else worker)(*args)
    except BaseException:
        traceback.print_exc()
        _finish(1)
    _finish(0)
