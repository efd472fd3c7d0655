"""AReaL 1.0.4's critic clip fraction (issue #23 item 5): its definition is ``value_clip_form=delta``'s
strict ``>``; the one-token gap was a rounding tie of the reference's own returns.

AReaL ``areal/utils/functional/functional.py::ppo_critic_loss_fn`` counts
``clip_mask = ½(V^clip − R)² > ½(V − R)²`` with ``V^clip = V_old + clamp(V − V_old, ±ε_v)`` (the ½
is exact in binary floating point). Inside the range ``V^clip`` can land one rounding step off
``V``; the two squares then differ by less than their own rounding, and the strict ``>`` reads the
last bit of ``R``. refppo's float32 GAE lands one rounding step off AReaL's ``R`` on one such token
of ``tools/peers/makers/areal_value_ties.py``'s batch, which is why the reference counted one token
fewer (62/149 vs 63/149). The oracle now widens the ``delta`` count by those tokens
(:func:`refppo.oracle.check.ties.delta_rounding_ties`); tokens where the offset shows beyond
rounding stay exact, so ``around_old`` still mismatches.

The first two tests need no venv; the last runs AReaL's own code (``skyrl-areal``; SKIPPED with
the reason when it is not built).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch
from _peers import REPO, TOOLS, require

from refppo.core.value import value_token_loss
from refppo.oracle.check.ties import delta_rounding_ties, vf_tie_widen
from refppo.oracle.run import check_step

F32 = torch.float32
ONE = torch.ones(1, 1, dtype=torch.bool)
# token (14, 4) of the AReaL batch: V, V_old, and R as AReaL's GAE and refppo's GAE round it
V, V_OLD, EPS_V = -0.05599406734108925, -0.4470992684364319, 0.5
R_AREAL, R_REFPPO = -0.6767054796218872, -0.676705539226532


def _t(x: float) -> torch.Tensor:
    return torch.tensor([[x]], dtype=F32)


def test_one_rounding_step_of_r_flips_the_delta_count_and_is_marked_a_tie() -> None:
    """R one float32 step apart (hand-checked: nextafter) flips the ``delta`` count of one token
    inside the range (|V − V_old| = 0.391 < 0.5); :func:`delta_rounding_ties` marks it, and only the
    ``delta`` share is widened (``around_old``: V^clip is V itself, the count is 0 either way)."""
    assert torch.nextafter(_t(R_AREAL), _t(0.0)).item() != R_REFPPO
    assert torch.nextafter(_t(R_AREAL), _t(-1.0)).item() == R_REFPPO
    counts = [
        float(value_token_loss(_t(V), _t(V_OLD), _t(r), ONE, clip=EPS_V, clip_form="delta").clipfrac)
        for r in (R_AREAL, R_REFPPO)
    ]
    assert counts == [1.0, 0.0]
    for r in (R_AREAL, R_REFPPO):
        assert bool(delta_rounding_ties(_t(V), _t(V_OLD), _t(r), ONE, EPS_V))
        assert vf_tie_widen(_t(V), _t(V_OLD), _t(r), ONE, EPS_V, 2e-5, "delta") == 1.0
        assert vf_tie_widen(_t(V), _t(V_OLD), _t(r), ONE, EPS_V, 2e-5) == 0.0


def test_an_offset_beyond_rounding_is_not_a_tie() -> None:
    """Control: R near V (the offset of V^clip shows in the squares by ~1e-11 ≫ their rounding,
    ~1e-15) is a real ``delta`` count, not widened; the form stays checked exactly there."""
    v, v_old, r, eps = _t(-0.05), _t(0.1), _t(-0.049), 0.2
    d = float(value_token_loss(v, v_old, r, ONE, clip=eps, clip_form="delta").clipfrac)
    a = float(value_token_loss(v, v_old, r, ONE, clip=eps, clip_form="around_old").clipfrac)
    assert (d, a) == (1.0, 0.0)
    assert not bool(delta_rounding_ties(v, v_old, r, ONE, eps))
    assert vf_tie_widen(v, v_old, r, ONE, eps, 2e-5, "delta") == 0.0


def _areal_dump(tmp_path: Path) -> Path:
    py = require("skyrl-areal")
    proc = subprocess.run(
        [str(py), str(TOOLS / "peers" / "makers" / "areal_value_ties.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(TOOLS)},
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return tmp_path / "areal_value_ties.pt"


def test_areal_critic_clip_fraction_is_delta_and_the_preset_matches(tmp_path: Path) -> None:
    """AReaL 1.0.4's own step: its ``vf_clipfrac`` is refppo's ``delta`` count on AReaL's returns
    exactly (not ``around_old``, not ``>=``); ``--preset areal`` matches the whole dump (it did
    not before: ``vf_clipfrac`` 0.4228 vs 0.4161); control: ``value_clip_form=around_old`` mismatches."""
    path = _areal_dump(tmp_path)
    d = torch.load(path, weights_only=True)
    m = d["response_mask"].bool()
    n = int(m.sum())
    got = round(float(d["vf_clipfrac"]) * n)

    def count(form: str) -> int:
        out = value_token_loss(d["values"], d["old_values"], d["returns"], m, clip=EPS_V, clip_form=form)
        return round(float(out.clipfrac) * n)

    v, vo, r = d["values"], d["old_values"], d["returns"]
    v_clip = vo + (v - vo).clamp(-EPS_V, EPS_V)
    ge = int((((v_clip - r) ** 2 >= (v - r) ** 2) & m).sum())  # the "ties counted" candidate
    assert (n, got) == (149, 63)
    assert count("delta") == got
    assert count("around_old") != got and ge != got
    out = check_step(path, preset="areal")
    assert out.match, out.text()
    control = check_step(path, preset="areal", overrides={"value_clip_form": "around_old"})
    assert not control.match
    assert not control.result.quantities["vf_clipfrac"].ok


def test_detect_lists_areal_value_clip_under_delta(tmp_path: Path) -> None:
    """``--detect`` from refppo's defaults (``refppo diff DUMP --detect``) lists AReaL's own step with
    the value clip under ``delta`` and never under ``around_old`` (it listed nothing while the value
    step widened a group that merged both forms by the first form's rule)."""
    from peers.detect import _setups

    from refppo.dump.load import load_dump
    from refppo.oracle.detect.detection import detect

    dump = load_dump(_areal_dump(tmp_path))
    det = detect(dump, _setups(dump, "areal", {"kl_estimator": "k1"})[1], limit=100000)
    assert det.detected, (det.unmatched_stages, det.nearest)
    forms = {c["value_clip_form"] for c in det.detected if c["value_loss"] == "clipped"}
    assert forms == {"delta"}, forms
    print(f"--detect lists {len(det.detected)} convention(s), value_clip_form {sorted(forms)}")
