"""``--detect`` walks the logged-only keys (issue #23 item 5): ``clipfrac_agg``, ``clipfrac_counts``
and, under ``kl_in=both``, the KL loss's own ``kl_loss_estimator`` and clamps.

Each dump is made by the pipeline (``refppo_dump``: :func:`refppo.pipeline.step`; the naive twins of
``naive_dump`` do not restate these keys) under a non-default member, and detected from a checked
setting with the default: every listed convention names the member the dump was made under (the
default is not listed). The walk must find the member among all the others; the peers' own dumps
(tests/peers) test the same walk on dumps made by their code. Without ``pg_clipfrac`` the
clip-fraction members cannot be told apart: they are listed as one class. Each test first asserts
that its member changes the dumped quantity (else the test could not fail).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from oracle_helpers import make_inputs, refppo_dump, save, setup_for

from refppo.dump.load import load_dump
from refppo.oracle.detect.detection import Detection, detect

LIMIT = 100_000
"""Conventions listed: all (a class spans thousands: the KL keys of both terms, the clamps, …)."""
HP = {"cliprange": 0.1}
"""A narrow clip range: several tokens clip on either side."""


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    x = make_inputs(B=8, T=12, seed=seed)
    return {k: v for k, v in x.items() if k not in ("old_values", "values")}  # critic-free: a short walk


def _detect(
    tmp: Path, x: dict[str, torch.Tensor], made: dict[str, Any], start: dict[str, Any], drop: str = ""
) -> tuple[Detection, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``--detect`` from ``start`` on the dump made under ``start | made`` (without ``drop``), and
    the dumps under ``start | made`` and under ``start``."""
    conv = {"advantage": "grpo"} | start
    x = {**x, "group_index": torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])}
    dump = refppo_dump(x, setup_for(None, conv | made, HP))
    plain = refppo_dump(x, setup_for(None, conv, HP))
    kept = {k: v for k, v in dump.items() if k != drop}
    path = save(tmp, kept, setup_for(None, conv, HP))
    found = detect(load_dump(path), setup_for(None, conv, HP), limit=LIMIT)
    assert found.n_detected <= LIMIT  # every detected convention listed
    return found, dump, plain


def _values(found: Detection, key: str) -> set[Any]:
    assert found.detected, (found.unmatched_stages, found.nearest)
    return {c.get(key) for c in found.detected}


def test_row_mean_clipfrac_is_detected(tmp_path: Path) -> None:
    """oat's mean of per-row means (``clipfrac_agg=row-mean``) is listed, the token mean is not."""
    found, dump, plain = _detect(tmp_path, _inputs(21), {"clipfrac_agg": "row-mean"}, {})
    assert float(dump["pg_clipfrac"]) != float(plain["pg_clipfrac"])
    assert _values(found, "clipfrac_agg") == {"row-mean"}
    assert _values(found, "clipfrac_counts") == {"all"}  # row-mean pairs with all only


def test_without_pg_clipfrac_the_clipfrac_members_are_one_class(tmp_path: Path) -> None:
    """Without ``pg_clipfrac`` the token mean and oat's row mean are one class; ``kept`` (no correction
    here) and ``by_advantage`` (vanilla) are the token mean by definition, so they are not listed as
    members (no dump could tell them apart)."""
    found, _, _ = _detect(tmp_path, _inputs(21), {"clipfrac_agg": "row-mean"}, {}, drop="pg_clipfrac")
    pairs = {(c["clipfrac_agg"], c["clipfrac_counts"]) for c in found.detected}
    assert pairs == {("token-mean", "all"), ("row-mean", "all")}
    assert "clipfrac_agg" in found.undetermined
    assert "clipfrac_counts" not in found.undetermined


def test_kept_clipfrac_counts_is_detected_under_a_correction(tmp_path: Path) -> None:
    """AReaL's count of the clipped tokens the correction keeps (``kept``) under a token mask."""
    x = _inputs(22)
    noise = 0.6 * torch.randn(x["old_logprobs"].shape, generator=torch.Generator().manual_seed(5))
    x["rollout_logprobs"] = x["old_logprobs"] - noise.double()
    start = {"rollout_is": "token", "rollout_is_mode": "mask", "rollout_is_low": 0.5, "rollout_is_high": 2.0}
    found, dump, plain = _detect(tmp_path, x, {"clipfrac_counts": "kept"}, start)
    assert float(dump["pg_clipfrac"]) != float(plain["pg_clipfrac"])
    assert _values(found, "clipfrac_counts") == {"kept"}


def test_by_advantage_clipfrac_counts_is_detected_under_cispo(tmp_path: Path) -> None:
    """TRL's CISPO clip ratio (``by_advantage``): only the side the advantage would clip."""
    start = {"policy_loss": "cispo"}
    found, dump, plain = _detect(tmp_path, _inputs(23), {"clipfrac_counts": "by_advantage"}, start)
    assert float(dump["pg_clipfrac"]) != float(plain["pg_clipfrac"])
    assert _values(found, "clipfrac_counts") == {"by_advantage"}


def test_the_kl_loss_own_estimator_is_detected_under_kl_in_both(tmp_path: Path) -> None:
    """verl's ``kl_loss_type=low_var_kl`` (``k3`` with its clamps) beside ``kl_penalty=kl`` (``k1``)
    in the reward: listed with ``k3`` and its own clamps (and the clamps that bind on no token, and
    its straight-through twin ``k3+``: the same value; the class here is over ``search.MAX_EQUIV``, so
    not every member is listed), the shared estimator (None) not."""
    own = {"kl_loss_estimator": "k3", "kl_loss_log_ratio_clamp": (-20.0, 20.0), "kl_loss_value_clamp": 10.0}
    found, dump, plain = _detect(tmp_path, _inputs(24), own, {"kl_in": "both"})
    assert float(dump["kl_loss"]) != float(plain["kl_loss"])
    assert "grad_logprobs" not in dump
    assert _values(found, "kl_loss_estimator") <= {"k3", "k3+"}
    made = [c for c in found.detected if c["kl_loss_estimator"] == "k3" and c["kl_loss_value_clamp"] == 10.0]
    assert [-20.0, 20.0] in [c["kl_loss_log_ratio_clamp"] for c in made]
    assert "kl_loss_value_clamp" in found.undetermined  # the clamps bind on no token here
