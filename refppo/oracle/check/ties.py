"""The clip fractions' rounding ties: where a trainer's rounding can put a token on either side of a
clip decision, so the reference's count (or gradient branch) is a tie, not a divergence.

    pg_tie_mask / pg_tie_share     ratio within ``rtol`` of ``1 ± ε`` (or the dual-clip ``c``), or
                                   ``A`` within ``rtol·max|A|`` of 0 (the ratio the policy stage
                                   clips: :func:`refppo.pipeline.update.clip_ratio`)
    vf_tie_mask / vf_tie_widen     ``|V − V_old|`` within ``rtol`` of ``ε_v``, or equal squared
                                   errors outside the range (``V^clip``:
                                   :func:`refppo.core.value.clipped_value`); for the count of
                                   ``value_clip_form=delta`` also the tokens inside the range whose
                                   two squares are equal to rounding (:func:`delta_rounding_ties`)
"""

from __future__ import annotations

import torch
from torch import Tensor

from refppo.conventions import ValueClipForm, parse
from refppo.core.by_rows import row_blocks
from refppo.core.checks import count_true
from refppo.core.value import clipped_value
from refppo.oracle.check.settings import Setup
from refppo.pipeline.blocks import update_rows
from refppo.pipeline.update import clip_ratio


def pg_tie_share(
    logprobs: Tensor, old: Tensor, adv: Tensor, mask: Tensor, setup: Setup, rtol: float
) -> Tensor:
    """Share of valid tokens of :func:`pg_tie_mask`."""
    near = pg_tie_mask(logprobs, old, adv, mask, setup, rtol)
    return count_true(near).to(logprobs.dtype) / count_true(mask).to(logprobs.dtype)  # no int64 mask copies


def pg_tie_mask(
    logprobs: Tensor, old: Tensor, adv: Tensor, mask: Tensor, setup: Setup, rtol: float
) -> Tensor:
    """Valid tokens (A ≠ 0) whose ratio lies within ``rtol`` of a clip boundary ``1 ± ε`` (or of
    the dual-clip constant ``c``), or whose advantage is within ``rtol·max|A|`` of 0.

    ``pg_clipfrac`` counts tokens where the clipped branch is *strictly* larger; on a boundary that
    decision is a tie that the trainer's rounding (its dtype) breaks either way, so the tolerance of
    ``pg_clipfrac`` is widened by this share.
    """
    zero = torch.zeros((), dtype=logprobs.dtype)
    ratio = clip_ratio(logprobs, old, mask, setup.conv)
    near = ((ratio - (1.0 - setup.hp.cliprange)).abs() <= rtol * ratio) | (
        (ratio - (1.0 + setup.hp.clip_high)).abs() <= rtol * ratio
    )
    if setup.conv.policy.dual_clip is not None:
        near |= (ratio - setup.conv.policy.dual_clip).abs() <= rtol * ratio
    a = torch.where(mask, adv, zero)
    tiny_adv = (a.abs() <= rtol * a.abs().max()) & (a != 0)  # the sign of A decides which branch is larger
    return (near | tiny_adv) & mask


def vf_tie_widen(
    values: Tensor,
    old: Tensor,
    returns: Tensor,
    mask: Tensor,
    eps_v: float,
    rtol: float,
    form: ValueClipForm | str = ValueClipForm.AROUND_OLD,
) -> float:
    """Share of value-mask tokens of :func:`vf_tie_mask` (and, for ``form=delta``, of
    :func:`delta_rounding_ties`). The mask is elementwise, so it is counted
    by blocks of about :data:`refppo.pipeline.blocks.ROW_BLOCK_ELEMENTS` rows (exact integer counts: the
    same share bit for bit, without the whole batch's ~12 ``[B, T]`` temporaries)."""
    delta = parse(ValueClipForm, form, what="value_clip_form") is ValueClipForm.DELTA
    B = mask.shape[0]
    step = update_rows(mask) or B
    n = 0
    for r in row_blocks(B, step):
        near = vf_tie_mask(values[r], old[r], returns[r], mask[r], eps_v, rtol)
        if delta:
            near |= delta_rounding_ties(values[r], old[r], returns[r], mask[r], eps_v)
        n += int(count_true(near))
    valid = count_true(mask)
    if int(valid) == 0:  # no value-mask token: nothing to widen (not 0/0)
        return 0.0
    total = torch.tensor(n, dtype=torch.int64)
    return float(total.to(values.dtype) / valid.to(values.dtype))


def vf_tie_mask(
    values: Tensor, old: Tensor, returns: Tensor, mask: Tensor, eps_v: float, rtol: float
) -> Tensor:
    """Extra tolerance of ``vf_clipfrac``: the value-mask tokens whose count is a real tie.

    ``vf_clipfrac`` counts ``(V_clip − R)² > (V − R)²`` strictly. Two kinds of token sit on that
    edge whatever the trainer's clip form: ``|V − V_old|`` within ``rtol`` of ``ε_v`` (on the clip
    boundary), and ``V`` outside the range with ``R`` at the midpoint of ``V`` and ``V_clip`` (equal
    squared errors). Tokens strictly *inside* the range are not widened for: there the two forms of
    the clipped value (``value_clip_form`` = ``around_old`` / ``delta``) may differ by one rounding
    step, and which one the trainer used is a convention, checked exactly, not a tolerance.
    """
    zero = torch.zeros((), dtype=values.dtype)
    v, vo, r = (torch.where(mask, x, zero) for x in (values, old, returns))
    dist = (v - vo).abs()
    boundary = (dist - eps_v).abs() <= rtol * (v.abs() + vo.abs() + eps_v)
    v_clip = clipped_value(v, vo, eps_v, ValueClipForm.AROUND_OLD)
    e1, e2 = (v - r) ** 2, (v_clip - r) ** 2
    midpoint = (dist > eps_v) & ((e2 - e1).abs() <= rtol * (e1 + e2))
    return (boundary | midpoint) & mask


def delta_rounding_ties(values: Tensor, old: Tensor, returns: Tensor, mask: Tensor, eps_v: float) -> Tensor:
    """Tokens inside the clip range whose ``value_clip_form=delta`` count is decided by rounding.

    Inside the range ``V^clip = V_old + (V − V_old)`` can land one rounding step ``u`` off ``V``;
    then ``(V^clip − R)² − (V − R)² ≈ ±2u·(V − R)`` exactly, often below one rounding step of the
    squares themselves, and the strict ``>`` of the count reads which way the two squares rounded:
    the last bit of ``R``. A trainer's ``R`` one rounding step off the reference's (its own GAE)
    then counts such a token the other way (AReaL 1.0.4 ``ppo_critic_loss_fn``, whose count is
    this very ``>``: ``tests/peers/test_peer_value_clip_ties.py``). Marked: the tokens inside the
    range with ``V^clip ≠ V`` and the two squares within ``2·eps·max`` of each other (``eps`` of
    the dtype). Tokens where the offset shows beyond rounding stay exact (the form is checked)."""
    zero = torch.zeros((), dtype=values.dtype)
    v, vo, r = (torch.where(mask, x, zero) for x in (values, old, returns))
    v_clip = clipped_value(v, vo, eps_v, ValueClipForm.DELTA)
    e1, e2 = (v - r) ** 2, (v_clip - r) ** 2
    inside = ((v - vo).abs() < eps_v) & (v_clip != v)
    close = (e2 - e1).abs() <= 2.0 * torch.finfo(values.dtype).eps * torch.maximum(e1, e2)
    return inside & close & mask


__all__ = ["delta_rounding_ties", "pg_tie_mask", "pg_tie_share", "vf_tie_mask", "vf_tie_widen"]
