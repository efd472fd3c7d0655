"""``--detect`` lists ``policy_loss=gspo`` for GSPO steps made by verl 0.9.1's OWN code (issue #23 item 5).

The dumps are :mod:`peers.makers.verl_gspo`'s (unit ``verl:gspo`` of ``tools/peers presets``:
verl's ``compute_policy_loss_gspo`` through ``get_policy_loss_fn("gspo")``, its GAE, value loss and
``agg_loss``). ``--detect`` runs from refppo's defaults with the dump's sidecar (no preset, no
``--set``), each case in its own process (``tools/peers detect --dumps DIR --case NAME``). The
generating convention (``--preset verl --set policy_loss=gspo dual_clip=none log_ratio_clamp=10`` and
the case's keys) must be listed (verdict ``found``), ``policy_loss`` must not be undetermined, and on
the case whose row passes verl's κ = 10 neither may ``log_ratio_clamp``. Before, ``--detect``
listed nothing on these dumps (``policy_loss`` was never walked).

Needs the ``verl-openrlhf`` side venv (/work/shared/peers/README.md); skipped with the reason where
absent (a skip is never a pass).
"""

from __future__ import annotations

from pathlib import Path

from _peers import require, run
from peers.harness import Report, peers_root
from peers.presets import VENVS

CASE_TIMEOUT_S = 900


def test_detect_lists_verls_gspo(tmp_path: Path) -> None:
    require("verl-openrlhf")
    from peers.detect import make_dumps

    dumps = tmp_path / "dumps"
    report = Report("detect")
    units = {"verl-openrlhf": {"verl:gspo": VENVS["verl-openrlhf"]["verl:gspo"]}}
    made = make_dumps(report, units, peers_root(), dumps)  # verl's own code, once
    assert not report.skipped and not report.failed, (report.skipped, report.failed)
    names = [name for _, _, name in made]
    assert len(names) == 3 and sum(n.endswith("_clamped") for n in names) == 1, names
    for name in names:
        proc, doc = run(
            "detect", "--dumps", str(dumps), "--case", name, tmp_path=tmp_path, timeout=CASE_TIMEOUT_S
        )
        assert [c["name"] for c in doc["cases"]] == [name], doc["cases"]
        r = doc["cases"][0]["info"]
        assert r["preset_match"], f"{name}: verl's GSPO step does not reproduce under its own convention"
        assert r["verdict"] == "found", (name, r)
        assert r["set"]["policy_loss"] == "gspo" and "policy_loss" not in r["undetermined"], (name, r)
        if name.endswith("_clamped"):
            assert "log_ratio_clamp" not in r["undetermined"], (name, r["undetermined"])
        assert proc.returncode == 0, (name, proc.stdout[-2000:])
