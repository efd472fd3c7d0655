"""``--detect``'s update-stage work by row blocks (issue #9, "Scale": peak RSS of ``--detect``).

Above :data:`refppo.pipeline.blocks.ROW_BLOCK_ELEMENTS` the walk evaluates the policy and value stages
by row blocks (``Search.ev``: :mod:`refppo.core.by_rows`, no whole-batch ``[B, T]`` temporaries) and
:func:`refppo.oracle.check.recompute.vf_tie_widen` counts its ties by blocks. The detection must be
the one the whole-batch core functions give, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs, refppo_dump, save, setup_for

import refppo.pipeline.update as update_mod
from refppo.dump.load import load_dump
from refppo.oracle.check.recompute import vf_tie_mask, vf_tie_widen
from refppo.oracle.detect.detection import detect
from refppo.pipeline import blocks as m_blocks

B, T = 8, 16


class _BigOutputs(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op whose output has at least ``numel`` elements and is a new allocation."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.allocating: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for o in outs:
            if isinstance(o, torch.Tensor) and o.numel() >= self.numel:
                name = str(func.overloadpacket.__name__)
                if not (name.endswith("_") or name.startswith(("detach", "alias", "slice", "view"))):
                    self.allocating.append(str(func))
        return out


@pytest.mark.parametrize("case", [("trl", "verl"), ("openrlhf", None), ("verl", "trl")])
def test_detection_by_row_blocks_equals_the_whole_batch_core(
    case: tuple[str, str | None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of 2 rows: the stages the walk evaluates never call the whole-batch
    ``clipped_policy_token_loss``/``value_token_loss`` (the policy solver aside: it runs only when
    nothing matches), and the detection equals the one computed with those core functions on the
    whole batch (``ROW_BLOCK_ELEMENTS`` above ``B·T``)."""
    made, checked = case
    d = refppo_dump(make_inputs(B=B, T=T, seed=5), setup_for(made), dtype=torch.float32)
    dump = load_dump(save(tmp_path, d, setup_for(made)))
    start = setup_for(checked)
    monkeypatch.setattr(m_blocks, "ROW_BLOCK_ELEMENTS", 10**9)
    whole = detect(dump, start)

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("whole-batch loss called above ROW_BLOCK_ELEMENTS")

    monkeypatch.setattr(m_blocks, "ROW_BLOCK_ELEMENTS", 2 * T)
    monkeypatch.setattr(update_mod, "clipped_policy_token_loss", refuse)
    monkeypatch.setattr(update_mod, "value_token_loss", refuse)
    blocks = detect(dump, start)
    assert whole.n_detected > 0
    assert repr(vars(blocks)) == repr(vars(whole))


def test_vf_tie_widen_counts_by_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The share equals the whole-batch :func:`vf_tie_mask` count (called directly), and no
    ``[B, T]``-sized tensor is allocated (the old code allocated about twelve)."""
    g = torch.Generator().manual_seed(0)
    eps = 0.2
    old = torch.randn(B, T, generator=g)
    step = torch.randint(-2, 3, (B, T), generator=g).float() * 0.1  # |V − V_old| = ε on many tokens
    values = old + step
    returns = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    rtol = 1e-5
    near = vf_tie_mask(values, old, returns, mask, eps, rtol)
    expected = float(near.sum().float() / mask.sum().float())
    assert 0.0 < expected < 1.0
    monkeypatch.setattr(m_blocks, "ROW_BLOCK_ELEMENTS", 3 * T)  # blocks of 3, 3, 2 rows
    rec = _BigOutputs(B * T)
    with rec:
        got = vf_tie_widen(values, old, returns, mask, eps, rtol)
    assert got == expected
    assert rec.allocating == []
