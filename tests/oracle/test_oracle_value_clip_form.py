"""``value_clip_form``: a float32 dump whose ``vf_clipfrac`` was counted with OpenRLHF's clipped value.

OpenRLHF 0.11.2 ``ValueLoss`` (and SkyRL-train, AReaL) clip the value as ``V_old + clamp(V − V_old,
±ε_v)``; verl and refppo's default as ``clamp(V, V_old ± ε_v)``. Equal in exact arithmetic, the two
count a different ``vf_clipfrac`` in float32 where ``V − V_old`` rounds. The dump's value-loss
quantities are computed here with numpy float32 in OpenRLHF's form (not with refppo's code).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from oracle_helpers import setup_for

from refppo.dump.load import load_dump
from refppo.dump.write import write_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.detect.detection import detect

HP = {"gamma": 1.0, "lam": 1.0, "kl_coef": 0.0, "cliprange": 0.2, "cliprange_value": 0.2, "vf_coef": 0.1}
# One valid token per row (position 0), so with β = 0 and γ = 1 the return R is the score itself.
#   row 0: V_old 0.1, V −0.05, R −0.04: inside the range; delta form one float32 step below V -> counted
#   row 1: V_old 0.5, V 0.5, R 0: no move, not counted
#   row 2: V_old 0.0, V 0.6, R 1.0: outside the range, V_clip = 0.2 farther from R -> counted (both forms)
#   row 3: V_old 0.3, V 0.35, R 2.0: inside, V − V_old exact (Sterbenz) -> not counted (both forms)
V_OLD = [0.1, 0.5, 0.0, 0.3]
V = [-0.05, 0.5, 0.6, 0.35]
R = [-0.04, 0.0, 1.0, 2.0]
T = 3


def _openrlhf_value_loss_float32() -> tuple[float, float]:
    """½·token-mean of max((V_clip − R)², (V − R)²) and the clipped share, OpenRLHF's form, float32."""
    f32 = np.float32
    v, vo, r, eps = (np.array(x, dtype=f32) for x in (V, V_OLD, R, [0.2]))
    v_clip = vo + np.clip(v - vo, -eps[0], eps[0])
    surr1, surr2 = (v_clip - r) ** 2, (v - r) ** 2
    loss = f32(0.5) * np.maximum(surr1, surr2).mean(dtype=f32)
    return float(loss), float((surr1 > surr2).mean(dtype=f32))


def _dump(tmp_path: Path) -> Path:
    B = len(V)
    mask = torch.zeros(B, T, dtype=torch.uint8)
    mask[:, 0] = 1

    def col(x: list[float], junk: float) -> torch.Tensor:
        t = torch.full((B, T), junk, dtype=torch.float32)
        t[:, 0] = torch.tensor(x, dtype=torch.float32)
        return t

    vf_loss, vf_clipfrac = _openrlhf_value_loss_float32()
    assert vf_clipfrac == 0.5  # rows 0 and 2 (the construction above)
    tensors = {
        "response_mask": mask,
        "old_logprobs": col([-1.0] * B, 1.0),
        "ref_logprobs": col([-1.1] * B, 1.0),
        "old_values": col(V_OLD, 9.0),
        "values": col(V, 9.0),
        "scores": torch.tensor(R, dtype=torch.float32),
        "vf_loss": torch.tensor(vf_loss, dtype=torch.float32),
        "vf_clipfrac": torch.tensor(vf_clipfrac, dtype=torch.float32),
    }
    path = tmp_path / "openrlhf_value.safetensors"
    write_dump(path, tensors, hparams=HP)
    return path


def test_openrlhf_form_dump_matches_only_with_delta(tmp_path: Path) -> None:
    dump = load_dump(_dump(tmp_path))
    around = check(dump, setup_for(hp=HP))
    assert around.first_divergence == "vf_clipfrac"  # one token counted apart: 1/4 off, no tie widening
    assert around.quantities["vf_loss"].ok  # the loss differs by rounding only
    text = "\n".join(around.diagnosis)
    assert "value_clip_form=delta" in text and "as in preset openrlhf" in text
    delta = check(dump, setup_for(conv={"value_clip_form": "delta"}, hp=HP))
    assert delta.match, delta.diagnosis
    assert check(dump, setup_for("openrlhf", hp=HP)).match
    assert not check(dump, setup_for("verl", hp=HP)).match


def test_detect_names_the_delta_form(tmp_path: Path) -> None:
    dump = load_dump(_dump(tmp_path))
    found = detect(dump, setup_for(hp=HP))
    assert found.detected
    assert {c["value_clip_form"] for c in found.detected} == {"delta"}


def test_vf_tie_widen_is_zero_on_an_empty_value_mask() -> None:
    """No value-mask token: nothing to widen (0.0), not 0/0 = NaN."""
    from refppo.oracle.check.ties import vf_tie_widen

    z = torch.zeros(2, 3, dtype=torch.float64)
    none = torch.zeros(2, 3, dtype=torch.bool)
    assert vf_tie_widen(z, z, z, none, 0.2, 1e-6) == 0.0
    assert vf_tie_widen(z, z, z, none, 0.2, 1e-6, "delta") == 0.0
