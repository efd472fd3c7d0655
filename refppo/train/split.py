"""The split optimizer step of :func:`refppo.train.update.ppo_update`: the update's masks, the step's
global normalisers and the running sums of its micro-batches.

One optimizer step (a minibatch of ``mb_size`` rows per rank) is split into micro-batches and ranks;
each piece's loss is its rows' share of the whole step's loss when every aggregation divides by
counts of the WHOLE step (:class:`refppo.pipeline.blocks.Normalisers`), counted here before
micro-batching from the masks the update stages read, and summed over ranks by the one all-reduce
of counts::

    counts = [N_tok, N_seq, N_vtok, N_p for every prompt id]      (this rank's rows, then SUM over ranks)
    N_tok  = Σ_{b∈step,t} m'_bt       N_vtok = Σ_{b∈step,t} vm'_bt
    N_seq  = #{b ∈ step : Σ_t m'_bt > 0}
    N_p    = Σ_{b∈step, g_b = p, t} m'_bt      (only under ``prompt-mean``; the table holds N_p > 0)

``m'``, ``vm'`` ``[B, T]`` (:func:`update_masks`): the masks after the update's first stage — under
``rollout_rs_effect=drop_mask`` the rejection gate's kept tokens (verl 0.9.1: they replace the
response and value masks; a row it empties leaves every count, :mod:`refppo.pipeline.row_subset`),
made by the stage table's ``rollout_gate`` stage (the gate is per row, so a micro-batch's gate is
its rows of the whole step's); otherwise the sampled mask and the rollout's value mask (every row
then has a token and ``N_seq`` = the step's rows). ``prompt-mean`` (SkyRL 0.4.0 ``prompt_mean``)
reads ``N_p`` of each row's prompt and ``P`` = the table's length (:class:`refppo.core.aggregate.
Prompts`), counted in a dense vector by prompt id: under DDP every rank's has ``world_size · B_rank``
entries (the trainer's ids, :func:`refppo.train.group.expand_groups`, are ``rank·P_r + i``, below it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from refppo.capture.recorder import StepRecorder
from refppo.conventions import LossAgg
from refppo.core.masked import AllReduce
from refppo.errors import ShapeError
from refppo.models.rollout import ScoredRollout
from refppo.pipeline.blocks import Normalisers
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.stages import BY_NAME
from refppo.pipeline.step import RolloutQuantities, UpdateQuantities
from refppo.train.update_config import Behaviour

LOSS_KEYS = ("loss", "pg_loss", "vf_loss", "entropy", "kl_loss", "ptx_loss")
"""The minibatch sums of the losses (``entropy`` is ``UpdateQuantities.entropy_loss``)."""


def update_masks(
    scored: ScoredRollout,
    quantities: RolloutQuantities,
    behaviour: Behaviour | None,
    *,
    hp: Hyperparams,
    conv: Convention,
) -> tuple[Tensor, Tensor]:
    """``(m', vm')`` bool ``[B, T]``: the masks the update stages after the rollout correction read
    (module docstring), from the stage table's ``rollout_gate`` stage (identity unless
    ``rollout_rs_effect=drop_mask``)."""
    mask, vmask = scored.batch.response_mask, quantities.value_mask
    if not conv.gate.drops:
        return mask, vmask
    q = {
        "old_logprobs": scored.old_logprobs,
        "rollout_logprobs": None if behaviour is None else behaviour.rollout_logprobs,
        "mask": mask,
        "value_mask": vmask,
    }
    out = BY_NAME["rollout_gate"].run(q, conv, hp)
    return out["mask"], out["value_mask"]


def _prompt_mean(conv: Convention) -> bool:
    return LossAgg.PROMPT_MEAN in (conv.agg.of("policy"), conv.agg.of("entropy"))


def step_normalisers(
    mask: Tensor,
    vmask: Tensor,
    rows: Tensor,
    group_index: Tensor | None,
    conv: Convention,
    all_reduce: AllReduce | None,
    world_size: int,
) -> Normalisers:
    """The step's global normalisers over ``rows`` ``[mb_size]`` of the update masks ``mask``/``vmask``
    (:func:`update_masks`), all-reduced under DDP (module docstring); ``prompt_tokens`` only under
    ``prompt-mean`` (which needs ``group_index`` ``[B]``)."""
    m, vm = mask[rows], vmask[rows]
    head = [float(m.sum()), float(m.any(dim=1).sum()), float(vm.sum())]
    counts = torch.tensor(head, dtype=torch.float64, device=mask.device)
    prompts = _prompt_mean(conv)
    if prompts:
        if group_index is None:
            raise ShapeError("loss_agg=prompt-mean needs group_index [B] (the prompt each row answers)")
        g = group_index.to(device=mask.device, dtype=torch.int64)[rows]
        # every rank's vector has one length: the trainer's ids lie below world_size · rows per rank
        n_ids = world_size * int(mask.shape[0]) if all_reduce is not None else int(g.max()) + 1
        if bool((g < 0).any()) or bool((g >= n_ids).any()):
            raise ShapeError(
                f"group_index: prompt ids must lie in [0, {n_ids}) (world_size · rows per rank under DDP)"
            )
        per = torch.zeros(n_ids, dtype=torch.float64, device=mask.device)
        counts = torch.cat([counts, per.index_add(0, g, m.sum(dim=1).to(torch.float64))])
    if all_reduce is not None:
        counts = all_reduce(counts)
    table = None
    if prompts:
        table = tuple((i, float(n)) for i, n in enumerate(counts[3:].tolist()) if n > 0)
    return Normalisers(
        token_count=float(counts[0]),
        seq_count=float(counts[1]),
        value_token_count=float(counts[2]),
        prompt_tokens=table,
    )


@dataclass
class Sums:
    """One minibatch's running sums over its micro-batches (Python floats, in micro-batch order):
    the losses, the token-weighted clip fractions and approx-KL, the max |ratio − 1|, the log-probs."""

    st: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOSS_KEYS, 0.0))
    clip_w: float = 0.0
    akl_w: float = 0.0
    vclip_w: float = 0.0
    ratio_dev: float = 0.0
    lp_parts: list[Tensor] = field(default_factory=list)

    def add(self, uq: UpdateQuantities | None, logp: Tensor, m: Tensor, vm: Tensor) -> None:
        """Add micro-batch ``uq`` (its update masks ``m``, ``vm`` ``[b, T]``: the statistics are token
        means over them); None: a micro-batch the gate emptied (nothing but its log-probs)."""
        self.lp_parts.append(logp.detach())
        if uq is None:
            return
        self.st["loss"] += float(uq.loss.detach())
        self.st["pg_loss"] += float(uq.pg_loss.detach())
        self.st["vf_loss"] += float(uq.vf_loss.detach())
        self.st["entropy"] += float(uq.entropy_loss.detach())
        assert uq.kl_loss is not None  # the trainer always holds ref_logprobs
        self.st["kl_loss"] += float(uq.kl_loss.detach())
        n_m = float(m.sum())
        self.clip_w += float(uq.pg_clipfrac) * n_m
        self.akl_w += float(uq.approx_kl) * n_m
        self.vclip_w += float(uq.vf_clipfrac) * float(vm.sum())
        dev = torch.where(m, (uq.ratio.detach() - 1.0).abs(), torch.zeros_like(logp))
        self.ratio_dev = max(self.ratio_dev, float(dev.max()))

    def stats(self, n_tok: float, n_vtok: float) -> dict[str, float]:
        """The minibatch scalars: loss sums, then the clip fractions and approx-KL as token means
        over ``n_tok`` (policy) / ``n_vtok`` (value) valid tokens of this rank (0 over none: a rank
        whose rows the gate emptied), then the ratio."""
        st = dict(self.st)
        st["pg_clipfrac"] = self.clip_w / n_tok if n_tok > 0 else 0.0
        st["approx_kl"] = self.akl_w / n_tok if n_tok > 0 else 0.0
        st["vf_clipfrac"] = self.vclip_w / n_vtok if n_vtok > 0 else 0.0
        st["ratio_max_dev"] = self.ratio_dev
        return st


def record_micro(
    rec: StepRecorder,
    k: int,
    logp: Tensor,
    values: Tensor | None,
    entropy: Tensor,
    idx: Tensor,
    scored: ScoredRollout,
    q: RolloutQuantities,
    uq: UpdateQuantities | None,
    world_size: int,
    group_index: Tensor | None,
    behaviour: Behaviour | None = None,
) -> None:
    """Record micro-batch ``k`` (rows ``idx``); the losses as passed to backward (× world_size; 0 for
    a micro-batch the gate emptied, ``uq`` None); a critic-free step (``values`` None) carries no value
    quantity (``old_values``, ``values``, ``grad_values``, ``vf_loss``: the oracle's critic-free dump)."""
    more: dict[str, Tensor] = {"group_index": group_index[idx]} if group_index is not None else {}
    more.update(behaviour.select(idx) if behaviour is not None else {})  # the seam mode's roles
    if values is not None:
        more["old_values"] = scored.old_values[idx]
    names = [
        n
        for n in ("loss", "pg_loss", "vf_loss", "entropy_loss", "kl_loss")
        if n != "vf_loss" or values is not None
    ]
    for n in names:
        more[n] = logp.new_zeros(()) if uq is None else getattr(uq, n) * world_size
    rec.record(
        micro_batch=k,
        logprobs=logp,
        values=values,
        response_mask=scored.batch.response_mask[idx],
        old_logprobs=scored.old_logprobs[idx],
        ref_logprobs=scored.ref_logprobs[idx],
        scores=scored.scores[idx],
        entropy=entropy,
        advantages=q.advantages[idx],
        returns=q.returns[idx],
        **more,
    )


__all__ = ["LOSS_KEYS", "Sums", "record_micro", "step_normalisers", "update_masks"]
