"""AMP loss scaling in ``StepRecorder`` (refppo/capture/scale.py): a trainer that runs
``scaler.scale(loss).backward()`` under ``torch.amp.GradScaler`` (CPU; torch supports it there) makes
hooks see ``S·∂loss/∂logprobs``. With ``StepRecorder(loss_scale=scaler)`` the dump holds the unscaled
gradient and ``refppo diff`` matches; the same scaled step recorded without it mismatches at
``grad_logprobs`` (and ``grad_values``); a step the scaler skips (inf gradient) is refused in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _capture_trainer as ct  # the tiny models and batch of the 2-rank capture test

from refppo.capture.recorder import CaptureError, StepRecorder
from refppo.oracle.run import check_step
from refppo.pipeline.blocks import Normalisers
from refppo.pipeline.settings import Convention
from refppo.pipeline.step import update_quantities

SCALE = 2.0**12
"""A power of two: scaling and unscaling are exact, so the scaled step's dump equals the plain one's."""


def _step(path: Path, scaler: torch.amp.GradScaler | None, loss_scale: object, poison: bool = False) -> Path:
    """One optimizer step over 2 micro-batches, backward through ``scaler.scale`` when given."""
    policy, critic, b = ct.setup()
    conv = Convention()
    q = ct.quantities(b, conv)
    n_tok, n_vtok = float(b.mask.sum()), float(q.value_mask.sum())
    rec = StepRecorder(hparams=ct.HP, conventions=conv, loss_scale=loss_scale)  # type: ignore[arg-type]
    for k, rows in enumerate(([0, 1, 2, 3], [4, 5, 6, 7])):
        idx = torch.tensor(rows)
        logprobs, values = policy(b.ids[idx]), critic(b.ids[idx])
        uq = update_quantities(
            logprobs=logprobs, values=values, old_logprobs=b.old_logprobs[idx], old_values=b.old_values[idx],
            advantages=q.advantages[idx], returns=q.returns[idx], mask=b.mask[idx], hp=ct.HP, conv=conv,
            norm=Normalisers(n_tok, 8.0, n_vtok), value_mask_=q.value_mask[idx],
        )  # fmt: skip
        rec.record(
            micro_batch=k, logprobs=logprobs, values=values, response_mask=b.mask[idx],
            old_logprobs=b.old_logprobs[idx], ref_logprobs=b.ref_logprobs[idx], old_values=b.old_values[idx],
            scores=b.scores[idx], kl=q.kl[idx], token_rewards=q.token_rewards[idx],
            advantages=q.advantages[idx], returns=q.returns[idx],
            pg_loss=uq.pg_loss, vf_loss=uq.vf_loss, loss=uq.loss,
        )  # fmt: skip
        loss = uq.loss * (float("inf") if poison and k == 1 else 1.0)
        (loss if scaler is None else scaler.scale(loss)).backward()
    rec.write(path)
    opt = torch.optim.SGD([*policy.parameters(), *critic.parameters()], lr=0.1)
    if isinstance(scaler, torch.amp.GradScaler):  # after write: update() may change the scale
        scaler.step(opt)
        scaler.update()
    return path


def _scaler() -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    assert scaler.is_enabled() and scaler.get_scale() == SCALE
    return scaler


def test_recorded_scale_gives_the_unscaled_gradients_and_a_match(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    plain = load_file(_step(tmp_path / "plain.safetensors", None, None))
    scaler = _scaler()
    path = _step(tmp_path / "amp.safetensors", scaler, scaler)
    scaled = load_file(path)
    for key in ("grad_logprobs", "grad_values"):
        assert torch.equal(scaled[key], plain[key]), key
        assert float(plain[key].abs().max()) > 0
    assert json.loads(Path(f"{path}.json").read_text())["loss_scale"] == SCALE  # the sidecar's record
    out = check_step(path)
    assert out.match, out.text()


def test_scaled_step_recorded_without_the_scale_mismatches_at_the_gradients(tmp_path: Path) -> None:
    out = check_step(_step(tmp_path / "amp.safetensors", _scaler(), None))
    assert not out.match
    assert not out.result.quantities["grad_logprobs"].ok
    assert not out.result.quantities["grad_values"].ok
    assert out.result.quantities["loss"].ok  # the losses were recorded unscaled: only the gradients differ


def test_fixed_scale_number_and_bad_values(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    class Fixed:  # a trainer's own static loss scaling: backward of S·loss
        def scale(self, loss: torch.Tensor) -> torch.Tensor:
            return SCALE * loss

    plain = load_file(_step(tmp_path / "plain.safetensors", None, None))
    fixed = load_file(_step(tmp_path / "fixed.safetensors", Fixed(), SCALE))  # type: ignore[arg-type]
    assert torch.equal(fixed["grad_logprobs"], plain["grad_logprobs"])
    for bad in (0.0, -2.0, float("nan"), True, "1024"):
        with pytest.raises(CaptureError, match="loss_scale"):
            StepRecorder(loss_scale=bad)  # type: ignore[arg-type]


def test_a_step_the_scaler_skips_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CaptureError, match="inf/NaN under loss scale 4096: the GradScaler skips this step"):
        scaler = _scaler()
        _step(tmp_path / "skip.safetensors", scaler, scaler, poison=True)
