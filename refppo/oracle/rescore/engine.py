"""Engine versus trainer (issue #22 item 4): the dump's ``rollout_logprobs`` ``l^eng`` (what the
inference engine reported) against the trainer's own forward ``l^tr`` — refppo's re-score of the
``--actor`` at the sidecar's ``τ`` — with gate statistics, a verdict, and named hypotheses, each
re-enacted from the full logits ``z`` the re-score computes.

A re-enactment ``l^H`` *reproduces* the engine when ``max_valid |l^eng − l^H| ≤ tol`` (the
re-score's tolerance: the dump's and the scoring pass's lower precision). The hypotheses:

=================================  ===============================================================
``engine_temperature_not_applied``  ``log softmax(z)[y]`` while the sidecar's ``τ ≠ 1`` (TRL #4159)
``engine_support_renormalised``     ``l^tr − log S``, ``S`` the mass of the sidecar's top-p / top-k /
                                    min-p support (:func:`.engine_math.support_log_mass`)
``engine_temperature_other``        ``log softmax(z/τ̂)[y]``, ``τ̂`` solved (an engine ``τ`` the sidecar lacks)
``precision_logits_<d>``            ``log softmax(fl_d(z)/τ)[y]``: the logits rounded to ``d``
``precision_forward_<d>``           refppo's forward re-run with the actor cast to ``d``
=================================  ===============================================================

``d ∈ (float16, bfloat16)``. Verdict, in this order: ``match`` (``l^tr`` reproduces); ``explained``
(a temperature or support hypothesis reproduces: exit 1); ``precision`` (a precision one does, or
the *envelope* holds: exit 0); ``explained`` again for a temperature / support hypothesis that
reproduces up to the envelope (its residual in the envelope: a noisy engine with that bug; not
``τ̂``, a fitted value, which must reproduce exactly);
``disagree`` (exit 1, nothing named). The envelope of ``d``, for a residual ``e``:
``rms(e) ≤ F·rms(l^d − l^tr)`` and ``max|e| ≤ F·max|l^d − l^tr|`` over the valid tokens,
``F =`` :data:`PRECISION_FACTOR` — the engine no farther from the trainer than ``F`` times
refppo's own forward in ``d`` is (another engine's kernels round differently, not more).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from refppo.dump.load import Dump
from refppo.models.readout import response_slice, sequence_logits
from refppo.oracle.rescore.engine_math import gate_stats, rounded_logprobs, support_log_mass
from refppo.oracle.rescore.readouts import (
    Finding,
    RescoreItem,
    Rescorer,
    Variant,
    compare_rescore,
    mode,
    precision_stats,
)

ENGINE_KEY = "rollout_logprobs"
TRUST_DELTA = 0.2
"""The trust region of the gate statistics, ``r ∈ [1 − δ, 1 + δ]``: PPO's usual clip ε, so a token
outside it is one whose engine/trainer ratio alone leaves the clip's band."""
PRECISION_FACTOR = 2.0
"""``F`` of the envelope (module docstring)."""
PRECISION_DTYPES = (torch.float16, torch.bfloat16)
DTYPE_NAMES = ("float16", "bfloat16")
CHUNK = 1024
"""Valid positions per chunk when reading the full logits (bounds the sort's memory)."""


@dataclass
class EngineItem(RescoreItem):
    """``rollout_logprobs`` against the trainer's forward: ``result`` is the plain comparison,
    ``verdict`` decides :attr:`ok` (``match`` or ``precision``)."""

    verdict: str = "match"
    gates: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.verdict in ("match", "precision")


@dataclass
class Candidate:
    """One re-enactment: its name, its text, the log-probs ``[B, T]`` it predicts, and whether it
    is a precision (not a failure) or a bug."""

    name: str
    text: str
    lp: Tensor
    precision: bool = False


def sampling_filters(dump: Dump) -> dict[str, Any]:
    """The sidecar's filters that are on: ``top_p < 1``, ``top_k > 0``, ``min_p > 0``."""
    hp = dump.hparams
    on = {
        "top_p": float(hp.get("top_p", 1.0)),
        "top_k": int(hp.get("top_k", 0)),
        "min_p": float(hp.get("min_p", 0.0)),
    }
    return {k: v for k, v in on.items() if (v < 1 if k == "top_p" else v > 0)}


def read_positions(r: Rescorer, mask: Tensor, tau: float, filters: dict[str, Any]) -> dict[str, Tensor]:
    """One forward pass; at each valid position (chunks of :data:`CHUNK`), ``[B, T]`` float64:
    ``tau1`` = ``log softmax(z)[y]``; ``float16`` / ``bfloat16`` = :func:`rounded_logprobs`;
    ``log_mass`` (with filters) = ``log S``, ``+∞`` where ``y`` lies outside the support."""
    b = r.batch
    with torch.no_grad(), mode(r.model, train=False):
        lg = response_slice(sequence_logits(r.model, b), b.prompt_width, b.response_width)
        B, T, V = lg.shape
        flat = mask.reshape(-1).nonzero().squeeze(1)
        toks = b.response_ids.reshape(-1)
        names = ["tau1", *(_name(d) for d in PRECISION_DTYPES), *(["log_mass"] if filters else [])]
        out = {n: torch.zeros(B * T, dtype=torch.float64) for n in names}
        for idx in torch.split(flat, CHUNK):
            dev = idx.to(lg.device)
            z = lg.reshape(-1, V).index_select(0, dev).float()
            y = toks.index_select(0, dev)
            out["tau1"][idx] = z.double().log_softmax(-1).gather(-1, y.unsqueeze(1)).squeeze(1).cpu()
            for d in PRECISION_DTYPES:
                out[_name(d)][idx] = rounded_logprobs(z, y, tau, d).cpu()
            if filters:
                ls, keep = support_log_mass(z, temperature=tau, **filters)
                inside = keep.gather(-1, y.unsqueeze(1)).squeeze(1)
                out["log_mass"][idx] = torch.where(inside, ls, math.inf).cpu()
    return {n: v.reshape(B, T) for n, v in out.items()}


def _name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _rms(x: Tensor) -> float:
    return float((x**2).mean().sqrt()) if x.numel() else 0.0


def in_envelope(e: Tensor, mask: Tensor, envelope: dict[str, Tensor]) -> str | None:
    """The first ``d`` whose envelope holds the residual ``e`` (text with the numbers), else None."""
    m = mask.bool()
    ev = e[m]
    for name, env in envelope.items():
        nv = env[m]
        if ev.numel() == 0 or not bool(torch.isfinite(ev).all()):
            return None
        r_e, r_n = _rms(ev), _rms(nv)
        x_e, x_n = float(ev.abs().max()), float(nv.abs().max())
        if r_e <= PRECISION_FACTOR * r_n and x_e <= PRECISION_FACTOR * x_n:
            return (
                f"the {name} forward's envelope: rms {r_e:.3g} ≤ {PRECISION_FACTOR:g}·{r_n:.3g}, "
                f"max {x_e:.3g} ≤ {PRECISION_FACTOR:g}·{x_n:.3g}"
            )
    return None


def compare_engine(
    r: Rescorer, dump: Dump, ref: Tensor, tol: Any, tau: float, ratio_eps: float, *, diagnose: bool = True
) -> EngineItem:
    """``rollout_logprobs`` against ``ref`` (the actor's re-score at ``τ``): gate statistics,
    verdict and named hypotheses, in the order of the module docstring (``diagnose=False``: the
    plain comparison only, verdict ``match`` or ``disagree``)."""
    d, mask = dump.tensors[ENGINE_KEY].to(torch.float64), dump.mask
    item = EngineItem("engine", ENGINE_KEY, compare_rescore(ENGINE_KEY, d, ref, mask, tol))
    item.gates = gate_stats(d, ref, mask, TRUST_DELTA)
    item.precision = {"engine_vs_trainer": precision_stats(d, ref, mask, ratio_eps)}
    if dump.has("policy_version") and bool(
        (dump.tensors["policy_version"] != dump.tensors["policy_version"][0]).any()
    ):
        item.notes.append(
            "the rows were sampled by several policy versions (policy_version): the trainer's forward is "
            "one policy, so the gap includes the staleness"
        )
    item.verdict = "match" if item.result.ok else "disagree"
    if item.result.ok or not diagnose:
        return item
    filters = sampling_filters(dump)
    reads = read_positions(r, mask, tau, filters)
    runs = _forward_runs(r, tau, item.notes)
    envelope = {n: lp - ref for n, lp in runs.items()}
    for n, env in envelope.items():
        item.precision[f"{n}_forward_vs_trainer"] = precision_stats(ref + env, ref, mask, ratio_eps)
    bugs = _bug_candidates(item, dump, ref, reads, tau, filters)
    precs = [
        *(
            Candidate(f"precision_logits_{n}", f"the logits rounded to {n}", reads[n], True)
            for n in DTYPE_NAMES
        ),
        *(Candidate(f"precision_forward_{n}", f"the forward in {n}", lp, True) for n, lp in runs.items()),
    ]
    item.verdict = _decide(item, r, d, ref, mask, bugs, precs, envelope, tau)
    if item.verdict == "disagree" and not filters:
        item.notes.append("sampling support not tested: the sidecar has no top_p < 1, top_k > 0 or min_p > 0")
    if item.verdict == "disagree":
        item.notes.append(
            "the engine and the trainer disagree beyond what precision explains, and no named hypothesis "
            "(temperature, sampling support) reproduces the engine's log-probs"
        )
    return item


def _decide(
    item: EngineItem,
    r: Rescorer,
    d: Tensor,
    ref: Tensor,
    mask: Tensor,
    bugs: list[Candidate],
    precs: list[Candidate],
    envelope: dict[str, Tensor],
    tau: float,
) -> str:
    """Exact bugs, exact precisions, the solved τ̂, the envelope, bugs up to the envelope."""
    from refppo.dump.tolerances import Tolerance

    exact = Tolerance(rtol=0.0, atol=item.result.tol)
    for group, verdict in ((bugs, "explained"), (precs, "precision")):
        for c in group:
            res = compare_rescore(ENGINE_KEY, d, c.lp, mask, exact)
            if res.ok:
                item.findings.append(Finding(c.name, _text(c), res))
        if item.findings:
            if verdict == "precision":
                del item.findings[1:]  # the first (tightest) precision that reproduces the engine
            return verdict
    solved = _solved_temperature(item, r, d, mask, tau)
    if solved is not None:
        res = compare_rescore(ENGINE_KEY, d, solved.lp, mask, exact)
        if res.ok:
            item.findings.append(Finding(solved.name, solved.text, res))
            return "explained"
    why = in_envelope(d - ref, mask, envelope)
    if why is not None:
        text = f"within precision: {why}; not a failure"
        item.findings.append(Finding("precision_forward_envelope", text, None))
        return "precision"
    for c in bugs:
        why = in_envelope(d - c.lp, mask, envelope)
        if why is not None:
            item.findings.append(Finding(c.name, f"{c.text} (reproduced up to precision: {why})", None))
    return "explained" if item.findings else "disagree"


def _text(c: Candidate) -> str:
    return f"within precision: the engine's log-probs are {c.text}; not a failure" if c.precision else c.text


def _forward_runs(r: Rescorer, tau: float, notes: list[str]) -> dict[str, Tensor]:
    """``l^d`` for ``d`` in :data:`PRECISION_DTYPES`: the actor cast to ``d`` (a copy), re-scored;
    skipped when the scoring pass itself is not float32 / float64."""
    dtype = next(r.model.parameters()).dtype
    if dtype not in (torch.float32, torch.float64):
        notes.append(f"precision re-runs skipped: the re-score itself runs in {_name(dtype)}")
        return {}
    return {_name(d): r.in_dtype(d).run(Variant(tau)) for d in PRECISION_DTYPES}


def _bug_candidates(
    item: EngineItem, dump: Dump, ref: Tensor, reads: dict[str, Tensor], tau: float, filters: dict[str, Any]
) -> list[Candidate]:
    """Temperature not applied (sidecar ``τ ≠ 1``); the support (sidecar filters on)."""
    processed = dump.hparams.get("logprobs_processed")
    out = []
    if abs(tau - 1.0) > 1e-12:
        raw = " (as the sidecar's logprobs_processed=false says)" if processed is False else ""
        out.append(
            Candidate(
                "engine_temperature_not_applied",
                f"temperature not applied by the engine: the sidecar says τ={tau:g}, the engine's log-probs "
                f"are log softmax(z)[y] (τ=1), as vLLM's raw_logprobs are (TRL #4159){raw}",
                reads["tau1"],
            )
        )
    if not filters:
        return out
    m = dump.mask.bool()
    lm = reads["log_mass"][m]
    outside, s = int(torch.isinf(lm).sum()), lm[torch.isfinite(lm)].exp()
    what = ", ".join(f"{k}={v:g}" for k, v in filters.items())
    mass = f"S mean {float(s.mean()):.3g}, min {float(s.min()):.3g}" if s.numel() else "no token inside"
    said = " (as the sidecar's logprobs_processed=true says)" if processed is True else ""
    if outside:
        item.notes.append(f"sampling support ({what}): {outside} sampled tokens lie outside it")
    out.append(
        Candidate(
            "engine_support_renormalised",
            f"log-probs renormalised over the sampling support ({what}, τ={tau:g}): l_engine = l_trainer − "
            f"log S, S the kept support's probability mass ({mass}) (TRL #6789, #7269){said}",
            ref - reads["log_mass"],
        )
    )
    return out


def _solved_temperature(
    item: EngineItem, r: Rescorer, d: Tensor, mask: Tensor, tau: float
) -> Candidate | None:
    """``τ̂ = argmin_τ Σ (log softmax(z/τ)[y] − l^eng)²`` (the diagnosis's solve), as a candidate;
    None (with a note) when the solve runs to its bound or lands on the sidecar's ``τ``."""
    from refppo.oracle.rescore.diagnose import TAU_RANGE, solve_temperature

    lg, toks, flat = r.valid_logits(mask)
    target = d.reshape(-1)[flat].unsqueeze(0)
    t_hat = solve_temperature(lg, toks, torch.ones_like(toks, dtype=torch.bool), target)
    lo, hi = TAU_RANGE
    if min(abs(t_hat - lo) / lo, abs(t_hat - hi) / hi) <= 1e-6 or abs(t_hat - tau) <= 1e-4 * tau:
        item.notes.append(f"engine temperature solved from its log-probs: τ̂={t_hat:.6g}, no other τ fits")
        return None
    item.notes.append(f"engine temperature solved from its log-probs: τ̂={t_hat:.6g} (sidecar τ={tau:g})")
    return Candidate(
        "engine_temperature_other",
        f"the engine's log-probs are those of τ̂={t_hat:.6g}; the sidecar (and the trainer) say τ={tau:g}",
        r.run(Variant(t_hat)),
    )
