"""The peers' OWN rollout-correction code on one batch vs refppo's core (refppo/core/rollout_*.py, cispo.py).

``tools/peers rollout_correction`` (``tests/peers/test_peer_rollout_correction.py`` runs it when the
side venvs exist). A ``batch`` request of :mod:`peers.harness`; the peers' half is
:mod:`peers.rollout_correction_side`. Per case the peer's weights / kept masks, loss, ``∂loss/∂logp``
and (where it reports one) clip fraction are compared with refppo's core called directly, each with a
CONTROL (one convention flipped) that must mismatch:

- verl 0.9.1 ``verl/trainer/ppo/rollout_corr_helper.py``: ``compute_rollout_correction_weights``
  (``rollout_is`` token / sequence × TIS ``2.0`` / IcePop ``"0.5_2.0"``), ``compute_rollout_rejection_mask``
  (``rollout_rs`` token/seq_sum/seq_mean/seq_max × k1/k2/k3); ``core_algos.py``:
  ``compute_policy_loss_vanilla`` with ``rollout_is_weights`` and with a rejected ``response_mask``,
  ``compute_policy_loss_cispo``, ``compute_policy_loss_bypass_mode`` (``loss_type: reinforce``);
- OpenRLHF 0.11.2 ``openrlhf/models/loss.py::PolicyLoss`` (``is_correction_level`` token / seq,
  ``mode`` clip / mask, ``gating: ratio``);
- AReaL 1.0.4 ``areal/utils/functional/functional.py::ppo_actor_loss_fn`` (decoupled loss,
  ``rejection_sampling``: ratio / kl_k1 / kl_k3 / kl_k2, token / sequence, mask / clamp, sum / mean / max);
- SkyRL-train 0.3.1 ``skyrl_train/utils/ppo_utils.py::ppo_policy_loss`` (``use_tis``,
  ``tis_imp_ratio_cap``) and ``compute_policy_loss_cispo``;
- TRL 1.16.0 ``GRPOTrainer``: the ``vllm_importance_sampling_ratio`` lines of
  ``_generate_and_score_completions`` (run verbatim, :func:`peers.rollout_correction_side.trl_is_ratio`)
  and ``_compute_loss`` with that ratio (``loss_type`` grpo / bnpo / cispo; ``beta`` with
  ``use_bias_correction_kl``).

Batch (float64, B = 8, T = 10, seed 0): lengths 10, 7, 4, 1, 10, 5, 3, 8; ``l^prox − l^beh`` = a row
offset + U(−0.6, 0.6) (token weights on both sides of every bound, sequence products from ≈ 0.2 to ≈ 6),
``l − l^prox`` = a row offset + U(−0.5, 0.5) (every PPO clip region); finite junk 7.5 on the padding.
Tolerances (relative to ``max(1, |peer|)``): 1e-9 in float64; verl and OpenRLHF 1e-7 (their ``+ 1e-8``
denominators); SkyRL 1e-6 (it exponentiates in float32). AReaL computes the behaviour weight in
float32 (``.float()``): refppo's weight is computed from the float32-rounded log-probs, the rest in float64.
"""

from __future__ import annotations

from typing import Any

from peers.harness import Report, Unit, parser, root_of, run_venvs, selected, workdir

B, T, JUNK = 8, 10, 7.5
LENGTHS = (10, 7, 4, 1, 10, 5, 3, 8)
BEH_OFFSETS = (-0.1, 0.02, 0.05, 0.3, -0.03, 0.2, -0.4, 0.0)
"""Row offsets of ``l^prox − l^beh``."""
CUR_OFFSETS = (-0.3, 0.1, 0.2, 0.5, 0.0, -0.1, 0.25, -0.2)
"""Row offsets of ``l − l^prox``."""
EPS_LO, EPS_HI, DUAL = 0.2, 0.28, 3.0

VERL_WEIGHTS: tuple[tuple[str, float | str], ...] = (
    ("token", 2.0), ("token", "0.5_2.0"), ("sequence", 2.0), ("sequence", "0.5_2.0"),
)  # fmt: skip
"""verl ``(rollout_is, rollout_is_threshold)``: a float is TIS (upper truncation), ``"lo_hi"`` IcePop."""
VERL_RS: tuple[tuple[str, float | str], ...] = (
    ("token_k1", "0.6_1.5"), ("token_k2", 0.08), ("token_k3", 0.08), ("seq_sum_k1", "0.5_2.0"),
    ("seq_mean_k1", "0.8_1.25"), ("seq_sum_k2", 0.4), ("seq_mean_k3", 0.05), ("seq_max_k2", 0.15),
    ("seq_max_k3", 0.15),
)  # fmt: skip
"""verl ``(rollout_rs, rollout_rs_threshold)``."""
AGGS = ("token-mean", "seq-mean-token-mean")
AGGS_DROP = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
AGGS_BYPASS = ("token-mean", "seq-mean-token-sum")
BYPASS_CAP = 2.0
OPENRLHF: tuple[tuple[str, str, tuple[float, float], bool, float | None], ...] = (
    ("token", "clip", (0.5, 1.5), True, None), ("token", "mask", (0.5, 1.5), True, DUAL),
    ("seq", "mask", (0.8, 1.25), False, None), ("seq", "mask", (0.8, 1.25), True, None),
)  # fmt: skip
"""OpenRLHF ``(is_correction_level, is_correction_mode, threshold, token_level_loss, dual_clip)``."""
AREAL: tuple[tuple[str, str, str, str, float | None, float, float | None], ...] = (
    ("token", "mask", "ratio", "mean", None, 1.5, None),
    ("token", "clamp", "ratio", "mean", 0.5, 1.5, DUAL),
    ("sequence", "mask", "ratio", "mean", 0.8, 1.25, None),
    ("sequence", "clamp", "ratio", "mean", 0.8, 1.25, None),
    ("sequence", "mask", "ratio", "sum", 0.5, 2.0, None),
    ("token", "mask", "kl_k3", "mean", None, 0.12, None),
    ("sequence", "mask", "kl_k1", "sum", -0.5, 0.5, DUAL),
    ("sequence", "mask", "kl_k2", "max", None, 0.15, None),
)
"""AReaL ``RejectionSamplingConfig(level, action, metric, agg, lower, upper)`` and ``c_clip``."""
SKYRL: tuple[tuple[str, str, float | None], ...] = (
    ("regular", "token_mean", 1.5), ("dual_clip", "sequence_mean", 1.5),
    ("regular", "seq_mean_token_sum_norm", 1.25), ("cispo", "token_mean", None),
)  # fmt: skip
"""SkyRL ``(policy_loss_type, loss_reduction, tis_imp_ratio_cap)`` (None: ``use_tis`` off)."""
TRL: tuple[tuple[str, str, tuple[float | None, float], float], ...] = (
    ("grpo", "token_truncate", (0.5, 2.0), 0.0), ("grpo", "token_mask", (0.5, 2.0), 0.0),
    ("bnpo", "sequence_truncate", (0.5, 2.0), 0.0), ("grpo", "sequence_mask", (0.5, 2.0), 0.0),
    ("bnpo", "token_truncate", (None, 1.5), 0.04), ("cispo", "token_truncate", (0.5, 2.0), 0.0),
)  # fmt: skip
"""TRL ``(loss_type, vllm_importance_sampling_mode, (clip_min, clip_max), beta)``."""
TRL_CISPO_CAP = 2.0
"""TRL's ``epsilon_high`` for ``loss_type="cispo"``: the cap ``ε_max`` of ``min(ρ, ε_max)``."""

VENVS: dict[str, dict[str, Unit]] = {
    "verl-openrlhf": {
        "verl": Unit("verl", "peers.rollout_correction_side:peer_verl"),
        "openrlhf": Unit("openrlhf", "peers.rollout_correction_side:peer_openrlhf"),
    },
    "skyrl-areal": {
        "areal": Unit("areal", "peers.rollout_correction_side:peer_areal"),
        "skyrl": Unit("skyrl-train", "peers.rollout_correction_side:peer_skyrl"),
    },
    "trl-grpo": {"trl": Unit("trl", "peers.rollout_correction_side:peer_trl")},
}
"""Side venv → unit → (distribution, peer-side function)."""
SETUP = {
    "verl-openrlhf": "peers.rollout_correction_side:peer_setup",
    "skyrl-areal": "peers.rollout_correction_side:areal_setup",
    "trl-grpo": None,
}


def verl_weights_key(level: str, thr: float | str) -> str:
    return f"verl/weights/{level}/{thr}"


def verl_rs_key(opt: str, thr: float | str) -> str:
    return f"verl/rs/{opt}/{thr}"


def verl_weighted_cases() -> list[tuple[tuple[str, float | str], str]]:
    return [(w, agg) for w in (("token", 2.0), ("sequence", "0.5_2.0")) for agg in AGGS]


def verl_weighted_key(level: str, thr: float | str, agg: str) -> str:
    return f"verl/weighted/{level}/{thr}/{agg}"


def verl_drop_cases() -> list[tuple[tuple[str, float | str], str]]:
    return [(rs, agg) for rs in (("token_k1", "0.6_1.5"), ("seq_max_k2", 0.15)) for agg in AGGS_DROP]


def verl_drop_key(opt: str, thr: float | str, agg: str) -> str:
    return f"verl/drop/{opt}/{thr}/{agg}"


def verl_cispo_cases() -> list[tuple[bool, str]]:
    return [(weighted, agg) for weighted in (False, True) for agg in AGGS]


def verl_cispo_key(weighted: bool, agg: str) -> str:
    return f"verl/cispo/{'tis' if weighted else 'plain'}/{agg}"


def verl_bypass_key(agg: str) -> str:
    return f"verl/bypass_reinforce/{agg}"


def openrlhf_key(
    level: str, mode: str, bounds: tuple[float, float], token_level: bool, dual: float | None
) -> str:
    return f"openrlhf/{level}/{mode}/{bounds[0]}_{bounds[1]}/{'token' if token_level else 'seq'}/dual={dual}"


def areal_key(case: tuple[str, str, str, str, float | None, float, float | None]) -> str:
    level, action, metric, agg, lower, upper, c_clip = case
    return f"areal/{level}/{action}/{metric}/{agg}/{lower}_{upper}/c={c_clip}"


def skyrl_key(kind: str, reduction: str, cap: float | None) -> str:
    return f"skyrl/{kind}/{reduction}/tis={cap}"


def trl_key(case: tuple[str, str, tuple[float | None, float], float]) -> str:
    lt, mode, (lo, hi), beta = case
    return f"trl/{lt}/{mode}/{lo}_{hi}/beta={beta}"


def trl_eps_high(loss_type: str) -> float:
    return TRL_CISPO_CAP if loss_type == "cispo" else EPS_HI


def make_batch(seed: int = 0) -> dict[str, Any]:
    """The batch of the module docstring (plain tensors only)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    mask = torch.arange(T).expand(B, T) < torch.tensor(LENGTHS).unsqueeze(1)

    def spread(offsets: tuple[float, ...], half: float) -> Any:
        noise = (torch.rand(B, T, generator=g, dtype=f64) - 0.5) * 2 * half
        return torch.tensor(offsets, dtype=f64).unsqueeze(1) + noise

    beh = torch.rand(B, T, generator=g, dtype=f64) * -3.5 - 0.5
    prox = beh + spread(BEH_OFFSETS, 0.6)
    cur = prox + spread(CUR_OFFSETS, 0.5)
    ref = prox + spread((0.0,) * B, 0.3)
    adv = torch.randn(B, T, generator=g, dtype=f64)
    junk = torch.tensor(JUNK, dtype=f64)
    out = {
        k: torch.where(mask, v, junk) for k, v in {"beh": beh, "prox": prox, "cur": cur, "ref": ref}.items()
    }
    return out | {"mask": mask.to(f64), "adv": torch.where(mask, adv, junk)}


def main(argv: list[str] | None = None) -> int:
    from peers.rollout_correction_ref import compare

    args = parser("rollout_correction", __doc__, list(VENVS)).parse_args(argv)
    report = Report("rollout_correction")
    x = make_batch()
    with workdir(args.keep) as work:
        for venv, units in selected(args, VENVS).items():
            runs = run_venvs(report, {venv: units}, root_of(args), work, batch=x, setup=SETUP[venv])
            for unit, out, _ in runs:
                import torch

                got = torch.load(out / f"result-{unit}.pt", weights_only=True)
                for case in compare(unit, x, got):
                    report.add(case)
    return report.finish(args.json_out)
