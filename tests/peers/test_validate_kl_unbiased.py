"""Run ``tools/peers kl_unbiased``: OpenRLHF 0.11.2's own ``compute_approx_kl(unbiased_gradient=True)``
(value of its estimator, gradient ``min(exp(l − l_old), 10)·d``) vs refppo's ``kl_grad_is_clip=10`` with
``k1+``/``k2``/``k3+`` — value, autograd gradient and the closed-form gradient twin — with the unweighted
gradient as a control that must differ.

Needs the OpenRLHF side venv (``verl-openrlhf``); skipped with the reason where it is absent.
"""

from __future__ import annotations

from pathlib import Path

from _peers import require, run


def test_openrlhf_unbiased_kl_gradient_matches_refppo(tmp_path: Path) -> None:
    require("verl-openrlhf")
    proc, doc = run("kl_unbiased", tmp_path=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert doc["versions"] == {"openrlhf": "openrlhf 0.11.2"}, doc["versions"]
    s = doc["summary"]
    assert (s["cases"], s["passed"]) == (3, 3), s
    assert (s["controls"], s["controls_mismatched"]) == (3, 3), s
