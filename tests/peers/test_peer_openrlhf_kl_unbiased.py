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

from _peers import REPO, TOOLS, require

from refppo.oracle.run import check_step


def test_openrlhf_unbiased_kl_step_matches_kl_grad_is_clip(tmp_path: Path) -> None:
    py = require("verl-openrlhf")
    proc = subprocess.run(
        [str(py), str(TOOLS / "peers" / "makers" / "openrlhf_kl_unbiased.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TOOLS)])},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
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
