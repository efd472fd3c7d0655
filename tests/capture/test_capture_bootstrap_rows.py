"""``StepRecorder.record`` takes the truncated-row keys (issue #23 item 5): ``bootstrap_values``
``[b]`` float and ``truncated`` ``[b]`` 0/1 or bool, as it takes ``scores``; the recorded dump
checks under ``gae_bootstrap=truncated`` (spec/dump-format.md, "Truncated rows").

The reference values come from the naive twins (:func:`oracle_helpers.naive_dump`) under
``gae_bootstrap=truncated``; the recorder only carries the rows into the dump, split over two
micro-batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle_helpers import make_inputs, naive_dump, setup_for

from refppo.capture.recorder import ROW_KEYS, TOKEN_KEYS, CaptureError, StepRecorder
from refppo.errors import DumpError
from refppo.oracle.run import check_step

B, T = 6, 8
# Row 1 is cut short by the trainer (truncated although shorter than T); row 0 is full but ended
# with EOS (not truncated): the flags, not the last position, decide which rows bootstrap.
LENGTHS = [T, 5, 3, T, 6, 2]
TRUNCATED = torch.tensor([False, True, False, True, False, False])


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    x = make_inputs(B=B, T=T, seed=5, lengths=LENGTHS)
    x["bootstrap_values"] = torch.tensor([2.0, -1.5, 0.7, 1.25, -0.4, 0.3], dtype=torch.float64)
    x["truncated"] = TRUNCATED
    setup = setup_for(None, {"gae_bootstrap": "truncated"})
    d = naive_dump(x, setup)
    hp = {k: v for k, v in setup.hparams_dict().items() if v is not None}
    return d, hp


def _record(path: Path, keep_boot: bool) -> Path:
    d, hp = _reference()
    rec = StepRecorder(hparams=hp, grads=False)
    keys = {*TOKEN_KEYS, *ROW_KEYS} - ({"bootstrap_values", "truncated"} if not keep_boot else set())
    for k, rows in enumerate((slice(0, 4), slice(4, B))):  # two micro-batches
        mb = {n: v[rows] for n, v in d.items() if n in keys}
        rec.record(micro_batch=k, **mb)
    out = rec.write(path)
    assert out is not None
    return path


def test_recorded_bootstrap_rows_match_under_gae_bootstrap_truncated(tmp_path: Path) -> None:
    path = _record(tmp_path / "step.safetensors", keep_boot=True)
    res = check_step(path, overrides={"gae_bootstrap": "truncated"})
    assert res.match, res.result.first_divergence
    assert {"advantages", "returns"} <= set(res.result.quantities)
    # control: without the bootstrap the truncated rows' advantages differ
    assert not check_step(path, overrides={"gae_bootstrap": "none"}).match


def test_without_them_the_check_names_what_is_missing_in_one_line(tmp_path: Path) -> None:
    path = _record(tmp_path / "step.safetensors", keep_boot=False)
    with pytest.raises(DumpError, match="missing required key 'bootstrap_values' \\[B\\]") as exc:
        check_step(path, overrides={"gae_bootstrap": "truncated"})
    assert "\n" not in str(exc.value)


def test_truncated_flags_must_be_rows(tmp_path: Path) -> None:
    rec = StepRecorder(grads=False)
    mask = torch.ones(2, 3)
    with pytest.raises(CaptureError, match="truncated has shape \\[2, 3\\], expected \\[2\\]"):
        rec.record(response_mask=mask, old_logprobs=mask, scores=torch.zeros(2), truncated=mask)
