"""The oracle on dumps whose mask has holes (multi-turn; issue #11): ``--detect`` searches
``gae_holes`` and ``whiten_holes`` (and reports them as not pinned down on right-padded dumps), and a
dump made under one hole convention mismatches under another, first at ``advantages`` or ``returns``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle_helpers import make_inputs, naive_dump, save, setup_for

from refppo.dump.load import load_dump
from refppo.oracle.cli import main
from refppo.oracle.detect.detection import detect

CASES = [("skip", "exclude"), ("zero", "exclude"), ("through", "include")]


def holed_inputs(seed: int) -> dict[str, torch.Tensor]:
    x = make_inputs(B=6, T=12, seed=seed)
    m = x["response_mask"].clone()
    holes = torch.zeros_like(m, dtype=torch.bool)
    holes[:, 2:4] = True  # tool output at positions 2-3 of every row long enough
    holes[1, 6] = True
    lengths = m.sum(dim=1, keepdim=True)
    holes &= torch.arange(12) < lengths - 1  # never the last valid token
    x["response_mask"] = (m.bool() & ~holes).to(torch.uint8)
    return x  # the hole positions keep make_inputs' finite values (tool tokens are real tokens)


@pytest.mark.parametrize(("holes", "wh"), CASES)
def test_detect_names_the_hole_conventions(tmp_path: Path, holes: str, wh: str) -> None:
    made = setup_for(None, {"gae_holes": holes, "whiten_holes": wh})
    dump = load_dump(save(tmp_path, naive_dump(holed_inputs(5), made), made))
    found = detect(dump, setup_for(None, hp=made.hparams_dict()))
    assert found.detected, found.unmatched_stages
    assert {(c["gae_holes"], c["whiten_holes"]) for c in found.detected} == {(holes, wh)}
    assert "gae_holes" not in found.undetermined


def test_right_padded_dump_leaves_the_hole_conventions_undetermined(tmp_path: Path) -> None:
    made = setup_for("openrlhf")
    dump = load_dump(save(tmp_path, naive_dump(make_inputs(seed=5), made), made))
    found = detect(dump, setup_for(None, hp=made.hparams_dict()))
    assert {"gae_holes", "whiten_holes"} <= set(found.undetermined)


@pytest.mark.parametrize(("holes", "other"), [("skip", "zero"), ("zero", "through"), ("through", "skip")])
def test_another_hole_convention_mismatches_at_advantages(
    tmp_path: Path, holes: str, other: str, capsys: pytest.CaptureFixture[str]
) -> None:
    made = setup_for(None, {"gae_holes": holes})
    path = str(save(tmp_path, naive_dump(holed_inputs(7), made), made))
    assert main([path, "--set", f"gae_holes={holes}"]) == 0
    capsys.readouterr()
    assert main([path, "--set", f"gae_holes={other}"]) == 1
    out = capsys.readouterr().out
    assert "first divergence at advantages" in out or "first divergence at returns" in out, out
    assert "padded" not in out, out  # a dump with holes never calls its masked positions "padded"
