"""Issue #21 items 3, 5, 6: a named bug is re-checked against the losses its trainer logs, outranks
``--detect``'s fitted nearest, and numbers that are not numbers are said in words.

Steps from the hand-written trainer of ``grad_helpers`` (its own losses, as passed to backward,
summed as ``StepRecorder`` sums them) and the pipeline dumps of ``oracle_helpers``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from grad_helpers import HP, TWO_RANKS_TWO_MB, Bugs, save_step, step_dump
from oracle_helpers import make_inputs, naive_dump, setup_for

from refppo.oracle.cli import main
from refppo.oracle.run import check_step

SIDECAR = {**HP, **TWO_RANKS_TWO_MB.sidecar()}


def _strict_json(text: str) -> dict[str, object]:
    """``json.loads`` that refuses NaN and Infinity (not JSON, though Python writes them)."""

    def refuse(token: str) -> float:
        raise ValueError(f"not JSON: {token}")

    out: dict[str, object] = json.loads(text, parse_constant=refuse)
    return out


# ---- 3. the normaliser bug re-checked against the logged losses ---------------------------------


@pytest.mark.parametrize(
    ("bugs", "hid", "how"),
    [
        (Bugs(local_norm=True), "local_normaliser", "the mean of the micro-batch means"),
        (Bugs(local_norm_summed=True), "local_normaliser_summed", "the micro-batch means summed"),
        (Bugs(rank_norm=True), "rank_normaliser", "the mean of the ranks' means"),
    ],
)
def test_a_normaliser_bug_explains_the_losses_its_trainer_logs(bugs: Bugs, hid: str, how: str) -> None:
    d = step_dump(bugs=bugs, logged_losses=True)
    out = check_step(d, hparams=SIDECAR)
    assert out.result.first_divergence == "pg_loss"  # the logged mean of means differs from the step's
    assert {"kind": "gradient", "bug": hid, "all_match": True} in out.result.explained_by
    line = next(n for n in out.result.diagnosis if n.startswith("explained by") and how in n)
    assert "with it every quantity in the dump matches (pg_loss, vf_loss, entropy_loss, loss" in line, line
    assert "still differ" not in out.text()


def test_a_logged_loss_the_bug_does_not_give_still_differs() -> None:
    d = step_dump(bugs=Bugs(local_norm=True), logged_losses=True)
    d["pg_loss"] = d["pg_loss"] + 0.01  # not what that trainer would log (its loss still is)
    out = check_step(d, hparams=SIDECAR)
    assert {"kind": "gradient", "bug": "local_normaliser", "all_match": False} in out.result.explained_by
    line = next(n for n in out.result.diagnosis if "per-micro-batch normaliser:" in n)
    assert line.endswith(
        "it explains the gradient and vf_loss, entropy_loss, loss as this trainer logs them: the mean of "
        "the micro-batch means; pg_loss still differs"
    ), line


# ---- 5. --detect: a named explanation outranks the nearest fit ----------------------------------


def test_named_bug_outranks_the_detected_nearest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_step(tmp_path, step_dump(bugs=Bugs(local_norm=True), logged_losses=True))
    assert main([str(path), "--detect"]) == 1
    out = capsys.readouterr().out
    detect = out[out.index("\ndetect:") :]
    assert "names what reproduces every quantity (local_normaliser): a named explanation outranks" in detect
    assert "nearest:" not in detect and "dual_clip=" not in detect, detect  # no chance scalar fit
    assert "run with --detect" not in out
    assert main([str(path), "--detect", "--json"]) == 1
    rep = _strict_json(capsys.readouterr().out)
    assert rep["nearest"] is None
    assert rep["nearest_outranked_by"] == [{"kind": "gradient", "bug": "local_normaliser", "all_match": True}]


def test_a_nearest_that_rests_on_one_number_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = naive_dump(make_inputs(B=6, T=12, seed=1), setup_for())
    d = {k: v for k, v in d.items() if k not in ("pg_clipfrac", "approx_kl", "vf_clipfrac", "kl_loss")}
    d["pg_loss"] = d["pg_loss"] * 1.3  # nothing named explains it; a clip constant can be fitted to it
    path = tmp_path / "s.safetensors"
    from refppo.dump.write import write_dump

    write_dump(path, d, hparams={k: v for k, v in HP.items()})
    assert main([str(path)]) == 1
    assert "run with --detect to search the convention space" in capsys.readouterr().out
    assert main([str(path), "--detect"]) == 1
    out = capsys.readouterr().out
    assert "run with --detect" not in out and "--detect's search is below" in out
    assert "  nearest: " in out
    assert "(this nearest rests on one dumped number, pg_loss, fitted by 1 changed key(s)" in out, out
    assert main([str(path), "--detect", "--json"]) == 1
    rep = _strict_json(capsys.readouterr().out)
    nearest = rep["nearest"]
    assert isinstance(nearest, dict) and nearest["rests_on"] == ["pg_loss"]


# ---- 6. numbers that are not numbers ------------------------------------------------------------


def test_a_zero_reference_gradient_is_said_in_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # vf_coef = 0: the reference grad_values is exactly 0; the trainer's is not (its loss used 0.1)
    path = save_step(tmp_path, step_dump(logged_losses=True), vf_coef=0.0)
    assert main([str(path), "--require", "grad_values"]) == 1
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith("grad_values "))
    assert "ref = 0" in row and "e+2" not in row, row  # was max_rel_err 2.7e+296
    assert main([str(path), "--json"]) == 1
    q = _strict_json(capsys.readouterr().out)["quantities"]
    assert isinstance(q, dict)
    g = q["grad_values"]
    assert g["max_rel_err"] is None and g["ok"] is False
    peak = float(step_dump()["grad_values"].abs().max())  # the trainer's own gradient
    assert g["note"] == f"the reference is 0 at every compared position; the dump's max |x| = {peak:.6g}"
    assert math.isclose(g["max_abs_err"], peak)


def test_a_micro_batch_whose_reference_gradient_is_zero() -> None:
    """Micro-batch 0 of rank 0 is row 0 alone. With γ = 1, no whitening, no KL on that row and its
    values equal to its score, every TD residual of row 0 is 0, so its advantages and its reference
    policy gradient are 0: its dump/reference factor is not a number (it printed "nan")."""
    from grad_helpers import LAYOUT_LENGTHS, trainer_grads

    conv = {"whiten_advantages": "none"}
    x = make_inputs(B=len(LAYOUT_LENGTHS), T=max(LAYOUT_LENGTHS), seed=3, lengths=LAYOUT_LENGTHS)
    m0 = x["response_mask"][0].bool()
    x["ref_logprobs"][0] = x["old_logprobs"][0]
    x["old_values"][0] = torch.where(m0, x["scores"][0], x["old_values"][0])
    d = naive_dump(x, setup_for(conv=conv, hp={"gamma": 1.0}))
    d = {k: v for k, v in d.items() if v.dim() > 0}
    assert float(d["advantages"][0].abs().max()) == 0.0
    d.update(trainer_grads(d, conv, Bugs(ddp_sum=True)))  # the other groups: a factor 2
    d["rank"], d["micro_batch"] = torch.tensor(TWO_RANKS_TWO_MB.rank), torch.tensor(TWO_RANKS_TWO_MB.micro)
    side = {**SIDECAR, "gamma": 1.0, **conv}
    line = next(
        n
        for n in check_step(d, hparams=side, require=()).result.diagnosis
        if n.startswith("grad_logprobs: dump/reference by group")
    )
    assert "micro-batch 0 of rank 0: reference 0 there, dump 0 too; micro-batch 1 of rank 0: 2;" in line, line
    d["grad_logprobs"][0, 1] = 1e-3  # a trainer's gradient where the reference has none
    line = next(
        n
        for n in check_step(d, hparams=side, require=()).result.diagnosis
        if n.startswith("grad_logprobs: dump/reference by group")
    )
    assert "micro-batch 0 of rank 0: reference 0 there, dump max |g| = 0.001;" in line, line


def test_nan_output_keeps_the_json_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = step_dump(logged_losses=True)
    d["grad_logprobs"][1, 2] = float("nan")
    d["pg_loss"] = torch.tensor(float("inf"), dtype=torch.float64)
    path = save_step(tmp_path, d)
    assert main([str(path), "--json"]) == 1
    rep = _strict_json(capsys.readouterr().out)
    q = rep["quantities"]
    assert isinstance(q, dict)
    assert q["pg_loss"]["max_abs_err"] is None and "non-finite" in q["pg_loss"]["note"]
    assert q["grad_logprobs"]["max_abs_err"] is None
