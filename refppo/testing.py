"""Assertions for a user's own CI: does my trainer's optimizer step match the reference?

.. code-block:: python

    # tests/test_ppo_step.py in YOUR repository
    from refppo.testing import assert_step_matches

    def test_one_step_matches_refppo(tmp_path):
        path = run_one_step_and_dump(tmp_path)            # your trainer writes a dump (spec/dump-format.md)
        assert_step_matches(path, preset="verl", kl_estimator="k3")

A failing check raises ``AssertionError`` whose message is the oracle's text report (the one
``refppo diff`` prints: every quantity, the first divergence and what explains it), so pytest shows
the diagnosis in its failure output.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from refppo.oracle.run import Outcome, check_step


def assert_step_matches(
    dump_or_tensors: str | Path | Mapping[str, Tensor],
    *,
    preset: str | None = None,
    hparams: Mapping[str, Any] | None = None,
    **conventions: Any,
) -> Outcome:
    """Raise ``AssertionError`` (message: the oracle's text report) unless the step matches.

    ``dump_or_tensors``: a dump file (its sidecar is found beside it; ``hparams`` is laid over
    that sidecar's keys) or a dict of tensors with the dump keys, whose sidecar is ``hparams``
    (hyperparameters, convention keys and the v2 step keys ``world_size``, ``micro_batches``,
    ``separate_critic``). ``conventions``: convention keys or hyperparameters as ``--set`` would
    give them (``kl_estimator="k3"``, ``loss_agg="seq-mean-token-mean"``). Returns the outcome
    when the step matches. Bad input raises :class:`refppo.errors.RefPPOError` (not an assertion).
    """
    outcome = check_step(dump_or_tensors, preset=preset, overrides=conventions, hparams=hparams or {})
    if not outcome.match:
        raise AssertionError(outcome.text())
    return outcome


__all__ = ["assert_step_matches"]
