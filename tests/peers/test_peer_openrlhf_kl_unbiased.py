"""``kl_grad_is_clip`` on a whole OpenRLHF 0.11.2 step (``verl-openrlhf`` venv; SKIPPED with the reason
when it is not built): ``refppo diff`` of a gradient-only v2 dump (2 ranks × 2 micro-batches) whose KL
loss is OpenRLHF's own ``compute_approx_kl(..., unbiased_gradient=True)``
(``tools/peers/makers/openrlhf_kl_unbiased.py``).

Under ``--preset openrlhf --set kl_in=loss kl_estimator=k1+|k3+ kl_grad_is_clip=10`` the step matches,
``grad_logprobs`` included; without ``kl_grad_is_clip`` it mismatches at ``grad_logprobs``; the same
step with OpenRLHF's plain gradient (``unbiased_gradient=False``) mismatches under the weighted one.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from _peers import REPO, TOOLS, require

from refppo.oracle.cli import main
from refppo.oracle.run import check_step


def _make(out: Path) -> None:
    py = require("verl-openrlhf")
    proc = subprocess.run(
        [str(py), str(TOOLS / "peers" / "makers" / "openrlhf_kl_unbiased.py"), str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TOOLS)])},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_openrlhf_unbiased_kl_step_matches_kl_grad_is_clip(tmp_path: Path) -> None:
    _make(tmp_path)
    for name in ("openrlhf_kl_unbiased_k1", "openrlhf_kl_unbiased_k3", "openrlhf_kl_unbiased_k3__control"):
        path = tmp_path / f"{name}.pt"
        conv = json.loads((tmp_path / f"{name}.set.json").read_text())
        out = check_step(path, preset="openrlhf", overrides=conv)
        assert "grad_logprobs" in out.result.quantities
        if name.endswith("__control"):  # OpenRLHF's unweighted gradient is not the weighted convention
            assert not out.result.quantities["grad_logprobs"].ok
            continue
        assert out.match, out.text()
        plain = {k: v for k, v in conv.items() if k != "kl_grad_is_clip"}
        assert not check_step(path, preset="openrlhf", overrides=plain).result.quantities["grad_logprobs"].ok


def test_detect_lists_kl_grad_is_clip_from_the_gradient(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--detect`` (from ``kl_in=loss``, the estimator, no ``kl_grad_is_clip``) on the gradient-only
    v2 dumps: with ``unbiased_gradient`` every listed convention names ``kl_grad_is_clip=10`` and the
    key is pinned (before: nothing listed, the key was not walked); OpenRLHF's plain gradient (the
    control) lists only conventions without it. The gradient is what tells them apart: on a v1 dump
    with scalars only the key stays open (tests/oracle/detect/test_oracle_detect_kl_loss_keys.py)."""
    _make(tmp_path)
    for name, want in (("openrlhf_kl_unbiased_k1", 10.0), ("openrlhf_kl_unbiased_k3__control", None)):
        conv = json.loads((tmp_path / f"{name}.set.json").read_text())
        argv = [str(tmp_path / f"{name}.pt"), "--preset", "openrlhf", "--detect", "--json"]
        argv += ["--set", "kl_in=loss", "--set", f"kl_estimator={conv['kl_estimator']}"]
        main(argv)
        out = json.loads(capsys.readouterr().out)
        assert out["detected_count"] > 0, name
        assert {c["kl_grad_is_clip"] for c in out["detected"]} == {want}, name
        assert "kl_grad_is_clip" not in out["undetermined_keys"], name
