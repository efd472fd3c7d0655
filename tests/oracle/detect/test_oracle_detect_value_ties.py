"""``--detect``'s value step widens ``vf_clipfrac`` by the walked clip form (issue #23 item 5).

A float32 dump whose ``vf_clipfrac`` a trainer counted in the ``delta`` form (``V_old + clamp(V −
V_old, ±ε_v)``, AReaL 1.0.4 ``ppo_critic_loss_fn``) on its own returns, one float32 step off the
reference's on one token inside the clip range: there ``V^clip`` is one rounding step off ``V`` and
the strict ``>`` of the count reads the last bit of ``R``
(:func:`refppo.oracle.check.ties.delta_rounding_ties`;
the token is AReaL's own, ``tests/peers/test_peer_value_clip_ties.py``). The check widens the count
under ``delta`` only; the walk merged the two forms' options by their values and widened by the
first form's rule, so ``--detect`` listed nothing. The dump's value quantities are computed here
with numpy float32 in the trainer's form (not with refppo's code). One valid token per row, γ = λ
= 1, β = 0: the return is the score, rounded through ``(s − V_old) + V_old`` by the reference's GAE.
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

EPS_V = 0.5
HP = {"gamma": 1.0, "lam": 1.0, "kl_coef": 0.0, "cliprange": 0.2, "cliprange_value": EPS_V, "vf_coef": 0.1}
# row 0: AReaL's token (V, V_old, the trainer's R; the reference's R is one float32 step below);
# row 1: V − V_old = −0.15 inside the range, delta's V^clip one step below V, R −0.049: counted by
#        delta beyond rounding (not a tie), not by around_old (there V^clip is V).
V = [-0.05599406734108925, -0.05]
V_OLD = [-0.4470992684364319, 0.1]
R_TRAINER = [-0.6767054796218872, -0.049]
T = 2


def _f32(x: list[float]) -> np.ndarray:
    return np.array(x, dtype=np.float32)


def _trainer_value_loss() -> tuple[float, float]:
    """½·token-mean of max((V^clip − R)², (V − R)²) and the share counted ``>``, delta form, float32."""
    v, vo, r = _f32(V), _f32(V_OLD), _f32(R_TRAINER)
    v_clip = vo + np.clip(v - vo, np.float32(-EPS_V), np.float32(EPS_V))
    e_clip, e = (v_clip - r) ** 2, (v - r) ** 2
    return float(np.float32(0.5) * np.maximum(e_clip, e).mean(dtype=np.float32)), float((e_clip > e).mean())


def _score_for(r: float, vo: float) -> float:
    """A float32 score ``s`` whose reference return ``(s − V_old) + V_old`` is the float32 step of
    ``r`` toward −∞ (the reference's R of AReaL's token)."""
    want = np.nextafter(np.float32(r), np.float32(-1.0))
    for k in range(-4, 5):
        s = np.float32(r)
        for _ in range(abs(k)):
            s = np.nextafter(s, np.float32(np.sign(k)))
        if (s - np.float32(vo)) + np.float32(vo) == want:
            return float(s)
    raise AssertionError("no score rounds to the reference's return")


def _dump(tmp_path: Path) -> Path:
    B = len(V)
    mask = torch.zeros(B, T, dtype=torch.uint8)
    mask[:, 0] = 1

    def col(x: list[float], junk: float) -> torch.Tensor:
        t = torch.full((B, T), junk, dtype=torch.float32)
        t[:, 0] = torch.tensor(x, dtype=torch.float32)
        return t

    vf_loss, vf_clipfrac = _trainer_value_loss()
    assert vf_clipfrac == 1.0  # both rows counted by the trainer (the construction above)
    scores = [_score_for(R_TRAINER[0], V_OLD[0]), R_TRAINER[1]]
    tensors = {
        "response_mask": mask,
        "old_logprobs": col([-1.0] * B, 1.0),
        "ref_logprobs": col([-1.1] * B, 1.0),
        "old_values": col(V_OLD, 9.0),
        "values": col(V, 9.0),
        "scores": torch.tensor(scores, dtype=torch.float32),
        "vf_loss": torch.tensor(vf_loss, dtype=torch.float32),
        "vf_clipfrac": torch.tensor(vf_clipfrac, dtype=torch.float32),
    }
    path = tmp_path / "delta_ties.safetensors"
    write_dump(path, tensors, hparams=HP)
    return path


def test_the_delta_tie_dump_matches_under_delta_only(tmp_path: Path) -> None:
    dump = load_dump(_dump(tmp_path))
    assert check(dump, setup_for(conv={"value_clip_form": "delta"}, hp=HP)).match
    around = check(dump, setup_for(hp=HP))
    assert around.first_divergence == "vf_clipfrac"  # row 1 counted apart, no tie there


def test_detect_lists_the_delta_form_and_not_around_old(tmp_path: Path) -> None:
    """Fails on the walk that widened a merged group by its first option's form: it listed nothing."""
    dump = load_dump(_dump(tmp_path))
    det = detect(dump, setup_for(hp=HP), limit=100000)
    assert det.detected, (det.unmatched_stages, det.nearest)
    assert {c["value_clip_form"] for c in det.detected} == {"delta"}
    assert {c["value_loss"] for c in det.detected} == {"clipped"}
