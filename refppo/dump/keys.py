"""The dump's key schema: the known keys by kind (inputs, outputs, gradients, integers, sequences,
sidecar keys that are no PPO settings) and what each output needs; the peers' tensor names accepted
as aliases of the dump keys, and "did you mean" hints for the rest (spec/dump-format.md).

The verl and OpenRLHF names listed in spec/dump-format.md are read as the dump key they stand for;
each renaming is reported (never silent), and a dump holding two tensors for one quantity (a key
and its alias, or two aliases) is refused, naming both. Names whose meaning differs between a peer
and the format are *not* aliased: verl's ``values`` and OpenRLHF's ``experience.values`` are the
rollout-time values, which the format calls ``old_values`` (its ``values`` are the current critic's).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

REQUIRED_INPUTS: tuple[str, ...] = ("response_mask", "old_logprobs", "scores")
"""Read under every convention (the loader refuses a dump without one of them)."""
CRITIC_INPUTS: tuple[str, ...] = ("old_values",)
"""Required unless the checked convention's estimator needs no critic (``advantage`` ≠ ``gae``):
checked by :func:`check_inputs_for` once the convention is known."""
UPDATE_INPUTS: tuple[str, ...] = ("logprobs", "values", "entropy")
OPTIONAL_INPUTS: tuple[str, ...] = ("ref_logprobs", "rollout_logprobs", "bootstrap_values")
"""Inputs read only under some conventions (:func:`refppo.pipeline.reads.required_inputs`, checked by
:func:`refppo.dump.required.check_inputs_for` once the setting is known): ``ref_logprobs`` [B, T], the
reference policy's log-probs, read where a KL term with β > 0 is (``kl_in=reward``: the reward's
−β·KL; ``kl_in=loss``: the KL loss); ``rollout_logprobs`` [B, T], the behaviour log-probs (what the
inference engine reported for the sampled tokens), read by the rollout correction (``rollout_is``
on); ``bootstrap_values`` [B], the critic's value of the state after each row's last token, read by
GAE on the truncated rows under ``gae_bootstrap=truncated`` (finite on every row: 0 where it is not
read). Finite at valid positions."""
ROW_FLOAT_KEYS: tuple[str, ...] = ("scores", "bootstrap_values")
"""[B] floats: each row's score and its bootstrap value."""
TOKEN_OUTPUTS: tuple[str, ...] = ("kl", "token_rewards", "advantages", "returns")
SCALAR_OUTPUTS: tuple[str, ...] = (
    "pg_loss",
    "pg_clipfrac",
    "approx_kl",
    "vf_loss",
    "vf_clipfrac",
    "entropy_loss",
    "kl_loss",
    "loss",
)
TOKEN_KEYS: tuple[str, ...] = (
    "response_mask",
    "old_logprobs",
    "ref_logprobs",
    "old_values",
    "logprobs",
    "values",
    "entropy",
    "rollout_logprobs",
    *TOKEN_OUTPUTS,
)
GRAD_KEYS: tuple[str, ...] = ("grad_logprobs", "grad_values")
"""v2: ∂J/∂``logprobs`` and ∂J/∂``values`` of the whole optimizer step, [B, T] (spec/dump-format.md)."""
INTEGER_KEYS: set[str] = {
    "micro_batch", "rank", "group_index", "policy_version", "input_ids", "attention_mask", "position_ids",
    "truncated",
}  # fmt: skip
"""Keys whose tensors hold integers (kept as int64, never cast to the compute dtype)."""
ROW_INTEGER_KEYS: tuple[str, ...] = ("micro_batch", "rank", "group_index", "policy_version", "truncated")
"""[B] integers: v2's micro-batch (per rank) and data-parallel rank of each row; ``group_index``, the
prompt each row answers (critic-free group estimators, issue #13); ``policy_version``, the policy
update that sampled each row (an asynchronous trainer's staleness: the current version minus it);
``truncated``, 1 on the rows cut at the generation limit (no EOS), 0 on the rest (bool accepted),
read with ``bootstrap_values`` under ``gae_bootstrap=truncated``."""
SEQUENCE_KEYS: tuple[str, ...] = ("input_ids", "attention_mask", "position_ids")
"""The ``[B, P+T]`` sequences for re-scoring (validated by :mod:`refppo.dump.sequences`)."""
SIDECAR_SCORING_KEYS: frozenset[str] = frozenset({"temperature"})
"""Sidecar keys of the scoring pass (not PPO settings): read by the re-scoring, not by ``Setup``."""
SIDECAR_SAMPLING_KEYS: frozenset[str] = frozenset({"top_p", "top_k", "min_p", "logprobs_processed"})
"""Sidecar keys of the engine's sampling (with ``temperature``): ``top_p`` in (0, 1], ``top_k`` an
integer ≥ 0 (0 or -1: off, vLLM's spelling), ``min_p`` in [0, 1], ``logprobs_processed`` a bool
(``rollout_logprobs`` are of the processed distribution, after temperature and the filters, not of
the raw logits). Validated by the loader, read by no PPO stage."""


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_SAMPLING_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (lambda v: _is_num(v) and v > 0, "a finite number > 0"),
    "top_p": (lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= -1, "an integer >= -1"),
    "min_p": (lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "logprobs_processed": (lambda v: isinstance(v, bool), "true or false"),
}


def sampling_problem(side: Mapping[str, Any]) -> str | None:
    """One line naming the first sampling key of the sidecar ``side`` (``temperature`` and
    :data:`SIDECAR_SAMPLING_KEYS`) out of its range, else None."""
    for key, (ok, what) in _SAMPLING_RANGES.items():
        if key in side and not ok(side[key]):
            return f"{key}: expected {what}, got {side[key]!r}"
    return None


STEP_KEYS: tuple[str, ...] = ("world_size", "micro_batches", "separate_critic", "loss_scale")
"""v2 sidecar keys describing the optimizer step (read here, not by the settings); ``loss_scale``: the
AMP loss scale a ``StepRecorder`` divided out of the gradients (a record: nothing rescales by it)."""
KNOWN_KEYS: frozenset[str] = frozenset(
    (*TOKEN_KEYS, *ROW_FLOAT_KEYS, *SCALAR_OUTPUTS, *GRAD_KEYS, *INTEGER_KEYS)
)
NEEDS_UPDATE: dict[str, tuple[str, ...]] = {
    "pg_loss": ("logprobs",),
    "pg_clipfrac": ("logprobs",),
    "approx_kl": ("logprobs",),
    "vf_loss": ("values",),
    "vf_clipfrac": ("values",),
    "entropy_loss": ("entropy",),
    "kl_loss": ("logprobs",),
    "loss": ("logprobs", "values"),
    "grad_logprobs": ("logprobs",),
    "grad_values": ("values",),
}
"""The update-step inputs each update-stage output is computed from (``loss``: ``logprobs`` alone
without a critic)."""
NEEDS_CRITIC: tuple[str, ...] = ("values", "vf_loss", "vf_clipfrac")
"""Keys that make no sense without ``old_values`` (the value loss is clipped around them)."""


ALIASES: dict[str, tuple[str, str]] = {
    # verl 0.9.1: DataProto batch keys and the actor/critic metrics (spec/dump-format.md, "verl")
    "old_log_probs": ("old_logprobs", "verl"),
    "ref_log_prob": ("ref_logprobs", "verl"),
    "token_level_rewards": ("token_rewards", "verl"),
    "entropys": ("entropy", "verl"),
    "vpreds": ("values", "verl"),
    "actor/pg_loss": ("pg_loss", "verl"),
    "actor/pg_clipfrac": ("pg_clipfrac", "verl"),
    "actor/ppo_kl": ("approx_kl", "verl"),
    "critic/vf_loss": ("vf_loss", "verl"),
    "critic/vf_clipfrac": ("vf_clipfrac", "verl"),
    # OpenRLHF 0.11.2: Experience fields and PolicyLoss outputs (spec/dump-format.md, "OpenRLHF")
    "action_mask": ("response_mask", "OpenRLHF"),
    "action_log_probs": ("old_logprobs", "OpenRLHF"),
    "base_action_log_probs": ("ref_logprobs", "OpenRLHF"),
    "clip_ratio": ("pg_clipfrac", "OpenRLHF"),
    "ppo_kl": ("approx_kl", "OpenRLHF"),
    # the behaviour log-probs: verl 0.9.1 DataProto ``rollout_log_probs``
    # (trainer/ppo/rollout_corr_helper.py), OpenRLHF 0.11.2 ``Experience.rollout_log_probs``
    # (trainer/ppo_utils/experience.py), TRL 1.16.0 GRPOTrainer ``sampling_per_token_logps``
    # (_generate_and_score_completions' output); SkyRL-train 0.3.1 calls it ``rollout_logprobs``
    "rollout_log_probs": ("rollout_logprobs", "verl/OpenRLHF"),
    "sampling_per_token_logps": ("rollout_logprobs", "TRL"),
}
"""``peer name -> (dump key, peer)``."""


def resolve_aliases(path: Path, raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``raw`` with every alias renamed to its dump key, and ``{alias: dump key}`` of the renamings.

    Raises ValueError (one line, naming both keys) when a key and an alias, or two aliases, name the
    same quantity; the loader turns it into a ``DumpError``.
    """
    claimed: dict[str, str] = {k: k for k in raw if k not in ALIASES}
    renamed: dict[str, str] = {}
    for name in sorted(k for k in raw if k in ALIASES):
        key, peer = ALIASES[name]
        if key in claimed:
            other = claimed[key]
            what = f"{other!r}" if other == key else f"{other!r} ({ALIASES[other][1]} name of {key})"
            raise ValueError(
                f"{path}: keys {what} and {name!r} ({peer} name of {key}) both give {key}; keep one of them"
            )
        claimed[key] = name
        renamed[name] = key
    out = {renamed.get(k, k): v for k, v in raw.items()}
    return out, renamed


def suggest(name: str, known: frozenset[str]) -> str | None:
    """The dump key ``name`` most likely misspells (case and ``_``/``-``/``/`` ignored), or None."""

    choices = {_norm(k): k for k in known}
    choices.update({_norm(a): key for a, (key, _) in ALIASES.items()})
    hit = difflib.get_close_matches(_norm(name), list(choices), n=1, cutoff=0.75)
    return choices[hit[0]] if hit else None


def _norm(s: str) -> str:
    return s.lower().replace("_", "").replace("-", "").replace("/", "")


def _one_edit(a: str, b: str) -> bool:
    """``a`` and ``b`` differ by at most one insertion, deletion, substitution or swap of neighbours."""
    if a == b:
        return True
    if abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        if len(diff) == 1:
            return True
        i = diff[0]
        return len(diff) == 2 and diff[1] == i + 1 and a[i] == b[i + 1] and a[i + 1] == b[i]
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


def misspelt(name: str, known: frozenset[str]) -> tuple[str, str] | None:
    """``(dump key, the spelling name is close to)`` when the unknown ``name`` evidently misspells a
    dump key or a peer alias of one: the same letters once case and ``_``/``-``/``/`` are ignored
    (``grad_log_probs``, ``gradvalues``, ``PgLoss``), or one edit away from them (an insertion,
    deletion, substitution or swap; names of 4+ letters: ``advantage``, ``old_value``); else None.

    Looser resemblances (:func:`suggest`: ``token_level_scores`` ~ ``token_rewards``, a distinct
    verl tensor) are hints, never errors: a dump may carry tensors of its own.
    """
    if name in known or name in ALIASES:
        return None
    n = _norm(name)
    spellings = [(k, k) for k in sorted(known)] + [(a, key) for a, (key, _) in ALIASES.items()]
    for strict in (True, False):
        for spelt, key in spellings:
            m = _norm(spelt)
            if m == n if strict else (len(n) >= 4 and _one_edit(n, m)):
                return key, spelt
    return None


def misspelt_error(where: str, names: list[str], known: frozenset[str]) -> str | None:
    """One line naming every key of ``names`` that :func:`misspelt` flags, with its "did you mean"
    (``where``: the file or call the keys came from), or None when there is none."""
    hits = [(k, got) for k in sorted(names) if (got := misspelt(k, known)) is not None]
    if not hits:
        return None
    parts = [
        f"{k!r} (did you mean {key}?" + ("" if spelt == key else f" {spelt!r} is a peer's name for it") + ")"
        for k, (key, spelt) in hits
    ]
    what = "key" if len(hits) == 1 else "keys"
    return (
        f"{where}: unknown tensor {what} {', '.join(parts)}: a misspelt output would not be compared; "
        "rename it (spec/dump-format.md lists the keys)"
    )


def alias_table() -> str:
    """``peer name -> dump key`` pairs on one line (for error messages)."""
    return ", ".join(f"{a}->{k}" for a, (k, _) in ALIASES.items())


__all__ = [
    "ALIASES",
    "alias_table",
    "misspelt",
    "misspelt_error",
    "resolve_aliases",
    "sampling_problem",
    "suggest",
]
