"""``refppo diff --detect``: when the search's nearest convention refuses the dump on its re-check (a
``RefPPOError``, e.g. ``advantage=opo`` under a gate that empties a row), the report says so in one
diagnosis line and the run still reports; before, the refusal ended the whole run as its error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs, naive_dump, save, setup_for

import refppo.oracle.run as run_mod
from refppo.errors import ConventionError
from refppo.oracle.run import check_step


def test_a_refused_nearest_is_a_note_not_the_runs_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = make_inputs(B=4, T=6, seed=5)
    d = naive_dump(x, setup_for(None, {}))
    noise = torch.randn(d["advantages"].shape, generator=torch.Generator().manual_seed(1)).double()
    d["advantages"] = d["advantages"] + 0.3 * noise * x["response_mask"]  # nothing reproduces it
    path = save(tmp_path, d, setup_for(None, {}))
    real = run_mod.check
    seen: list[bool] = []

    def check(*a: Any, explain_divergence: bool = True, **k: Any) -> Any:
        if not explain_divergence:  # the nearest's re-check
            seen.append(True)
            raise ConventionError("the nearest refuses this dump")
        return real(*a, explain_divergence=explain_divergence, **k)

    monkeypatch.setattr(run_mod, "check", check)
    out = check_step(path, detect_conventions=True)
    assert seen == [True]  # the nearest was re-checked, and refused
    assert out.nearest is None
    assert out.detection is not None and out.detection.nearest is not None
    notes = [n for n in out.result.diagnosis if "nearest convention is not re-checked" in n]
    assert notes == ["the nearest convention is not re-checked: the nearest refuses this dump"], notes
