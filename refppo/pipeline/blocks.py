"""The row blocks of the pipeline (split out of ``refppo/pipeline.py``, which re-exports them):
:data:`ROW_BLOCK_ELEMENTS`, GAE by blocks of rows (:func:`gae_by_rows`, step 3) and the block size
of :func:`refppo.pipeline.update.update_quantities` without autograd (:func:`update_rows`, steps 5–9).

Both read :data:`ROW_BLOCK_ELEMENTS` of this module at call time; assigning
``refppo.pipeline.blocks.ROW_BLOCK_ELEMENTS`` assigns it here too (:mod:`refppo.split_module`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from refppo.conventions import GaeHoles
from refppo.core.gae import gae

ROW_BLOCK_ELEMENTS = 1 << 18
"""Elements per row block of :func:`gae_by_rows` and of :func:`update_quantities` without autograd
(1 MiB of float32: GAE's scan and each loss hold about eight block-sized temporaries at once, and
glibc keeps freed blocks of this size in its heap, so smaller blocks leave less resident)."""


def gae_by_rows(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float, holes: GaeHoles | str
) -> tuple[Tensor, Tensor]:
    """:func:`refppo.core.gae.gae` called on blocks of about :data:`ROW_BLOCK_ELEMENTS` rows'
    elements, written into ``[B, T]`` outputs: the same values bit for bit (GAE reads each row
    alone, with elementwise operations only: see ``_discounted_reverse_cumsum``), with the scan's
    temporaries (about seven ``[B, T]`` tensors) allocated per block. One call for a small batch.
    """
    B, T = mask.shape
    step = max(1, ROW_BLOCK_ELEMENTS // max(T, 1))
    if step >= B:
        return gae(rewards, values, mask, gamma=gamma, lam=lam, holes=holes)
    adv = torch.empty_like(rewards)
    ret = torch.empty_like(rewards)
    for i in range(0, B, step):
        rows = slice(i, min(i + step, B))
        adv[rows], ret[rows] = gae(rewards[rows], values[rows], mask[rows], gamma=gamma, lam=lam, holes=holes)
    return adv, ret


def update_rows(mask: Tensor, *inputs: Tensor | None) -> int | None:
    """Rows per block of :func:`update_quantities`: about :data:`ROW_BLOCK_ELEMENTS` elements' worth
    when there is no autograd graph to build (grad mode off, or no input requires a gradient);
    None (the whole batch at once) under autograd or for a batch of at most
    :data:`ROW_BLOCK_ELEMENTS` elements."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
        return None
    B, T = mask.shape
    step = max(1, ROW_BLOCK_ELEMENTS // max(T, 1))
    return None if step >= B else step
