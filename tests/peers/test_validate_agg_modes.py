"""Run ``tools/peers agg_modes``: verl's and SkyRL-train's loss aggregations, every peer's value
clip, and where verl's score goes on a response that ends with tool tokens, vs refppo's core.

Needs the peer side venvs (/work/shared/peers/README.md); skipped with the reason where absent.
"""

from __future__ import annotations

from pathlib import Path

from _peers import cases_of, require, run


def test_peers_aggregation_value_clip_and_trailing_tool_score_match_refppo(tmp_path: Path) -> None:
    require("verl-openrlhf")
    require("skyrl-areal")
    proc, doc = run("agg_modes", tmp_path=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert set(doc["versions"]) == {"verl", "openrlhf", "skyrl", "areal"}, doc["versions"]
    s = doc["summary"]
    assert (s["cases"], s["passed"]) == (22, 22), s
    cases = cases_of(doc, "verl")
    # verl drops a score that sits on a trailing tool token (masked), as gae(holes=skip) does
    lost, kept = cases["verl.gae_score.trailing_tool"], cases["verl.gae_score.last_valid"]
    assert lost["errors"]["abs"] == 0.0 and kept["errors"]["abs"] == 0.0, (lost, kept)
    assert "[0.0, 0.0, 0.0]" in " ".join(lost["notes"]) and "[1.0, 1.0, 1.0]" in " ".join(kept["notes"])
    assert [c["ok"] for c in lost["controls"]] == [True], lost["controls"]
