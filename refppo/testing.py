"""Assertions for a user's own CI: does my trainer's optimizer step match the reference?

.. code-block:: python

    # tests/test_ppo_step.py in YOUR repository
    from refppo.testing import assert_step_matches

    def test_one_step_matches_refppo(tmp_path):
        path = run_one_step_and_dump(tmp_path)            # your trainer writes a dump (spec/dump-format.md)
        assert_step_matches(path, preset="verl", kl_estimator="k3")

A failing check raises ``AssertionError`` whose message is the oracle's text report (the one
``refppo diff`` prints: every quantity, the first divergence and what explains it), so pytest shows
the diagnosis in its failure output. By default every output the dump's inputs allow must be in the
dump (``require=``): a gate never passes on what it did not compare.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from refppo.oracle.run import Outcome, check_step


def assert_step_matches(
    dump_or_tensors: str | Path | Mapping[str, Tensor],
    *,
    preset: str | None = None,
    hparams: Mapping[str, Any] | None = None,
    require: str | Sequence[str] = "all",
    **conventions: Any,
) -> Outcome:
    """Raise ``AssertionError`` (message: the oracle's text report) unless the step matches and
    every required output was compared.

    ``dump_or_tensors``: a dump file (its sidecar is found beside it; ``hparams`` is laid over
    that sidecar's keys) or a dict of tensors with the dump keys, whose sidecar is ``hparams``
    (hyperparameters, convention keys and the v2 step keys ``world_size``, ``micro_batches``,
    ``separate_critic``). ``conventions``: convention keys or hyperparameters as ``--set`` would
    give them (``kl_estimator="k3"``, ``loss_agg="seq-mean-token-mean"``).
    A step behind an inference engine: the dump (or dict) carries the three log-prob roles
    (``rollout_logprobs`` behaviour, ``old_logprobs`` proximal, ``logprobs`` current; the peers'
    names ``rollout_log_probs`` / ``sampling_per_token_logps`` are read as ``rollout_logprobs``),
    ``policy_version`` and the sampling keys in its sidecar; the correction is named like any
    convention (``rollout_is="token", rollout_is_mode="truncate", rollout_is_high=2.0``), and then a
    dump without ``rollout_logprobs`` raises one line naming it (``ref_logprobs`` likewise only where a
    KL term with β > 0 reads it).
    ``require``: the outputs that must be in the dump and compared: ``"all"`` (default) every
    output the dump's inputs allow except the logged metrics ``pg_clipfrac``, ``approx_kl``,
    ``vf_clipfrac`` (:mod:`refppo.oracle.coverage`); a sequence of output keys
    (``require=("pg_loss", "grad_logprobs")``) exactly those; ``require=()`` whatever the dump holds.
    Returns the outcome when the step passes. Bad input raises :class:`refppo.errors.RefPPOError`
    (not an assertion); so does a dump key that misspells an output (``pgloss``).
    """
    __tracebackhide__ = True  # pytest shows the report, not this function's frames
    req: str | tuple[str, ...] = require if isinstance(require, str) else tuple(require)
    outcome = check_step(
        dump_or_tensors, preset=preset, overrides=conventions, hparams=hparams or {}, require=req
    )
    if not outcome.passed:
        text = outcome.text()
        missing = outcome.missing_required
        if missing:
            text = (
                f"assert_step_matches: the required output(s) {', '.join(missing)} were not compared "
                f"(not in the dump); dump them, or pass require=(...) naming the outputs that must be "
                f"compared (require=() accepts whatever the dump holds)\n{text}"
            )
        raise AssertionError(text)
    return outcome


__all__ = ["assert_step_matches"]
