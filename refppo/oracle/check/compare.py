"""Per-quantity comparison and the shape of a difference (positions, factor, sign, offset).

A ``[B, T]`` quantity is compared on its compare mask only (valid tokens; for ``token_rewards`` and
``returns`` also the score slot). A difference confined to the other positions — padding — is a
note, never a failure. The error measures are

- ``max_abs_err`` = ``max |dump − ref|`` over the compared positions;
- ``max_rel_err`` = ``max_abs_err / max |ref|`` (relative to the quantity's scale, so values that
  cancel to ~0, like whitened advantages, do not blow it up); not a number (NaN, reported as
  ``ref = 0`` with the dump's ``max |x|``) where the reference is 0 at every compared position;
- ``tol`` = ``atol + rtol·max |ref|`` with ``(rtol, atol)`` chosen by the dump's dtype
  (:data:`refppo.dump.tolerances.TOLERANCES`); ``ok`` = ``max_abs_err <= tol``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from refppo.core.checks import count_true
from refppo.dump.residency import trim_heap
from refppo.dump.tolerances import Tolerance

_TINY = 1e-300
_AFTER_GAE = frozenset({"advantages", "returns"})
"""Quantities computed by GAE's backward recursion: an error at the end is carried back in them."""
_SCORED = frozenset({"token_rewards", "returns"})
"""Quantities that hold the score at its slot."""


@dataclass(frozen=True)
class QuantityResult:
    """The comparison of one quantity (the report's ``quantities[name]``)."""

    name: str
    max_abs_err: float
    max_rel_err: float
    tol: float
    ok: bool
    padding_diff: int = 0
    """Padded positions where the dump differs from the reference (not compared)."""
    ref_zero: bool = False
    """The reference is 0 at every compared position: ``max_rel_err`` is not a number then (NaN),
    the report says so (``ref = 0``) and gives ``dump_max_abs``."""
    dump_max_abs: float = 0.0
    """``max |dump|`` over the compared positions (= ``max_abs_err`` where the reference is 0)."""

    def as_json(self) -> dict[str, float | bool | str | None]:
        """The JSON entry: a value that is not a finite number is ``null`` (JSON has no NaN or
        Infinity) and ``note`` says what it is (a zero reference, a non-finite dump value)."""
        out: dict[str, float | bool | str | None] = {
            "max_abs_err": _finite_or_none(self.max_abs_err),
            "max_rel_err": _finite_or_none(self.max_rel_err),
            "tol": self.tol,
            "ok": self.ok,
        }
        if not math.isfinite(self.max_abs_err):
            out["note"] = "the dump holds a non-finite value at a compared position"
        elif self.ref_zero and self.max_abs_err > 0:
            out["note"] = (
                f"the reference is 0 at every compared position; the dump's max |x| = {self.dump_max_abs:.6g}"
            )
        return out


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def compare(
    name: str,
    dump: Tensor,
    ref: Tensor,
    cmp_mask: Tensor | None,
    tol: Tolerance,
    *,
    widen: float = 0.0,
) -> QuantityResult:
    """Compare ``dump`` with ``ref`` on ``cmp_mask`` (None: a scalar, compared whole).

    ``widen`` is added to the tolerance (clip fractions: the share of near-tie tokens).
    """
    if cmp_mask is None:
        max_abs = float((dump - ref).abs().max())
        scale = float(ref.abs().max())
        pad = 0
    else:
        scale = _masked_max_abs(ref, cmp_mask)
        max_abs, pad = _errors(dump, ref, cmp_mask, tol.of(scale))
    finite = math.isfinite(max_abs)
    if not finite:
        max_abs = math.inf
    t = tol.of(scale) + widen
    zero = scale == 0.0
    # relative to a zero scale it is not a number: NaN, reported as "ref = 0"
    undefined = zero or math.isnan(scale)
    max_rel = 0.0 if max_abs == 0 else (math.nan if undefined else max_abs / max(scale, _TINY))
    ok = finite and max_abs <= t
    return QuantityResult(name, max_abs, max_rel, t, ok, pad, zero, max_abs if zero else 0.0)


_CHUNK_ELEMENTS = 1 << 18
"""Elements of one row block of :func:`_row_blocks` (1 MiB of float32): a ``[B, T]`` comparison
allocates its temporaries per block, never at full size (a B=1024, T=8192 float32 dump: 33.5 MB
each); small blocks, because glibc keeps freed blocks of a few MiB resident in its heap."""


def _row_blocks(n_rows: int, row_len: int) -> list[slice]:
    """Row slices of about :data:`_CHUNK_ELEMENTS` elements (one slice for a small tensor)."""
    step = max(1, _CHUNK_ELEMENTS // max(row_len, 1))
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


def _masked_max_abs(ref: Tensor, cmp_mask: Tensor) -> float:
    """``max |ref|`` over ``cmp_mask`` (0 outside it; NaN when a compared value is NaN), by row blocks.

    Block by block it is the same maximum (a maximum does not depend on the order it is taken in).
    """
    zero = torch.zeros((), dtype=ref.dtype)
    scale = 0.0
    for rows in _row_blocks(ref.shape[0], ref[0].numel() if ref.dim() else 1):
        lo, hi = (float(x) for x in torch.aminmax(torch.where(cmp_mask[rows], ref[rows], zero)))
        if math.isnan(lo) or math.isnan(hi):
            return math.nan
        scale = max(scale, -lo, hi)
    return scale


def _errors(dump: Tensor, ref: Tensor, cmp_mask: Tensor, tol: float) -> tuple[float, int]:
    """``(max |dump − ref| over cmp_mask, padded positions where it exceeds tol)``, by row blocks.

    NaN propagates: a NaN at a compared position makes the maximum NaN, and a NaN outside counts as
    differing. Maxima and counts do not depend on the blocks, so the result is that of one pass.
    """
    max_abs, pad = 0.0, 0
    for rows in _row_blocks(ref.shape[0], ref[0].numel() if ref.dim() else 1):
        outside = ~cmp_mask[rows]
        diff = (dump[rows] - ref[rows]).abs_()
        differs = (diff <= tol).logical_not_()  # NaN differs
        differs &= outside
        pad += int(count_true(differs))
        m = float(diff.masked_fill_(outside, 0.0).max())
        if math.isnan(m):
            max_abs = math.nan
        elif not math.isnan(max_abs):
            max_abs = max(max_abs, m)
    return max_abs, pad


def describe(
    name: str, dump: Tensor, ref: Tensor, cmp_mask: Tensor | None, mask: Tensor, tol: float
) -> list[str]:
    """Plain-language notes on *how* ``dump`` differs from ``ref`` (for the first divergence)."""
    if cmp_mask is None:
        return _describe_scalar(name, float(dump), float(ref), tol)
    trim_heap()  # the stages before freed their blocks: not resident under this one's peak
    return _describe_tokens(name, dump, ref, cmp_mask, mask, tol)


FACTOR_HINT = " (a constant factor can point at the loss aggregation)"
"""The hint of a scalar's ratio line; dropped when a named bug explains every quantity."""


def _describe_scalar(name: str, d: float, r: float, tol: float) -> list[str]:
    notes: list[str] = []
    if not math.isfinite(d):
        return [f"{name}: the dump holds a non-finite value ({d})"]
    notes.append(f"{name}: dump {d:.9g} vs reference {r:.9g}")
    if abs(d + r) <= tol and abs(r) > tol:
        notes.append(f"{name}: a sign flip (dump = −reference)")
    elif abs(r) > tol and abs(d) > tol:
        notes.append(f"{name}: dump/reference = {d / r:.6g}{FACTOR_HINT}")
    elif abs(d) <= tol:
        notes.append(f"{name}: the dump is 0 where the reference is not")
    return notes


def _fit_factor(d: Tensor, r: Tensor) -> tuple[float, float]:
    """Least-squares ``d ≈ k·r``: ``(k, max residual)``. One temporary of ``d``'s size at a time
    (in-place steps: the same elementwise values, so the same sums)."""
    rr = float((r * r).sum())
    if rr == 0.0:
        return math.nan, math.inf
    k = float((d * r).sum()) / rr
    return k, _max_residual(d, k * r)


def _max_residual(d: Tensor, fit: Tensor) -> float:
    """``max |d − fit|``, computed in ``fit``'s buffer (which it overwrites)."""
    return float(torch.sub(d, fit, out=fit).abs_().max())


def _fit_affine(d: Tensor, r: Tensor) -> tuple[float, float, float]:
    """Least-squares ``d ≈ a·r + b``: ``(a, b, max residual)`` (at most two temporaries of ``d``'s
    size at a time, by in-place steps: the same elementwise values, so the same sums)."""
    n = d.numel()
    if n < 2:
        return math.nan, math.nan, math.inf
    rm, dm = r.mean(), d.mean()
    rc = r - rm
    var = float(rc.pow(2).sum())
    if var == 0.0:
        return math.nan, math.nan, math.inf
    a = float(rc.mul_(d - dm).sum()) / var
    del rc
    b = float(dm) - a * float(rm)
    return a, b, _max_residual(d, (a * r).add_(b))


def _last_true(m: Tensor) -> Tensor:
    """``[B]`` int64: each row's last True position of the bool ``[B, T]`` ``m``, -1 for none.

    ``(T−1) − argmax`` of the reversed row (argmax returns the first maximum) on a uint8 view:
    the value of ``where(m, arange(T), -1).amax(1)`` without its ``[B, T]`` int64 buffer.
    """
    flipped = m.flip(1).view(torch.uint8)
    return torch.where(flipped.amax(dim=1) > 0, (m.shape[1] - 1) - flipped.argmax(dim=1), -1)


def _select(x: Tensor, m: Tensor) -> Tensor:
    """``x[m]`` (row-major order) by row blocks: a bool index builds an int64 ``[N, 2]`` position
    list (four times the selected values' bytes for float32) before it gathers; here per block."""
    out = torch.empty(int(count_true(m)), dtype=x.dtype)
    at = 0
    for rows in _row_blocks(*m.shape):
        part = x[rows][m[rows]]
        out[at : at + part.numel()] = part
        at += part.numel()
    return out


def _one_per_row(idx: Tensor, T: int) -> Tensor:
    """Bool ``[B, T]``, True at ``[b, idx[b]]`` (none in a row whose ``idx`` is -1): ``arange(T) == idx``."""
    out = torch.zeros(idx.shape[0], T, dtype=torch.bool)
    return out.scatter_(1, idx.clamp(min=0).unsqueeze(1), (idx >= 0).unsqueeze(1))


def _bad_positions(
    dump: Tensor, ref: Tensor, cmp_mask: Tensor, tol: float, peaks: bool
) -> tuple[Tensor, Tensor | None]:
    """Bool ``[B, T]``: compared positions where ``|dump − ref| > tol`` (a non-finite dump value
    counts as differing), and (``peaks``) each row's position of its largest compared error
    (``argmax`` of the error, −1 outside ``cmp_mask``; the first maximum). By row blocks: no
    full-size float temporary; per-row results do not depend on the blocks."""
    B, T = cmp_mask.shape
    bad = torch.empty(B, T, dtype=torch.bool)
    peak = torch.empty(B, dtype=torch.int64) if peaks else None
    for rows in _row_blocks(B, T):
        cm = cmp_mask[rows]
        err = (dump[rows] - ref[rows]).abs_().masked_fill_(~cm, 0.0)
        err.masked_fill_(cm & ~torch.isfinite(dump[rows]), math.inf)
        b = (err <= tol).logical_not_()
        b &= cm
        bad[rows] = b
        if peak is not None:
            peak[rows] = torch.where(cm, err, torch.full((), -1.0, dtype=err.dtype)).argmax(dim=1)
    return bad, peak


def _offset_fits(dump: Tensor, ref: Tensor, cmp_mask: Tensor, shift: int, tol: float) -> bool | None:
    """``max |dump[t] − ref[t − shift]| <= tol`` over positions compared at both ``t`` and
    ``t − shift`` within a row (None when there are none), by row blocks (a maximum: exact)."""
    worst, any_pos = 0.0, False
    for rows in _row_blocks(*cmp_mask.shape):
        cm = cmp_mask[rows]
        both = cm & torch.roll(cm, shifts=shift, dims=1)
        if shift == 1:
            both[:, 0] = False
        else:
            both[:, -1] = False
        if not bool(both.any()):
            continue
        any_pos = True
        m = float((dump[rows] - torch.roll(ref[rows], shifts=shift, dims=1)).abs()[both].max())
        if not m <= tol:  # NaN too
            return False
        worst = max(worst, m)
    return None if not any_pos else worst <= tol


def _describe_tokens(
    name: str, dump: Tensor, ref: Tensor, cmp_mask: Tensor, mask: Tensor, tol: float
) -> list[str]:
    """Where ``dump`` differs (:func:`_where_notes`), then its form when one fits (:func:`_form_notes`)."""
    notes = _where_notes(name, dump, ref, cmp_mask, mask, tol)
    return notes + _form_notes(name, dump, ref, cmp_mask, tol) if notes else notes


def _where_notes(
    name: str, dump: Tensor, ref: Tensor, cmp_mask: Tensor, mask: Tensor, tol: float
) -> list[str]:
    """Which positions differ (only at row ends, at the score slot, everywhere, or how many), and
    for GAE's outputs whether each row's error peaks at its end; ``[]`` when none differs. Its
    ``[B, T]`` masks are freed on return, before the fits of :func:`_form_notes`."""
    notes: list[str] = []
    B, T = mask.shape
    bad, peak = _bad_positions(dump, ref, cmp_mask, tol, peaks=name in _AFTER_GAE)
    n_bad, n_cmp = int(count_true(bad)), int(count_true(cmp_mask))
    if n_bad == 0:
        return notes
    rows = bad.any(dim=1)
    n_rows = int(count_true(rows))
    last_valid, last_cmp = _last_true(mask), _last_true(cmp_mask)
    at_last, at_last_cmp = _one_per_row(last_valid, T), _one_per_row(last_cmp, T)
    only_ends = not bool((bad & ~(at_last | at_last_cmp)).any())
    where = f"{n_bad} of {n_cmp} compared positions, in {n_rows} of {B} rows"
    if not bool((bad & ~at_last).any()):
        notes.append(f"{name}: differs only at the last valid token of a row ({where})")
    elif not bool((bad & ~at_last_cmp).any()):
        notes.append(f"{name}: differs only at the score slot one past the last valid token ({where})")
    elif only_ends:
        hint = ": the score sits one slot away from where this convention puts it" if name in _SCORED else ""
        notes.append(
            f"{name}: differs only at the last valid token of a row and at the score slot one past it "
            f"({where}){hint}"
        )
    elif n_bad == n_cmp:
        notes.append(f"{name}: differs everywhere ({where})")
    else:
        notes.append(f"{name}: differs at {where}")
    # Where in each affected row is the error largest? (a terminal/bootstrap difference peaks at the
    # end). Only GAE's outputs carry an error back: for token_rewards or kl it would be a false lead.
    if n_rows > 0 and peak is not None and not only_ends:
        at_end = (peak == last_valid) | (peak == last_cmp)
        if bool(at_end[rows].all()) and n_bad > n_rows:
            notes.append(
                f"{name}: in every affected row the error peaks at the end of the sequence and shrinks "
                "toward its start (a difference in the terminal reward/bootstrap value, carried back by GAE)"
            )
    return notes


def _form_notes(name: str, dump: Tensor, ref: Tensor, cmp_mask: Tensor, tol: float) -> list[str]:
    """The first form that fits the compared values: non-finite, a sign flip, ``dump = k·ref``,
    ``dump = a·ref + b`` (least squares, residual within ``tol``), or an offset by one position."""
    notes: list[str] = []
    d, r = _select(dump, cmp_mask), _select(ref, cmp_mask)
    if not bool(torch.isfinite(d).all()):
        notes.append(f"{name}: the dump holds non-finite values at compared positions")
        return notes
    if float((d + r).abs_().max()) <= tol and float(r.abs().max()) > tol:
        notes.append(f"{name}: a sign flip (dump = −reference)")
        return notes
    k, res = _fit_factor(d, r)
    if math.isfinite(k) and res <= tol and abs(k - 1.0) > 1e-12:
        notes.append(f"{name}: a constant factor: dump = {k:.6g} × reference")
        return notes
    a, b, res_a = _fit_affine(d, r)
    if math.isfinite(a) and res_a <= tol:
        notes.append(
            f"{name}: an affine change: dump = {a:.6g} × reference + {b:.6g} (a whitening difference?)"
        )
        return notes
    del d, r
    for shift, label in ((1, "right"), (-1, "left")):
        if _offset_fits(dump, ref, cmp_mask, shift, tol):
            arrow = "ref[t−1]" if shift == 1 else "ref[t+1]"
            notes.append(f"{name}: offset by one position: dump[t] = {arrow} (shifted {label})")
            break
    return notes
