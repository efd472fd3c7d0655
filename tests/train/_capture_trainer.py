"""A small hand-written PPO trainer step for tests/train/test_capture_ddp.py: 2 gloo ranks × 2
micro-batches of unequal token counts (and unequal widths) per rank, DDP-averaged gradients, the
loss from ``refppo.pipeline.step.update_quantities`` with the step's global normalisers, dumped through
``refppo.capture.recorder.StepRecorder`` — plus switches that inject one known bug each (:data:`BUGS`).

Worker: ``python _capture_trainer.py RANK WORLD INIT OUT_DIR`` writes ``OUT_DIR/<case>.safetensors``
for every case of :data:`CASES` (rank 0 writes; every rank records). Teardown as
tests/train/test_ddp.py: FileStore rendezvous, barrier + destroy, ``os._exit``.
"""

from __future__ import annotations

import copy
import os
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from refppo.agg_conventions import MASK_AGGS
from refppo.capture.recorder import StepRecorder
from refppo.conventions import LossAgg
from refppo.core.aggregate import aggregate_loss
from refppo.pipeline.blocks import Normalisers
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import RolloutQuantities, rollout_quantities, update_quantities

WORLD = 2
VOCAB, HIDDEN, T = 13, 8, 6
LENGTHS: tuple[tuple[tuple[int, ...], ...], ...] = (
    ((5,), (2, 6, 3)),  # rank 0: micro-batch 0 has 1 row (5 tokens), micro-batch 1 has 3 (11 tokens)
    ((1, 3), (4, 4)),  # rank 1: 2 rows (4 tokens, T_k = 3) and 2 rows (8 tokens, T_k = 4)
)
"""Valid response tokens per row, per micro-batch, per rank: unequal token counts, row counts and
widths (each micro-batch is trimmed to its own longest row, so the recorder pads)."""
LENGTHS_K3: tuple[tuple[tuple[int, ...], ...], ...] = (((5,), (2, 6), (3,)), ((1,), (3,), (4, 4)))
"""The same rows in 3 micro-batches per rank: the missing-1/K case needs K ≠ W to be told from W."""
HP = Hyperparams(kl_coef=0.05, cliprange=0.2, cliprange_value=0.2, vf_coef=0.5, horizon=float(T))
"""``horizon`` fixed: ``seq-mean-token-sum-norm`` would otherwise divide by each micro-batch's width."""

BUGS: tuple[str, ...] = (
    "token_mean_per_micro",  # each micro-batch's own token-mean, averaged over K (and DDP over W)
    "seq_count_per_micro",  # seq-mean-token-mean over each micro-batch's own sequence count, / K
    "ddp_sum",  # manual all_reduce SUM of the gradients where the loss assumes DDP's average
    "missing_accumulation",  # normalised by the per-micro-batch share N/K, the 1/K forgotten
    "advantages_not_detached",  # advantages built from the current values inside the graph
    "clipped_region_gradient",  # the clip as a straight-through: gradient flows where it clips
    "padding_leak",  # rank 1, micro-batch 0: the first padded slot of each row joins the masks
)
CASES: tuple[tuple[str, str, str | None], ...] = (
    *((f"ok-{agg.value}", agg.value, None) for agg in MASK_AGGS),
    *((bug, "seq-mean-token-mean" if bug == "seq_count_per_micro" else "token-mean", bug) for bug in BUGS),
)
"""``(name, loss_agg, bug)``: every aggregation mode done right, then each bug on its own."""


class Policy(nn.Module):
    """``log π(y_t | y_{t-1})``: an embedding of the previous token and a linear read-out."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        """``ids`` [b, T+1] → log-probs [b, T] of ``ids[:, 1:]``."""
        logp = torch.log_softmax(self.out(torch.tanh(self.emb(ids[:, :-1]))), dim=-1)
        return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


class Critic(nn.Module):
    """``V_t`` read at the token before ``y_t``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(ids[:, :-1]))).squeeze(-1)


@dataclass(frozen=True)
class Batch:
    """The whole optimizer step (all ranks' rows, rank-major, micro-batch order), float64."""

    ids: Tensor
    mask: Tensor
    old_logprobs: Tensor
    ref_logprobs: Tensor
    old_values: Tensor
    scores: Tensor


def lengths(bug: str | None) -> tuple[tuple[tuple[int, ...], ...], ...]:
    return LENGTHS_K3 if bug == "missing_accumulation" else LENGTHS


def micro_rows(bug: str | None = None) -> list[list[tuple[int, int, list[int], int]]]:
    """Per rank: ``(rank, k, global row indices, width T_k)`` of each micro-batch."""
    out, row = [], 0
    for r, micros in enumerate(lengths(bug)):
        mine = []
        for k, lens in enumerate(micros):
            mine.append((r, k, list(range(row, row + len(lens))), max(lens)))
            row += len(lens)
        out.append(mine)
    return out


def setup() -> tuple[Policy, Critic, Batch]:
    """Seeded models and step batch, identical on every process. The rollout log-probs and values
    are the models' own plus noise, so ratios cross both clip boundaries."""
    torch.manual_seed(0)
    policy, critic = Policy().double(), Critic().double()
    lens = torch.tensor([n for micros in LENGTHS for lens in micros for n in lens])
    B = int(lens.numel())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    mask = torch.arange(T).expand(B, T) < lens.unsqueeze(1)
    with torch.no_grad():
        lp, v = policy(ids), critic(ids)
    noise = lambda s: s * torch.randn(B, T, generator=g, dtype=torch.float64)  # noqa: E731
    old = lp + noise(0.25)
    batch = Batch(
        ids, mask, old, old + noise(0.1), v + noise(0.3), torch.randn(B, generator=g, dtype=torch.float64)
    )
    return policy, critic, batch


def quantities(b: Batch, conv: Convention) -> RolloutQuantities:
    """Steps 1–4 on the whole step (global whitening), as every rank computes them."""
    return rollout_quantities(
        scores=b.scores,
        old_logprobs=b.old_logprobs,
        ref_logprobs=b.ref_logprobs,
        old_values=b.old_values,
        mask=b.mask,
        hp=HP,
        conv=conv,
    )


def _normalisers(b: Batch, q: RolloutQuantities, div: float = 1.0) -> Normalisers:
    B = float(b.mask.shape[0])
    return Normalisers(float(b.mask.sum()) / div, B / div, float(q.value_mask.sum()) / div)


def _leak(m: Tensor) -> Tensor:
    """``m`` plus the first padded slot of each row (where the row is shorter than the width)."""
    first_pad = torch.nn.functional.pad(m[:, :-1], (1, 0), value=True) & ~m
    return m | first_pad


def micro_loss(
    rows: list[int],
    width: int,
    lp: Tensor,
    v: Tensor,
    b: Batch,
    q: RolloutQuantities,
    conv: Convention,
    bug: str | None,
    where: tuple[int, int],
) -> dict[str, Tensor]:
    """The losses this micro-batch passes to backward (``loss``) and records, by ``bug``."""
    sel = (torch.tensor(rows), slice(0, width))
    m, vm = b.mask[sel], q.value_mask[sel]
    adv = q.advantages[sel]
    norm: Normalisers | None = _normalisers(b, q)
    scale = float(WORLD)  # DDP averages over W ranks; the global normalisers make the sum right
    if bug == "token_mean_per_micro":
        norm, scale = None, 1.0 / len(lengths(bug)[where[0]])
    elif bug == "seq_count_per_micro":
        assert norm is not None
        norm = Normalisers(norm.token_count, float(len(rows)), norm.value_token_count)
        scale = 1.0 / len(lengths(bug)[where[0]])
    elif bug == "missing_accumulation":
        norm = _normalisers(b, q, div=3.0)  # the per-micro-batch share N/K; the trainer forgot 1/K
    elif bug == "padding_leak" and where == (1, 0):
        m, vm = _leak(m), _leak(vm)
    uq = update_quantities(
        logprobs=lp, values=v, old_logprobs=b.old_logprobs[sel], old_values=b.old_values[sel],
        advantages=adv, returns=q.returns[sel], mask=m, value_mask_=vm, ref_logprobs=b.ref_logprobs[sel],
        hp=HP, conv=conv, norm=norm,
    )  # fmt: skip
    pg = uq.pg_loss
    if bug in ("clipped_region_gradient", "advantages_not_detached"):
        # hand-written surrogate (the core detaches the advantages and cuts the clipped ratio)
        assert norm is not None and norm.token_count is not None
        ratio = torch.exp(lp - b.old_logprobs[sel])
        cut = ratio.clamp(1 - HP.cliprange, 1 + HP.cliprange)
        if bug == "clipped_region_gradient":
            cut = ratio + (cut - ratio).detach()  # straight-through: the clip leaves the gradient on
        else:
            adv = adv - (v - v.detach())  # A = R − V(current): same values, the policy loss reaches V
        mat = torch.maximum(-adv * ratio, -adv * cut)
        pg = aggregate_loss(mat, m, conv.agg.loss, token_count=norm.token_count)
    loss = pg + HP.vf_coef * uq.vf_loss
    return {"loss": scale * loss, "pg_loss": scale * pg, "vf_loss": scale * uq.vf_loss}


def step(
    rank: int, dist: Any, policy: Policy, critic: Critic, b: Batch, agg: str, bug: str | None, path: Path
) -> None:
    """One optimizer step of this rank's micro-batches, recorded and dumped."""
    conv = Convention.of(loss_agg=LossAgg(agg))
    q = quantities(b, conv)
    pol, cri = copy.deepcopy(policy), copy.deepcopy(critic)
    params = [*pol.parameters(), *cri.parameters()]
    if bug != "ddp_sum":
        pol_m: nn.Module = nn.parallel.DistributedDataParallel(pol)
        cri_m: nn.Module = nn.parallel.DistributedDataParallel(cri)
    else:
        pol_m, cri_m = pol, cri
    opt = torch.optim.SGD(params, lr=0.1)
    rec = StepRecorder(hparams=HP, conventions=conv, reduce="sum" if bug == "ddp_sum" else "mean")
    for r, k, rows, width in micro_rows(bug)[rank]:
        ids = b.ids[torch.tensor(rows), : width + 1]
        lp, v = pol_m(ids), cri_m(ids)
        losses = micro_loss(rows, width, lp, v, b, q, conv, bug, (r, k))
        idx = torch.tensor(rows)
        sel = (idx, slice(0, width))
        rec.record(
            micro_batch=k, logprobs=lp, values=v, response_mask=b.mask[sel], old_logprobs=b.old_logprobs[sel],
            ref_logprobs=b.ref_logprobs[sel], old_values=b.old_values[sel], scores=b.scores[idx],
            advantages=q.advantages[sel], returns=q.returns[sel], **losses,
        )  # fmt: skip
        losses["loss"].backward()
    if bug == "ddp_sum":
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad)  # SUM: the ranks' gradients added, not averaged
    rec.write(path)
    opt.step()


def worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    policy, critic, b = setup()
    for name, agg, bug in CASES:
        step(rank, dist, policy, critic, b, agg, bug, Path(out) / f"{name}.safetensors")
    dist.barrier()
    dist.destroy_process_group()


def _finish(code: int) -> None:
    """As tests/train/test_ddp.py::_finish: no Python thread may be left; leave by ``os._exit``
    (DDP keeps gloo threads alive past ``destroy_process_group``)."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if code == 0 and others:
        print(f"threads still alive at exit: {others}", file=sys.stderr)
        code = 3
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
    except BaseException:
        traceback.print_exc()
        _finish(1)
    _finish(0)
