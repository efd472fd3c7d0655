"""Re-scoring a dump's rows with the user's checkpoints through refppo's proven read-outs.

``refppo diff DUMP --actor DIR [--ref DIR] [--critic DIR] [--reward-model DIR]``: each model runs
ONE teacher-forced pass over the dump's ``input_ids`` / ``attention_mask`` (:mod:`refppo.models`,
equal to the per-prefix naive twins of :mod:`refppo.models.naive`) and its read-out is compared
with the dump:

=============  ======================================================  ===============================
role           refppo's read-out                                       dump key compared
=============  ======================================================  ===============================
actor          ``log softmax(logits/τ)[y_t]``, logits ``[P-1, P+T-1)``  ``old_logprobs`` (or ``logprobs``)
ref            the same, τ applied as well (TRL)                        ``ref_logprobs``
critic         ``V(x, y_<t)`` = per-position value at ``[P-1, P+T-1)``   ``old_values`` (or ``values``)
reward-model   the score head at each row's last real token             ``scores``
=============  ======================================================  ===============================

``τ`` is the sidecar's ``temperature`` (default 1). Log-probs and values are compared on the
valid response tokens, scores per row, with ``tol = atol + rtol·max|ref|`` at the lower precision
of the dump and the scoring dtype (:data:`refppo.dump.tolerances.TOLERANCES`). The run over the given
models is :func:`refppo.oracle.rescore.run.rescore_dump`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from refppo.core.logprobs import logprobs_from_logits
from refppo.dump.load import Dump
from refppo.dump.tolerances import TOLERANCES
from refppo.models.batch import SequenceBatch
from refppo.models.readout import response_slice, sequence_logits
from refppo.models.roles import last_valid_index
from refppo.oracle.check.compare import QuantityResult, compare
from refppo.oracle.rescore.engine_math import share_outside

ROLES: dict[str, tuple[str, ...]] = {
    "actor": ("old_logprobs", "logprobs"),
    "ref": ("ref_logprobs",),
    "critic": ("old_values", "values"),
    "reward-model": ("scores",),
}
"""Role -> the dump keys its re-score may be compared with (the first is the default)."""
LOGPROB_ROLES = ("actor", "ref")


@dataclass(frozen=True)
class Variant:
    """How one re-score is done: refppo's read-out (the defaults) or a hypothesis about the trainer's."""

    temperature: float
    offset: int = 0
    """Read-out slice ``[P-1+offset, P+T-1+offset)``: ±1 = labels / values one position off; for
    the reward model, the read position moved by ``offset`` (clamped to the sequence)."""
    position_ids: Tensor | None = None
    """None: refppo's ``clamp(cumsum(mask) − 1, 0)``."""
    read_at: Tensor | None = None
    """Reward model: the ``[B]`` positions read (None: each row's last real token)."""
    train: bool = False
    """Dropout on (train mode) while scoring."""


@dataclass
class Finding:
    """A named explanation and its re-check: the quantity recomputed under it, compared with the dump."""

    name: str
    text: str
    check: QuantityResult | None
    """None for a statistical finding (dropout), whose evidence is in ``text``."""


@dataclass
class RescoreItem:
    """One compared key: refppo's re-score against the dump, and what explains a difference."""

    role: str
    key: str
    result: QuantityResult
    precision: dict[str, dict[str, float]] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.result.ok


@dataclass
class Rescorer:
    """One role's model and the dump's rows: runs a :class:`Variant` through refppo's read-outs."""

    role: str
    model: nn.Module
    batch: SequenceBatch
    device: torch.device

    def run(self, v: Variant) -> Tensor:
        """The re-scored quantity: ``[B, T]`` log-probs / values, or ``[B]`` scores (float64, CPU)."""
        b = self.batch
        pos = b.position_ids if v.position_ids is None else v.position_ids.to(self.device)
        with torch.no_grad(), mode(self.model, train=v.train):
            if self.role in LOGPROB_ROLES:
                full = sequence_logits(self.model, b, pos)
                lg = response_slice(full, b.prompt_width, b.response_width, v.offset)
                lg = lg if lg.dtype in (torch.float32, torch.float64) else lg.float()
                out = logprobs_from_logits(lg, b.response_ids, b.response_mask, temperature=v.temperature)
            elif self.role == "critic":
                vals = self.model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=pos)
                out = response_slice(vals, b.prompt_width, b.response_width, v.offset)
            else:
                rm: Any = self.model  # a RewardModel: the score head at every position
                per_pos = rm.per_position(b.input_ids, b.attention_mask, pos)
                at = last_valid_index(b.attention_mask) if v.read_at is None else v.read_at.to(self.device)
                at = (at + v.offset).clamp(0, per_pos.shape[1] - 1)
                out = per_pos.gather(1, at.unsqueeze(1)).squeeze(1)
        return out.detach().to(device="cpu", dtype=torch.float64)

    def valid_logits(self, mask: Tensor, limit: int = 4096) -> tuple[Tensor, Tensor, Tensor]:
        """``(logits [1, N, V], tokens [1, N], flat index [N])`` at up to ``limit`` valid positions
        (evenly spaced over the row-major order), float64 on the CPU: the temperature solve's input,
        bounded in memory whatever B·T·V."""
        b = self.batch
        with torch.no_grad(), mode(self.model, train=False):
            lg = response_slice(sequence_logits(self.model, b), b.prompt_width, b.response_width)
        flat = mask.reshape(-1).nonzero().squeeze(1)
        if flat.numel() > limit:
            flat = flat[torch.linspace(0, flat.numel() - 1, limit).round().long()]
        V = lg.shape[-1]
        sel = lg.reshape(-1, V).index_select(0, flat.to(lg.device)).to("cpu", torch.float64)
        toks = b.response_ids.reshape(-1).index_select(0, flat.to(lg.device)).cpu()
        return sel.unsqueeze(0), toks.unsqueeze(0), flat

    def in_dtype(self, dtype: torch.dtype) -> Rescorer:
        """The same rows through a copy of the model cast to ``dtype`` (the precision report)."""
        return Rescorer(self.role, copy.deepcopy(self.model).to(dtype), self.batch, self.device)


@contextmanager
def mode(model: nn.Module, *, train: bool) -> Iterator[None]:
    """Train (dropout on) or eval mode for the block; every module's flag restored after."""
    saved = [m.training for m in model.modules()]
    try:
        model.train(train)
        yield
    finally:
        for m, flag in zip(model.modules(), saved, strict=True):
            m.training = flag


def temperature_of(dump: Dump) -> float:
    """The sidecar's ``temperature`` (validated by the loader), default 1."""
    return float(dump.hparams.get("temperature", 1.0))


def compare_mask(dump: Dump, role: str) -> Tensor | None:
    """Valid response tokens for ``[B, T]`` keys; None (every row) for the scores."""
    return None if role == "reward-model" else dump.mask


def tolerance_for(dump: Dump, scoring_dtype: torch.dtype) -> Any:
    """The lower precision of the dump and the scoring pass decides the tolerance."""
    order = {torch.float16: 0, torch.bfloat16: 0, torch.float32: 1, torch.float64: 2}
    low = min((dump.dtype, scoring_dtype), key=lambda d: order[d])
    return TOLERANCES[low]


def compare_rescore(name: str, dump_t: Tensor, ref: Tensor, cmp: Tensor | None, tol: Any) -> QuantityResult:
    """:func:`refppo.oracle.check.compare.compare`, for ``[B]`` scores row by row (a mask of all rows)."""
    d = dump_t.to(torch.float64)
    if cmp is None:
        cmp = torch.ones_like(d, dtype=torch.bool)
    return compare(name, d, ref, cmp, tol)


def precision_stats(dump_t: Tensor, ref: Tensor, mask: Tensor, eps: float) -> dict[str, float]:
    """Statistics of ``Δ = dump − re-score`` over the valid tokens, not a verdict: ``max|Δ|``,
    ``mean|Δ|`` and the share of tokens whose ratio ``exp(Δ)`` leaves ``[1−ε, 1+ε]``."""
    d = (dump_t.to(torch.float64) - ref.to(torch.float64))[mask]
    n = int(d.numel())
    return {
        "max_abs": float(d.abs().max()) if n else 0.0,
        "mean_abs": float(d.abs().mean()) if n else 0.0,
        "share_outside": share_outside(d, eps),
        "eps": eps,
        "tokens": float(n),
    }


def _learned_positions(model: nn.Module) -> tuple[str, int] | None:
    """``(module name, positions)`` of the model's learned absolute position embedding, if any:
    an ``nn.Embedding`` named ``wpe`` (GPT-2) or ``*position*`` (``embed_positions``,
    ``position_embeddings``); an OPT-style table shifted by ``offset`` holds ``n − offset``."""
    for name, mod in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(mod, nn.Embedding) and (last == "wpe" or "position" in last):
            return name, int(mod.num_embeddings) - int(getattr(mod, "offset", 0))
    return None


def fmt_stats(s: dict[str, float]) -> str:
    return (
        f"max|Δ|={s['max_abs']:.3g} mean|Δ|={s['mean_abs']:.3g} "
        f"share exp(Δ)∉[1±{s['eps']:g}]={s['share_outside']:.3g} over {int(s['tokens'])} tokens"
    )
