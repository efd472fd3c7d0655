"""Peers' tensor names accepted as aliases of the dump keys, and "did you mean" hints for the rest.

The verl and OpenRLHF names listed in spec/dump-format.md are read as the dump key they stand for;
each renaming is reported (never silent), and a dump holding two tensors for one quantity (a key
and its alias, or two aliases) is refused, naming both. Names whose meaning differs between a peer
and the format are *not* aliased: verl's ``values`` and OpenRLHF's ``experience.values`` are the
rollout-time values, which the format calls ``old_values`` (its ``values`` are the current critic's).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

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

    def norm(s: str) -> str:
        return s.lower().replace("_", "").replace("-", "").replace("/", "")

    choices = {norm(k): k for k in known}
    choices.update({norm(a): key for a, (key, _) in ALIASES.items()})
    hit = difflib.get_close_matches(norm(name), list(choices), n=1, cutoff=0.75)
    return choices[hit[0]] if hit else None


def alias_table() -> str:
    """``peer name -> dump key`` pairs on one line (for error messages)."""
    return ", ".join(f"{a}->{k}" for a, (k, _) in ALIASES.items())


__all__ = ["ALIASES", "alias_table", "resolve_aliases", "suggest"]
