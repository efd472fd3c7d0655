"""``truncated_rows`` in ``--detect``: the update steps on the rows in the loss (issue #23 item 5).

Under ``mask_in_loss`` a row flagged ``truncated`` [B] adds nothing to any token sum or token count
of the loss terms and 1 to the row count ``N_seq = B``; under ``drop`` nothing to ``N_seq`` either
(:class:`refppo.agg_conventions.TruncatedRows`; TRL 1.16.0 ``mask_truncated_completions``,
``trl/trainer/grpo_trainer.py::GRPOTrainer._generate_and_score_completions``). The pipeline walks
the update stages on the rows in the loss with the whole batch's normalisers
(:mod:`refppo.pipeline.row_subset`: ``token_count`` = their tokens, ``seq_count`` = ``B`` under
``mask_in_loss``, their rows under ``drop``); the rollout stages see every row.

The walk does the same (:func:`walk_rows`): the steps up to the whitening see every row; then, on a
dump whose ``truncated`` flags some rows (not all), the update steps (correction, policy, value,
loss) run once on every row (``keep``) and once per other member on a search cut to the rows in the
loss (:func:`in_loss_search`: ``s.t``, ``s.m`` and the states' ``[B, T]`` tensors on those rows, the
evaluation's ``seq_count`` the whole batch's under ``mask_in_loss``, its checked setting the
member's), each listed entry naming its member. The stage functions are the pipeline's; only the
rows and normalisers they are evaluated on change. A member is not walked when the dump's gradients
are nonzero on a row out of the loss (the pipeline's are 0 there:
:func:`refppo.pipeline.step.update_grads`). Elsewhere (no ``truncated``, no row flagged, or every
row) every member is the same function of the dump (or none applies): ``keep`` alone is walked, and
the others are not listed. The notes and fitted lines kept are those of the members that reproduce
the dump (``keep``'s when none does): a member the dump rules out explains nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from refppo.agg_conventions import TruncatedRows
from refppo.oracle.check.settings import Setup
from refppo.oracle.detect.groups import Group
from refppo.oracle.detect.search import Search
from refppo.oracle.detect.states import AdvState, Carried, digest
from refppo.pipeline.blocks import Evaluation, Normalisers, update_rows
from refppo.pipeline.row_subset import take_rows

KEY = "truncated_rows"

Walk = Callable[[Search, list[Group[Any]]], list[Group[Any]]]


def loss_rows(s: Search) -> Tensor | None:
    """``[B]`` bool, True on the rows in the loss under ``mask_in_loss``/``drop``; None when the dump
    holds no ``truncated`` flags, flags no row, or flags every row (no member then differs, or none
    but ``keep`` applies)."""
    flags = s.t.get("truncated")
    if not isinstance(flags, Tensor) or flags.shape != (s.m.shape[0],):
        return None
    keep = flags == 0
    if bool(keep.all()) or not bool(keep.any()):
        return None
    return keep


def in_loss_search(s: Search, rows: Tensor, mode: TruncatedRows) -> Search:
    """A copy of ``s`` on the rows ``rows`` with the normalisers of ``mode`` (module docstring). Its
    notes, proposals and walk log are ``s``'s own lists; its unmatched steps its own."""
    sub = copy.copy(s)
    sub.t = take_rows(dict(s.t.items()), rows)
    sub.m = s.m[rows]
    seq = float(s.m.shape[0]) if mode is TruncatedRows.MASK_IN_LOSS else None
    sub.ev = Evaluation(rows=update_rows(sub.m), keep_ratio=False, norm=Normalisers(seq_count=seq))
    B = sub.m.shape[0]
    k = min(8, B // 4)
    sub.screen_rows = torch.unique(torch.linspace(0, B - 1, k).round().long()) if k > 0 else None
    sub.unmatched = list(s.unmatched)
    sub.base = _with_mode(s, mode)  # its rows all in the loss: the pipeline keeps them (row_subset)
    sub._settings, sub._vms, sub._counts, sub._dump_scale = {}, {}, {}, {}
    return sub


def _with_mode(s: Search, mode: TruncatedRows) -> Setup:
    return replace(s.base, conv=s.base.conv.with_updates({KEY: mode.value}))


def _grads_zero_out(s: Search, rows: Tensor) -> bool:
    """Whether the dump's gradients are 0 on every row out of the loss (what the pipeline gives)."""
    for name in ("grad_logprobs", "grad_values"):
        d = s.t.get(name)
        if isinstance(d, Tensor) and bool((d[~rows] != 0).any()):
            return False
    return True


def _cut(st: AdvState, rows: Tensor) -> AdvState:
    ca = st.carried
    vm, ret = ca.vm[rows], ca.returns[rows]
    cut = Carried(ca.kl_key, ca.kl_setting, ca.kl_in, vm, ret, digest(ret, vm))
    w = None if st.is_weights is None else st.is_weights[rows]
    adv = st.adv[rows]
    return replace(st, carried=cut, adv_raw=None, adv=adv, adv_key=digest(adv), is_weights=w)


def _tag(groups: list[Group[Any]], mode: TruncatedRows) -> list[Group[Any]]:
    for g in groups:
        g.convs = [{**c, KEY: mode.value} for c in g.convs]
    return groups


def walk_rows(s: Search, groups: list[Group[AdvState]], walk: Walk) -> list[Group[Any]]:
    """``walk`` (the update steps) on ``groups`` under each member of ``truncated_rows`` that differs
    on this dump (module docstring): ``keep`` on every row first, then each other member on the
    rows in the loss; their groups in that order."""
    rows = loss_rows(s)
    modes = [] if rows is None else [m for m in TruncatedRows if m is not TruncatedRows.KEEP]
    if rows is not None and not _grads_zero_out(s, rows):
        modes = []
    cut = [] if rows is None or not modes else [_cut(g.state, rows) for g in groups]
    counts = [(list(g.convs), g.n_equiv, g.worst, list(g.unmatched), list(g.marks)) for g in groups]
    tag = s.base.conv.agg.truncated_rows is not TruncatedRows.KEEP or bool(modes)
    if s.base.conv.agg.truncated_rows is not TruncatedRows.KEEP:  # the walk on every row is keep's
        s.base = _with_mode(s, TruncatedRows.KEEP)
        s._settings = {}
    lines = _Lines(s)
    out = walk(s, groups)
    if tag:
        out = _tag(out, TruncatedRows.KEEP)
    lines.branch(out)
    for mode in modes:
        assert rows is not None
        sub = in_loss_search(s, rows, mode)
        held = [Group(c, n, st, w, u, None, mk) for (c, n, w, u, mk), st in zip(counts, cut, strict=True)]
        got = _tag(walk(sub, held), mode)
        lines.branch(got)
        out += got
    lines.keep()
    return out


class _Lines:
    """The notes and fitted lines each member's walk adds to the search's lists: kept for the members
    some group of which reproduces the dump (``keep``'s when none does), so that a member the dump
    rules out explains nothing."""

    def __init__(self, s: Search) -> None:
        self.s = s
        self.start = (len(s.notes), len(s.fitted))
        self.added: list[tuple[list[str], list[str], bool]] = []

    def branch(self, groups: list[Group[Any]]) -> None:
        n, f = self.start
        s = self.s
        ok = any(not g.unmatched and g.worst == 0.0 for g in groups)
        self.added.append((s.notes[n:], s.fitted[f:], ok))
        del s.notes[n:], s.fitted[f:]

    def keep(self) -> None:
        if len(self.added) == 1:  # keep alone: its lines as it made them
            self.s.notes += self.added[0][0]
            self.s.fitted += self.added[0][1]
            return
        kept = [a for a in self.added if a[2]] or self.added[:1]
        for notes, fitted, _ in kept:
            self.s.notes += [x for x in notes if x not in self.s.notes]
            self.s.fitted += [x for x in fitted if x not in self.s.fitted]


__all__ = ["in_loss_search", "loss_rows", "walk_rows"]
