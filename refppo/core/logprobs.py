"""Per-token log-probabilities and entropy from response-aligned logits.

``logits[b, t]`` ``[V]`` are the scores the model gave *for* response token ``y_t`` (i.e. read at
the position before it; see :mod:`refppo.models` for that alignment). With temperature ``τ``:

    z = logits / τ
    log π(y_t) = z[y_t] − logsumexp(z)
    H_t        = logsumexp(z) − Σ_v softmax(z)_v · z_v      ( = −Σ_v p_v log p_v )

The temperature is applied *before* the log-softmax, for the old, reference and current
log-probs alike, matching the sampler (verl ``dp_actor._forward_micro_batch`` ``logits.div_(T)``;
OpenRLHF ``models/actor.py`` divides by ``rollout.temperature``; TRL divides by ``T + 1e-7``).
Outputs are 0 at padded positions; token ids there may be junk (even out of range).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from refppo.core import _pyfloat as pf
from refppo.errors import ShapeError
from refppo.types import Logits, ResponseMask, TokenFloat, TokenIds
from refppo.validate import check_logits, check_mask, check_positive


def _prepare(
    logits: Tensor, tokens: Tensor, mask: ResponseMask | None, temperature: float
) -> tuple[Tensor, Tensor, Tensor]:
    lg, ids = check_logits("logits", logits, tokens)
    check_positive("temperature", temperature)
    B, T, V = lg.shape
    if mask is None:
        m = torch.ones(B, T, dtype=torch.bool, device=lg.device)
    else:
        m = check_mask("mask", mask, require_nonempty_rows=False)
        if m.shape != (B, T):
            raise ShapeError(f"mask: expected shape [B, T] = [{B}, {T}] (batch, resp), got {list(m.shape)}")
    bad = m & ((ids < 0) | (ids >= V))
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ShapeError(f"tokens: id {int(ids[b, t])} at valid position [{b}, {t}] is outside [0, V={V})")
    safe_ids = torch.where(m, ids, torch.zeros((), dtype=ids.dtype, device=ids.device))
    z = lg / temperature if temperature != 1.0 else lg
    return z, safe_ids, m


def logprobs_from_logits(
    logits: Logits, tokens: TokenIds, mask: ResponseMask | None = None, *, temperature: float = 1.0
) -> TokenFloat:
    """``log softmax(logits/τ)[y_t]`` per position, ``[B, T]``; 0 where ``mask`` is 0."""
    z, ids, m = _prepare(logits, tokens, mask, temperature)
    picked = torch.gather(z, -1, ids.long().unsqueeze(-1)).squeeze(-1)
    logp = picked - torch.logsumexp(z, dim=-1)
    return torch.where(m, logp, torch.zeros((), dtype=logp.dtype, device=logp.device))


def entropy_from_logits(
    logits: Logits, mask: ResponseMask | None = None, *, temperature: float = 1.0
) -> TokenFloat:
    """Entropy of ``softmax(logits/τ)`` per position, ``[B, T]``; 0 where ``mask`` is 0."""
    dummy = (
        torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device) if logits.dim() == 3 else logits
    )
    z, _, m = _prepare(logits, dummy, mask, temperature)
    p = torch.softmax(z, dim=-1)
    ent = torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)
    return torch.where(m, ent, torch.zeros((), dtype=ent.dtype, device=ent.device))


# ----------------------------------------------------------------------------------------------
# Naive twins: one sequence, one position, one vocabulary entry at a time.
# ----------------------------------------------------------------------------------------------


def _log_sum_exp(zs: list[float]) -> float:
    top = max(zs)
    return top + math.log(sum(math.exp(z - top) for z in zs))


def logprobs_from_logits_naive(
    logits: Logits, tokens: TokenIds, mask: ResponseMask | None = None, *, temperature: float = 1.0
) -> TokenFloat:
    """Naive twin of :func:`logprobs_from_logits`."""
    B, T, _ = logits.shape
    lg = logits.detach().to(torch.float64).cpu().tolist()
    ids = tokens.cpu().tolist()
    ms = pf.mask_rows(mask) if mask is not None else [[True] * T for _ in range(B)]
    out = []
    for b in range(B):
        row = []
        for t in range(T):
            if not ms[b][t]:
                row.append(0.0)
                continue
            z = [v / temperature for v in lg[b][t]]
            row.append(z[ids[b][t]] - _log_sum_exp(z))
        out.append(row)
    return pf.tensor_like(out, logits)


def entropy_from_logits_naive(
    logits: Logits, mask: ResponseMask | None = None, *, temperature: float = 1.0
) -> TokenFloat:
    """Naive twin of :func:`entropy_from_logits`: ``−Σ_v p_v log p_v``."""
    B, T, _ = logits.shape
    lg = logits.detach().to(torch.float64).cpu().tolist()
    ms = pf.mask_rows(mask) if mask is not None else [[True] * T for _ in range(B)]
    out = []
    for b in range(B):
        row = []
        for t in range(T):
            if not ms[b][t]:
                row.append(0.0)
                continue
            z = [v / temperature for v in lg[b][t]]
            lse = _log_sum_exp(z)
            h = 0.0
            for zv in z:
                logp = zv - lse
                h -= math.exp(logp) * logp
            row.append(h)
        out.append(row)
    return pf.tensor_like(out, logits)
