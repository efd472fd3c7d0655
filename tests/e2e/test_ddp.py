"""DDP: one PPO update over a global batch on 2 gloo processes == one process on the same batch.

For every loss-aggregation mode, two ranks each holding half of every minibatch (so token counts
differ per rank), with micro-batching, run ``refppo.ppo.ppo_update`` with its ``world_size`` /
``all_reduce`` hooks under ``DistributedDataParallel``; the resulting parameters must equal those
of one process running ``ppo_update`` over the whole batch. float64, plain SGD (Adam would hide a
constant loss-scale error), tolerance 1e-10 absolute. This file is also the worker script
(``python test_ddp.py RANK WORLD PORT OUT``).

A second test runs the real trainer under ``torchrun --nproc-per-node 2`` (gloo, CPU).
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from refppo import models
from refppo.conventions import LossAgg
from refppo.pipeline import Convention, Hyperparams, RolloutQuantities, rollout_quantities
from refppo.ppo import PPOUpdateConfig, ppo_update
from refppo.rollout import ScoredRollout, score_rollout

WORLD = 2
B, N_MB, EPOCHS = 8, 2, 2
MB = B // N_MB  # global minibatch rows
TOL = 1e-10
HP = Hyperparams(kl_coef=0.05, cliprange=0.2, vf_coef=0.5, ent_coef=0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _setup() -> tuple[nn.Module, nn.Module, nn.Module, ScoredRollout]:
    """Identical (seeded) models and batch on every process, float64."""
    torch.manual_seed(0)
    size: dict[str, Any] = {"hidden": 16, "layers": 1, "heads": 2, "max_positions": 32}
    actor = models.tiny_gpt2(32, seed=0, **size).double()
    critic = models.tiny_critic("gpt2", 32, seed=1, **size).double()
    reference = models.make_reference(actor)
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, 32, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
        for _ in range(B)
    ]
    responses = [
        torch.randint(3, 32, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        for _ in range(B)
    ]
    batch = models.SequenceBatch.from_lists(prompts, responses)

    def reward(p: list[int], r: list[int]) -> float:
        return (sum(r) % 7) / 7.0 - 0.4

    scored = score_rollout(actor, reference, critic, reward, batch)
    return actor, reference, critic, scored


def _quantities(scored: ScoredRollout, conv: Convention) -> RolloutQuantities:
    return rollout_quantities(
        scores=scored.scores,
        old_logprobs=scored.old_logprobs,
        ref_logprobs=scored.ref_logprobs,
        old_values=scored.old_values,
        mask=scored.batch.response_mask,
        hp=HP,
        conv=conv,
    )


def _rows(rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows: half of every global minibatch (ppo_update runs with shuffle=False)."""
    half = MB // WORLD
    return torch.tensor([m * MB + rank * half + j for m in range(N_MB) for j in range(half)])


def _select(q: RolloutQuantities, rows: torch.Tensor) -> RolloutQuantities:
    return RolloutQuantities(*(getattr(q, f.name)[rows] for f in fields(q)))


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
    cfg = PPOUpdateConfig(
        ppo_epochs=EPOCHS, num_minibatches=N_MB, micro_batch_size=micro, max_grad_norm=1.0, shuffle=False
    )
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


def worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank: for every loss-aggregation mode, a DDP update on this rank's half of the batch."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    actor0, _, critic0, scored = _setup()
    rows = _rows(rank)

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    results = {}
    for agg in LossAgg:
        conv = replace(Convention(), loss_agg=agg)
        q = _quantities(scored, conv)  # global whitening: computed on the whole batch, then split
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
        torch.save(results, out)
    dist.destroy_process_group()


def test_ddp_update_equals_single_process_for_every_loss_agg(tmp_path: Path) -> None:
    out = tmp_path / "ddp.pt"
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), str(WORLD), str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(WORLD)
    ]
    logs = [p.communicate(timeout=240)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    ddp = torch.load(out, weights_only=True)

    actor0, _, critic0, scored = _setup()
    init = _params(actor0, critic0)
    for agg in LossAgg:
        conv = replace(Convention(), loss_agg=agg)
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
    """`torchrun --nproc-per-node 2 -m refppo train` (gloo, CPU) writes one log and per-rank RNG state."""
    from refppo.tasks.presets import TEST

    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
        "-m",
        "refppo",
        "train",
        "--out",
        str(out),
    ]
    for s in TEST:
        argv += ["--set", s]
    argv += ["--set", "task.reward=rule", "--set", "task.sft_steps=3"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2  # rank 0 only
    ck = out / "checkpoints" / "iter_000002"
    assert (ck / "rng_rank0.pt").exists() and (ck / "rng_rank1.pt").exists() and (ck / "COMPLETE").exists()


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
