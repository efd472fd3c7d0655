"""TRL 1.16.0 GRPOTrainer ``loss_type="cispo"`` through ``refppo diff`` and ``--detect`` (issue #22 item 2).

:mod:`peers.makers.trl_cispo` runs TRL's own ``_compute_loss`` (``min(ρ, epsilon_high)``, no lower
bound) in the ``trl-grpo`` venv (skipped with the reason without it) and writes v2 dumps. Each must
match under ``--preset trl`` + ``policy_loss=cispo, loss_agg=token-mean`` with the sidecar's
``cliprange = 1`` (no lower bound) and ``cliprange_high = epsilon_high − 1`` (max abs error bounded);
the control ``policy_loss=vanilla`` and refppo's lower bound ``cliprange = 0.2`` must mismatch; the
dumped ``pg_clipfrac`` is TRL's logged ``cispo_clip_ratio`` (``ρ > ε_max`` on ``A > 0``), compared under
the preset's ``clipfrac_counts=by_advantage``, and the default count (``all``) must mismatch at it; and
on the float32 case (the walk is long) ``--detect`` from the preset's defaults must list
``policy_loss=cispo`` (each listed entry re-checked) and no ``vanilla`` entry.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from _peers import REPO, TOOLS, require

from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.detect.detection import detect, setup_from_json

MAX_ERR = 1e-5


def test_trl_cispo_matches_with_no_lower_bound_and_detect_lists_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(TOOLS))
    from peers.checks import dump_file
    from peers.detect import _setups

    py = require("trl-grpo")
    code = "import sys, pathlib; from peers.makers.trl_cispo import make; make(pathlib.Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(TOOLS)}
    subprocess.run([str(py), "-c", code, str(tmp_path)], check=True, cwd=REPO, env=env, timeout=600)
    names = sorted(p.name.removesuffix(".set.json") for p in tmp_path.glob("*.set.json"))
    assert len(names) == 3, names
    for n in names:
        conv = json.loads((tmp_path / f"{n}.set.json").read_text())
        dump = load_dump(dump_file(tmp_path, n))
        expected, base = _setups(dump, "trl", conv)
        assert expected.hp.cliprange == 1.0, (n, expected.hp)
        res = check(dump, expected, explain_divergence=False)
        assert res.match and "grad_logprobs" in res.quantities, (n, res.first_divergence)
        assert "pg_clipfrac" in res.quantities, n  # TRL's cispo_clip_ratio
        assert expected.conv.policy.clipfrac_counts.value == "by_advantage", n
        err = max(q.max_abs_err for q in res.quantities.values())
        print(f"{n}: match, max abs error {err:.2e}")
        assert err < MAX_ERR, (n, err)
        flip = json.loads((tmp_path / f"{n}.control.json").read_text())
        vanilla = {**{k: getattr(v, "value", v) for k, v in expected.convention_dict().items()}, **flip}
        vanilla["cliprange"] = 0.2  # vanilla needs ε_low < 1
        assert not check(dump, setup_from_json(expected, vanilla), explain_divergence=False).match, n
        bounded = replace(expected, hp=replace(expected.hp, cliprange=0.2))
        assert not check(dump, bounded, explain_divergence=False).match, n
        # cispo_clip_ratio: the default count (ρ outside the band, either sign of A) mismatches
        every = replace(expected, conv=expected.conv.with_updates({"clipfrac_counts": "all"}))
        ctl = check(dump, every, explain_divergence=False)
        got = ctl.quantities["pg_clipfrac"].max_abs_err
        print(f"{n}: pg_clipfrac (cispo_clip_ratio) control clipfrac_counts=all: abs error {got:.3g}")
        assert not ctl.match and ctl.first_divergence == "pg_clipfrac", (n, ctl.first_divergence)
        if not n.endswith("_f32"):
            continue  # --detect walks ~10 min a dump on 2 cores: once, on the float32 case
        det = detect(dump, base, limit=100000)
        listed = [e for e in det.detected if e.get("policy_loss") == "cispo"]
        assert listed, (n, det.detected[:3])
        assert not [e for e in det.detected if e.get("policy_loss", "vanilla") == "vanilla"], n
        print(f"{n}: --detect lists {len(listed)} cispo entries, no vanilla")
        for e in listed[:3]:
            assert check(dump, setup_from_json(base, e), explain_divergence=False).match, (n, e)
