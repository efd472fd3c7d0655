"""A KL in the reward and a KL loss both on in one step (issue #23 item 5): ``kl_in=both``
reproduces verl 0.9.1's own step with ``algorithm.use_kl_in_reward`` and ``actor.use_kl_loss``
both true (``tools/peers/makers/verl_kl_both.py``): one β and one estimator for the two, and (the
``SEPARATE`` cases) the loss's own ``kl_loss_coef`` and ``kl_loss_estimator`` (verl's
``actor.kl_loss_coef`` / ``kl_loss_type`` beside ``algorithm.kl_ctrl.kl_coef`` / ``kl_penalty``). Runs
in the ``verl-openrlhf`` venv; SKIPPED with the reason when it is not built.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from _peers import REPO, TOOLS, require

from refppo.oracle.cli import main
from refppo.oracle.run import check_step

CASES = ("k3_token-mean", "k1_seq-mean-token-mean", "k2_token-mean")
SEPARATE = ("k1_k3_token-mean", "k1_k3_seq-mean-token-mean_far", "k3_k2_token-mean")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    py = require("verl-openrlhf")
    out = tmp_path_factory.mktemp("verl_kl_both")
    proc = subprocess.run(
        [str(py), str(TOOLS / "peers" / "makers" / "verl_kl_both.py"), str(out)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(TOOLS)}, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


@pytest.mark.parametrize("case", CASES)
def test_verl_kl_in_reward_and_kl_loss_match_kl_in_both(dumps: Path, case: str) -> None:
    """``--preset verl --set kl_in=both`` matches (float64, ≤ 1e-8); neither placement alone does:
    ``kl_in=reward`` misses the KL loss (``kl_loss``, ``loss``), ``kl_in=loss`` the reward's −β·KL
    (``token_rewards`` onwards)."""
    path = dumps / f"verl_kl_both_{case}.pt"
    conv = json.loads((dumps / f"verl_kl_both_{case}.set.json").read_text())
    out = check_step(path, preset="verl", overrides=conv)
    assert out.match, out.text()
    assert max(q.max_abs_err for q in out.result.quantities.values()) <= 1e-8
    for control, first in (("reward", "kl_loss"), ("loss", "token_rewards")):
        bad = check_step(path, preset="verl", overrides={**conv, "kl_in": control})
        assert not bad.match
        assert not bad.result.quantities[first].ok


@pytest.mark.parametrize("case", SEPARATE)
def test_verl_separate_kl_loss_coef_and_type_match_kl_loss_keys(dumps: Path, case: str) -> None:
    """Reward ``(kl_coef, kl_penalty)`` and loss ``(kl_loss_coef, kl_loss_type)`` set apart: matches
    under ``kl_loss_coef`` + ``kl_loss_estimator`` (float64, relative error ≤ 1e-8); one β and one
    estimator (the keys unset: the control) does not, nor does the loss's β alone shared; on the
    ``_far`` case (``low_var_kl``'s clamps bind) the loss estimator without its clamps does not."""
    path = dumps / f"verl_kl_sep_{case}.pt"
    conv = json.loads((dumps / f"verl_kl_sep_{case}.set.json").read_text())
    out = check_step(path, preset="verl", overrides=conv)
    assert out.match, out.text()
    assert max(q.max_rel_err for q in out.result.quantities.values()) <= 1e-8
    control = json.loads((dumps / f"verl_kl_sep_{case}.control.json").read_text())
    assert control == {"kl_loss_estimator": None, "kl_loss_coef": None}
    shared = check_step(path, preset="verl", overrides={**conv, **control})
    assert not shared.match and not shared.result.quantities["kl_loss"].ok
    beta = check_step(path, preset="verl", overrides={**conv, "kl_loss_coef": None})
    assert not beta.match and beta.result.quantities["kl_loss"].ok and not beta.result.quantities["loss"].ok
    if case.endswith("_far"):
        bare = {**conv, "kl_loss_log_ratio_clamp": None, "kl_loss_value_clamp": None}
        assert not check_step(path, preset="verl", overrides=bare).result.quantities["kl_loss"].ok


def _detect(path: Path, sets: dict[str, object], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    argv = [str(path), "--preset", "verl", "--detect", "--json"]
    for k, v in sets.items():
        argv += ["--set", f"{k}={'none' if v is None else v}"]
    main(argv)
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_detect_walks_the_kl_loss_estimator_and_reads_its_beta(
    dumps: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--detect`` from ``kl_in=both`` alone (no ``kl_loss_estimator``) on verl's own step with the
    loss's ``low_var_kl`` clamps binding: ``kl_loss_estimator=k3`` with verl's k3 clamps is listed, and
    every listed convention names ``k3`` (or its straight-through twin ``k3+``: the same value, no
    gradient dumped) with the binding value clamp 10 (the log-ratio clamps that bind on no token give
    the same value), none the shared estimator (before: the loss's KL was the reward's, nothing
    listed). Without ``kl_loss_coef`` in the sidecar nothing reproduces ``loss``, and a note reads
    β_loss = 0.1 off it as a fit of one equation (not a listed option)."""
    case = "verl_kl_sep_k1_k3_seq-mean-token-mean_far"
    sets = {"kl_in": "both", "loss_agg": "seq-mean-token-mean"}
    out = _detect(dumps / f"{case}.pt", sets, capsys)
    assert out["detected_count"] > 0
    # every member with the binding value clamp 10: verl's k3 clamps, or a log-ratio clamp that binds on
    # no token here; k3 and its straight-through twin k3+ have one value (no gradient): one class (#23),
    # listed as far as search.MAX_EQUIV allows
    own = {
        (c["kl_loss_estimator"], str(c["kl_loss_log_ratio_clamp"]), c["kl_loss_value_clamp"])
        for c in out["detected"]
    }
    assert ("k3", "[-20.0, 20.0]", 10.0) in own, own
    assert {e for e, _, _ in own} <= {"k3", "k3+"} and {v for _, _, v in own} == {10.0}, own
    assert "kl_grad_is_clip" in out["undetermined_keys"]  # no gradient: the dump cannot tell
    hp = json.loads((dumps / f"{case}.pt.json").read_text())
    del hp["kl_loss_coef"]
    (tmp_path / "s.pt").write_bytes((dumps / f"{case}.pt").read_bytes())
    (tmp_path / "s.pt.json").write_text(json.dumps(hp))
    out = _detect(tmp_path / "s.pt", sets, capsys)
    assert out["detected_count"] == 0
    notes = [n for n in out["detect_notes"] if n.startswith("kl_loss_coef=")]
    assert (
        len(notes) == 1 and notes[0].startswith("kl_loss_coef=0.1 ") and "fixed by one equation" in notes[0]
    )
