"""Model-level diagnosis of a re-score that disagrees with the dump.

Each hypothesis about the trainer's scoring pass is recomputed through the SAME read-outs as the
re-score (:class:`refppo.oracle.rescore.readouts.Rescorer`, i.e. :mod:`refppo.models`) with one thing
changed, and compared with the dump under the same tolerance; it is named only when that re-check
matches (``Finding.check.ok``). The hypotheses:

- temperature: not applied (τ=1), applied twice (τ²), another value τ̂ solved from the log-probs:
  ``τ̂ = argmin_τ Σ_valid (log softmax(z/τ)[y] − lp_dump)²`` over ``log τ`` (grid, then golden section);
- labels shifted by one: the logits slice ``[P-1±1, P+T-1±1)`` scores ``y_t``;
- position ids: the dump's own ``position_ids`` when it has them, else ``arange(S)`` (ignoring the
  left padding, the default of a forward pass given no position ids); skipped with a note when the
  model's learned position table cannot hold them;
- critic read one position off: the values slice shifted by ±1;
- reward read one position off, or at the last token whose id is not the pad id (pad/EOS confusion:
  transformers' ``*ForSequenceClassification`` pooling, which with pad = EOS skips the EOS);
- dropout left on: not reproducible token by token, so a statistical finding: two train-mode
  re-scores differ (the model has active dropout), and the dump's distance to the eval re-score
  is of the size of a train-mode re-score's distance to it (ratio within [1/3, 3]).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeAlias

import torch
from torch import Tensor

from refppo.core.logprobs import logprobs_from_logits
from refppo.dump.load import Dump
from refppo.errors import ShapeError
from refppo.models.batch import position_ids_from_mask
from refppo.oracle.rescore.readouts import (
    LOGPROB_ROLES,
    Finding,
    RescoreItem,
    Rescorer,
    Variant,
    _learned_positions,
    compare_mask,
    compare_rescore,
)

Check: TypeAlias = Callable[[str, str, Variant], bool]
"""Re-score under a variant; record the finding (name, text) when it matches the dump."""

DROPOUT_RATIO = 3.0
"""Dropout is named when rms(dump − eval) / rms(train − eval) lies in [1/3, 3]."""


def diagnose_item(item: RescoreItem, r: Rescorer, dump: Dump, ref: Tensor, tol: Any, tau: float) -> None:
    """Fill ``item.findings`` (re-checked explanations) and ``item.notes`` (what was tried)."""
    d = dump.tensors[item.key]
    cmp = compare_mask(dump, r.role)

    def check(name: str, text: str, v: Variant) -> bool:
        res = compare_rescore(item.key, d, r.run(v), cmp, tol)
        if res.ok:
            item.findings.append(Finding(name, text, res))
        return res.ok

    if r.role in LOGPROB_ROLES:
        _temperature(item, r, d, dump, tol, tau)
    for off in (1, -1):
        if item.findings:
            break
        try:
            check(*_offset_text(r.role, off), Variant(tau, offset=off))
        except ShapeError:  # a slice out of range (P = 1 for offset −1): hypothesis not testable
            item.notes.append(f"offset {off:+d} not testable with prompt width {r.batch.prompt_width}")
    if not item.findings and r.role == "reward-model":
        _reward_slots(item, r, tau, check)
    if not item.findings:
        _positions(item, r, dump, tau, check)
    if not item.findings:
        _dropout(item, r, d, ref, cmp, tau)
    if not item.findings:
        item.notes.append(
            "no single named explanation (temperature, off-by-one, position ids, read slot, dropout) "
            "reproduces the dump; see the precision statistics"
        )
    elif not any(f.name.startswith("temperature") for f in item.findings):
        # a named explanation that is not the temperature: the τ̂ solved before it is noise
        item.notes[:] = [n for n in item.notes if not n.startswith(TAU_NOTE)]


def _offset_text(role: str, off: int) -> tuple[str, str]:
    late = "late" if off > 0 else "early"
    if role in LOGPROB_ROLES:
        return (
            f"labels_shifted_{'+1' if off > 0 else '-1'}",
            f"labels shifted by one: the trainer scored y_t with the logits at position "
            f"{'P+t (which already saw y_t)' if off > 0 else 'P+t-2'} instead of P+t-1",
        )
    if role == "critic":
        return (
            f"critic_read_{late}",
            f"critic read one position {late}: V_t taken at P+t-1{off:+d} instead of P+t-1",
        )
    return (
        f"reward_read_{late}",
        f"reward read one position {late}: the score taken at last real token{off:+d}",
    )


def _temperature(item: RescoreItem, r: Rescorer, d: Tensor, dump: Dump, tol: Any, tau: float) -> None:
    """Named τ hypotheses first (1, τ²), then the solved τ̂; each re-checked through the read-out."""
    named = []
    if abs(tau - 1.0) > 1e-12:
        named.append(
            (
                "temperature_not_applied",
                f"temperature not applied: the sidecar says τ={tau:g}, the log-probs are those of τ=1",
                1.0,
            )
        )
        named.append(
            (
                "temperature_applied_twice",
                f"temperature applied twice: logits divided by τ²={tau * tau:g} (τ={tau:g})",
                tau * tau,
            )
        )
    for name, text, t in named:
        res = compare_rescore(item.key, d, r.run(Variant(t)), dump.mask, tol)
        if res.ok:
            item.findings.append(Finding(name, text, res))
            return
    lg, toks, flat = r.valid_logits(dump.mask)
    target = d.to(torch.float64).reshape(-1)[flat].unsqueeze(0)
    t_hat = solve_temperature(lg, toks, torch.ones_like(toks, dtype=torch.bool), target)
    lo, hi = TAU_RANGE
    if min(abs(t_hat - lo) / lo, abs(t_hat - hi) / hi) <= 1e-6:  # no interior optimum: nothing fits
        item.notes.append(
            f"{TAU_NOTE}: none in [{lo:g}, {hi:g}] fits them (the solve ran to its bound {t_hat:.6g}; "
            f"sidecar τ={tau:g})"
        )
        return
    item.notes.append(f"{TAU_NOTE}: τ̂={t_hat:.6g} (sidecar τ={tau:g})")
    if abs(t_hat - tau) <= 1e-4 * tau:
        return
    res = compare_rescore(item.key, d, r.run(Variant(t_hat)), dump.mask, tol)
    if res.ok:
        item.findings.append(
            Finding(
                "temperature_other_value",
                f"a different temperature: the log-probs are those of τ={t_hat:.6g}, "
                f"the sidecar says τ={tau:g}",
                res,
            )
        )


TAU_NOTE = "temperature solved from the log-probs"
TAU_RANGE = (0.02, 50.0)
"""The interval :func:`solve_temperature` searches."""


def solve_temperature(logits: Tensor, tokens: Tensor, mask: Tensor, target: Tensor) -> float:
    """``argmin_τ mean_valid (log softmax(z/τ)[y] − target)²`` over ``τ ∈ [0.02, 50]`` (:data:`TAU_RANGE`).

    A 1-D solve on ``u = log τ``: a grid of 121 points, then golden-section search on the
    bracket around the best grid point (60 steps: |Δu| < 1e-12). ``logits [B, T, V]`` float64.
    """

    def loss(u: float) -> float:
        lp = logprobs_from_logits(logits, tokens, mask, temperature=math.exp(u))
        return float(((lp - target)[mask] ** 2).mean())

    lo_u, hi_u, n = math.log(TAU_RANGE[0]), math.log(TAU_RANGE[1]), 121
    grid = [lo_u + (hi_u - lo_u) * i / (n - 1) for i in range(n)]
    vals = [loss(u) for u in grid]
    k = min(range(n), key=lambda i: vals[i])
    a, b = grid[max(k - 1, 0)], grid[min(k + 1, n - 1)]
    g = (math.sqrt(5) - 1) / 2
    c, e = b - g * (b - a), a + g * (b - a)
    fc, fe = loss(c), loss(e)
    for _ in range(60):
        if fc < fe:
            b, e, fe = e, c, fc
            c = b - g * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, e, fe
            e = a + g * (b - a)
            fe = loss(e)
    return math.exp((a + b) / 2)


def _positions(item: RescoreItem, r: Rescorer, dump: Dump, tau: float, check: Check) -> None:
    """The dump's position ids (if given and different from refppo's), else ``arange(S)``; a
    hypothesis whose positions a learned position table cannot hold is skipped with a note."""
    am = r.batch.attention_mask.cpu()
    ours = position_ids_from_mask(am)
    S = am.shape[1]
    arange = torch.arange(S).expand_as(am)
    real = am.bool()
    if dump.has("position_ids"):
        pos, what = dump.tensors["position_ids"], "the dump's position_ids"
        n_diff = int((pos != ours)[real].sum())
        if n_diff == 0:
            item.notes.append("the dump's position_ids equal clamp(cumsum(mask) − 1, 0) on every real token")
            return
        ignore = bool((pos == arange)[real].all())
        name = "position_ids_ignore_left_padding" if ignore else "position_ids_differ"
        text = (
            "position ids that ignore left padding: the trainer fed arange(P+T) (the dump's position_ids), "
            "so each row's first real token is not at position 0"
            if ignore
            else f"the trainer's position_ids (from the dump) differ from clamp(cumsum(mask) − 1, 0) "
            f"at {n_diff} real tokens"
        )
    elif bool((ours == arange)[real].all()):
        item.notes.append("no row is left-padded: position ids cannot tell arange from the mask's")
        return
    else:
        pos, what, name = arange, "arange(P+T)", "position_ids_ignore_left_padding"
        text = (
            "position ids that ignore left padding: the dump is reproduced with position_ids = arange(P+T) "
            "(a forward pass given no position_ids), not clamp(cumsum(mask) − 1, 0)"
        )
    table = _learned_positions(r.model)
    if table is not None and int(pos.max()) >= table[1]:
        item.notes.append(
            f"position hypothesis {what} not testable: positions up to {int(pos.max())}, the model's "
            f"learned position table ({table[0]}) has {table[1]}"
        )
        return
    check(name, text, Variant(tau, position_ids=pos))


def _reward_slots(item: RescoreItem, r: Rescorer, tau: float, check: Check) -> None:
    """Read the score at the last token whose id is not the pad id (transformers' pooling), with
    the model's ``pad_token_id`` and with its ``eos_token_id`` (pad/EOS confusion)."""
    from refppo.models.roles import last_valid_index

    ids, am = r.batch.input_ids.cpu(), r.batch.attention_mask.cpu()
    ours = last_valid_index(am)
    S = ids.shape[1]
    pos = torch.arange(S).expand_as(ids)
    model: Any = r.model  # RewardModel: the transformers model (and its config) is ``.model``
    cfg = model.model.config
    tried = set()
    for what, pid in (
        ("pad", getattr(cfg, "pad_token_id", None)),
        ("eos", getattr(cfg, "eos_token_id", None)),
    ):
        if not isinstance(pid, int) or pid in tried:
            continue
        tried.add(pid)
        at = torch.where(ids != pid, pos, torch.full_like(pos, -1)).amax(dim=1).clamp(min=0)
        if bool((at == ours).all()):
            continue
        n = int((at != ours).sum())
        check(
            "reward_pad_eos_confusion",
            f"pad/EOS confusion at the score slot: the score was read at each row's last token whose id is "
            f"not {pid} (the model's {what} id; transformers' pooling), not at the last real token "
            f"({n} of {len(at)} rows differ)",
            Variant(tau, read_at=at),
        )
        if item.findings:
            return


def _dropout(item: RescoreItem, r: Rescorer, d: Tensor, ref: Tensor, cmp: Tensor | None, tau: float) -> None:
    """Two train-mode re-scores: their spread says whether dropout is active; the dump's distance
    to the eval re-score is compared with a train-mode re-score's distance to it."""
    m = torch.ones_like(ref, dtype=torch.bool) if cmp is None else cmp
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        a = r.run(Variant(tau, train=True))
        b = r.run(Variant(tau, train=True))

    def rms(x: Tensor) -> float:
        return float((x[m] ** 2).mean().sqrt())

    spread, dist_train, dist_dump = rms(a - b), rms(a - ref), rms(d.to(torch.float64) - ref)
    if spread == 0.0:
        item.notes.append("dropout: two train-mode re-scores are identical (the model has no active dropout)")
        return
    ratio = dist_dump / dist_train
    stats = (
        f"rms(dump − eval re-score)={dist_dump:.3g}, rms(train-mode re-score − eval)={dist_train:.3g} "
        f"(ratio {ratio:.3g}), spread of two train-mode re-scores {spread:.3g}"
    )
    if 1 / DROPOUT_RATIO <= ratio <= DROPOUT_RATIO:
        item.findings.append(
            Finding(
                "dropout_active",
                f"dropout active while scoring: {stats}; no eval-mode variant reproduces the dump",
                None,
            )
        )
    else:
        item.notes.append(f"dropout: not of the right size: {stats}")
