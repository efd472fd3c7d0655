"""How a stage of :mod:`refppo.pipeline.stages` is evaluated: :class:`Evaluation` (row blocks without
autograd, the global normalisers of a split step, the all-reduce of data-parallel ranks).

Neither changes a formula: the row blocks give the whole batch's values bit for bit
(:mod:`refppo.core.by_rows`, :func:`gae_by_rows`), the normalisers and the all-reduce make a
micro-batch's or a rank's terms the whole step's. :data:`ROW_BLOCK_ELEMENTS` is read at call time
(tests assign ``refppo.pipeline.blocks.ROW_BLOCK_ELEMENTS``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from refppo.conventions import GaeHoles, LossAgg
from refppo.core.aggregate import Prompts
from refppo.core.gae import gae
from refppo.core.masked import AllReduce
from refppo.errors import ConventionError

ROW_BLOCK_ELEMENTS = 1 << 18
"""Elements per row block of :func:`gae_by_rows` and of the update stages without autograd
(1 MiB of float32: GAE's scan and each loss hold about eight block-sized temporaries at once, and
glibc keeps freed blocks of this size in its heap, so smaller blocks leave less resident)."""


@dataclass(frozen=True)
class Normalisers:
    """Global normalisers when one optimizer step is split into micro-batches or ranks.

    ``token_count``/``seq_count`` are the valid-token and sequence counts of the WHOLE step
    (policy mask), ``value_token_count`` the valid-token count of the value mask. None: local.
    ``prompt_tokens``: ``((group_index id, N_p), ...)``, every prompt of the step with its valid-token
    count (policy mask), read by ``loss_agg=prompt-mean`` (:class:`refppo.core.aggregate.Prompts`).
    """

    token_count: float | None = None
    seq_count: float | None = None
    value_token_count: float | None = None
    prompt_tokens: tuple[tuple[int, float], ...] | None = None

    def prompts(self, agg: LossAgg, groups: Tensor | None, key: str = "loss_agg") -> Prompts | None:
        """The prompts ``agg`` reads: None unless ``prompt-mean``, which needs ``groups`` (refused in
        one line naming ``key`` and ``group_index`` without them)."""
        if agg is not LossAgg.PROMPT_MEAN:
            return None
        if groups is None:
            raise ConventionError(f"{key}=prompt-mean needs group_index [B] (the prompt each row answers)")
        return Prompts(groups, self.prompt_tokens)

    def kwargs(self, horizon: float | None, *, value: bool = False) -> dict[str, float]:
        """The normaliser keyword arguments of the policy terms (``value``: the value term's, whose
        ``token_count`` is ``value_token_count`` when given), ``horizon`` = ``hp.horizon``; None
        entries are left out (local counts, the padded length)."""
        out = {"token_count": self.token_count, "seq_count": self.seq_count, "horizon": horizon}
        if value and self.value_token_count is not None:
            out["token_count"] = self.value_token_count
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class Evaluation:
    """How the stages of one walk are evaluated (the same values whatever these are, where the
    stage allows them: :class:`refppo.pipeline.stages.Stage` ``by_rows``, ``normalisers``,
    ``collective``)."""

    rows: int | None = None
    """Rows per block for the stages that run by row blocks without autograd; None: the whole batch."""
    norm: Normalisers = Normalisers()
    """The step's global normalisers (micro-batches, ranks); the default: local counts."""
    all_reduce: AllReduce | None = None
    """A SUM all-reduce across data-parallel ranks (the whitening moments, batch statistics); None:
    one process. Every rank must walk a collective stage."""
    groups_on_rank: bool = False
    """With ``all_reduce``: the caller guarantees that every group's rows are on this rank, so the
    per-process group statistics are the global ones."""
    keep_ratio: bool = True
    """False: the policy stage by row blocks keeps no ``[B, T]`` ratio buffer (``ratio`` is then an
    empty tensor), for a caller that reads only ``ℓ``, the clip fractions and approx_kl."""


def gae_by_rows(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    gamma: float,
    lam: float,
    holes: GaeHoles | str,
    last_values: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`refppo.core.gae.gae` called on blocks of about :data:`ROW_BLOCK_ELEMENTS` rows'
    elements, written into ``[B, T]`` outputs: the same values bit for bit (GAE reads each row
    alone, with elementwise operations only: see ``_discounted_reverse_cumsum``), with the scan's
    temporaries (about seven ``[B, T]`` tensors) allocated per block. One call for a small batch.
    ``last_values`` ``[B]``: each row's ``V_{t_L}`` (truncated rows; None: 0).
    """
    B, T = mask.shape
    step = max(1, ROW_BLOCK_ELEMENTS // max(T, 1))
    if step >= B:
        return gae(rewards, values, mask, gamma=gamma, lam=lam, holes=holes, last_values=last_values)
    adv = torch.empty_like(rewards)
    ret = torch.empty_like(rewards)
    for i in range(0, B, step):
        rows = slice(i, min(i + step, B))
        boot = None if last_values is None else last_values[rows]
        adv[rows], ret[rows] = gae(
            rewards[rows], values[rows], mask[rows], gamma=gamma, lam=lam, holes=holes, last_values=boot
        )
    return adv, ret


def update_rows(mask: Tensor, *inputs: Tensor | None) -> int | None:
    """Rows per block of the update stages: about :data:`ROW_BLOCK_ELEMENTS` elements' worth
    when there is no autograd graph to build (grad mode off, or no input requires a gradient);
    None (the whole batch at once) under autograd or for a batch of at most
    :data:`ROW_BLOCK_ELEMENTS` elements."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
        return None
    B, T = mask.shape
    step = max(1, ROW_BLOCK_ELEMENTS // max(T, 1))
    return None if step >= B else step


__all__ = ["ROW_BLOCK_ELEMENTS", "Evaluation", "Normalisers", "gae_by_rows", "update_rows"]
