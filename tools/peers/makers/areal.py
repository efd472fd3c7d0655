"""AReaL 1.0.4 dumps from its own functions (run with the ``skyrl-areal`` venv's python).

Called (through :mod:`peers.makers.areal_frame`):
``areal/trainer/ppo/actor.py::PPOActor._compute_advantages`` (score bias/scale/clip, the KL reward,
the score slot, GAE, ``adv_norm``) on a stand-in ``self`` holding the attributes its ``__init__``
sets; ``areal/utils/data.py::KLEstimator`` and ``Normalization``;
``areal/utils/functional/functional.py::ppo_actor_loss_fn`` and ``ppo_critic_loss_fn``.

AReaL works on prompt + response sequences whose log-probs are shifted by one (``torch.roll``). The
batch here has a one-token prompt and width ``T + 2``, so in AReaL's rolled frame the response sits
at positions ``0..L−1`` and every row keeps at least one padded slot (no row is "truncated": AReaL
bootstraps a truncated row from a value beyond the response, which a response-only dump lacks).
AReaL asserts float32 in its critic loss, so the dumps are float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peers.makers import holes
from peers.makers.areal_frame import Norm, advantages, areal_fns, rolled_batch, step_dump
from peers.makers.common import HP as COMMON_HP
from peers.makers.common import inputs, save

HP: dict[str, float] = {**COMMON_HP, "whiten_eps": 1e-5}

# (name, kl_estimator, adv_norm (mean_level, std_level, unbiased) or None, reward (bias, scale, clip),
#  eps_clip_higher, c_clip); the second case uses NormConfig.eps = 0.1 (EPS_CASES) so that σ + eps and
#  sqrt(σ² + eps) differ beyond float32 rounding.
CASES: list[tuple[str, str, Norm, tuple[float, float, float], float | None, float | None]] = [
    ("default_k1", "k1", None, (0.0, 1.0, 20.0), None, None),
    ("k3_advnorm_asym_dualclip", "k3", ("batch", "batch", True), (0.0, 1.0, 20.0), 0.28, 3.0),
    ("k2_center_reward_affine", "k2", ("batch", None, True), (0.5, 2.0, 5.0), None, None),
    ("k1_scale_population_c2", "k1", (None, "batch", False), (-0.3, 0.5, 20.0), None, 2.0),
    ("k3_advnorm_population", "k3", ("batch", "batch", False), (0.0, 1.0, 3.0), 0.3, None),
]


EPS_CASES: dict[str, float] = {"k3_advnorm_asym_dualclip": 0.1}
CONTROLS: dict[str, dict[str, Any]] = {
    # flipping the option each case exercises must break the match
    "default_k1": {"approx_kl": "k1"},
    "k3_advnorm_asym_dualclip": {"whiten_eps_at": "variance"},
    "k2_center_reward_affine": {"score_bias": 0.0},
    "k1_scale_population_c2": {"whiten_advantages": "masked"},
    "k3_advnorm_population": {"whiten_variance": "unbiased"},
}


def _norm_key(norm: Norm) -> dict[str, Any]:
    if norm is None:
        return {"whiten_advantages": "none"}
    mean_level, std_level, unbiased = norm
    kind = "masked" if mean_level and std_level else ("center" if mean_level else "scale")
    return {"whiten_advantages": kind, "whiten_variance": "unbiased" if unbiased else "population"}


def make(out: Path) -> list[str]:
    """One dump per case of :data:`CASES` (:mod:`peers.makers.areal_frame`), then the multi-turn
    cases of :func:`peers.makers.holes.areal_cases`."""
    import torch

    fns = areal_fns()
    made = []
    for i, (name, est, norm, reward, eps_hi, c_clip) in enumerate(CASES):
        x = inputs(500 + i, dtype=torch.float32, full_row=False)
        eps = EPS_CASES.get(name, HP["whiten_eps"])
        res = advantages(fns, rolled_batch(x, x["response_mask"]), HP, est, norm, eps, reward)
        dump = step_dump(fns, x, res, HP, est, eps_hi, c_clip)
        hp = dict(HP, whiten_eps=eps)
        if eps_hi is not None:
            hp["cliprange_high"] = eps_hi
        bias, scale, rclip = reward
        conv: dict[str, Any] = {
            "kl_estimator": est,
            "score_bias": bias,
            "score_scale": scale,
            "score_clip": rclip,
        }
        conv.update(_norm_key(norm))
        if c_clip is not None:
            conv["dual_clip"] = c_clip
        made.append(save(out, f"areal_{name}", dump, hp, conv, CONTROLS[name]))
    return made + holes.areal_cases(fns, out, HP)
