"""``--preset trl|areal --set advantage=…``: TRL GRPOTrainer's and AReaL's group normalisation.

Without the peers' venvs (``tests/peers/test_peer_grpo_trl_areal.py`` runs their own code): each dump
is built here by plain Python loops from the peer's equation, not from refppo's pipeline or core:

- TRL 1.12.0 / 1.16.0 ``GRPOTrainer._generate_and_score_completions`` (``scale_rewards="group"``):
  contiguous groups of ``num_generations`` rows, ``a_i = (r_i − mean_G)/(std_G + 1e-4)`` with the
  unbiased std (``trl/trainer/utils.py::nanstd``); ``"none"``: ``r_i − mean_G``; the loss is
  ``_compute_loss``'s ``dapo`` form on one process (Σ clipped·mask / Σ mask), β = 0.
- AReaL 1.0.4 ``Normalization`` with ``mean_level = std_level = "group"``: the same with
  ``eps = 1e-5``, then ``_compute_advantages``' GAE over zero values with γ = λ = 1 and
  ``kl_ctl = 0``: the normalised score on every valid token.
- The batch std: TRL ``scale_rewards="batch"`` divides ``r_i − mean_G`` by the unbiased std of
  every reward around the batch mean; AReaL ``std_level = "batch"`` (mean ``group``) by the
  unbiased std over the batch of ``r_j − mean_G(j)`` (``Normalization._compute_std``, around 0).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from oracle_helpers import HP, make_inputs

from refppo.dump.write import write_dump
from refppo.oracle.cli import main
from refppo.oracle.presets.registry import resolve_preset

B, T, N = 8, 10, 4
EPS_HI = 0.28


def _group_norm(s: list[float], n: int, eps: float, scale: bool, std: str = "group") -> list[float]:
    def mean_of(i: int) -> float:
        g = s[(i // n) * n : (i // n + 1) * n]
        return sum(g) / len(g)

    out = []
    for i in range(len(s)):
        g = s[(i // n) * n : (i // n + 1) * n]
        mu = mean_of(i)
        if std == "group":
            sd = math.sqrt(sum((v - mu) ** 2 for v in g) / (len(g) - 1))
        elif std == "trl-batch":  # every reward around the batch mean
            mb = sum(s) / len(s)
            sd = math.sqrt(sum((v - mb) ** 2 for v in s) / (len(s) - 1))
        else:  # "areal-batch": every r_j − mean_G(j), around 0
            sd = math.sqrt(sum((s[j] - mean_of(j)) ** 2 for j in range(len(s))) / (len(s) - 1))
        out.append((s[i] - mu) / (sd + eps) if scale else s[i] - mu)
    return out


def _dump(eps: float, scale: bool, std: str = "group") -> dict[str, torch.Tensor]:
    """A GRPO step with the group normalisation above and a token-mean asymmetric-clip loss."""
    x = make_inputs(B=B, T=T, seed=11)
    for k in ("old_values", "values", "entropy"):
        x.pop(k)
    m = x["response_mask"].bool().tolist()
    a = _group_norm([float(v) for v in x["scores"]], N, eps, scale, std)
    lp, old = x["logprobs"].tolist(), x["old_logprobs"].tolist()
    total, count = 0.0, 0
    for i in range(B):
        for t in range(T):
            if m[i][t]:
                r = math.exp(lp[i][t] - old[i][t])
                clipped = min(max(r, 1 - HP["cliprange"]), 1 + EPS_HI)
                total += max(-a[i] * r, -a[i] * clipped)
                count += 1
    adv = [[a[i] if m[i][t] else 0.0 for t in range(T)] for i in range(B)]
    loss = torch.tensor(total / count, dtype=torch.float64)
    return {
        **x,
        "group_index": torch.arange(B, dtype=torch.int64) // N,
        "advantages": torch.tensor(adv, dtype=torch.float64),
        "pg_loss": loss,
        "loss": loss.clone(),
    }


def _diff(path: Path, *argv: str) -> int:
    return main([str(path), *argv])


@pytest.mark.parametrize(
    ("preset", "eps", "scale", "advantage", "flip"),
    [
        ("trl", 1e-4, True, "grpo", ["--set", "group_eps=1e-6"]),
        ("trl", 1e-4, True, "grpo", ["--set", "group_std=population"]),
        ("trl", 1e-4, False, "dr-grpo", ["--set", "advantage=grpo"]),
        ("areal", 1e-5, True, "grpo", ["--set", "group_eps=1e-4"]),
        ("areal", 1e-5, True, "grpo", ["--set", "group_std=population"]),
        ("areal", 1e-5, False, "dr-grpo", ["--set", "advantage=rloo"]),
    ],
)
def test_peer_group_normalisation_matches_the_variant_and_a_flip_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], preset: str, eps: float, scale: bool,
    advantage: str, flip: list[str],
) -> None:  # fmt: skip
    path = tmp_path / "step.safetensors"
    write_dump(path, _dump(eps, scale), hparams={**HP, "kl_coef": 0.0, "cliprange_high": EPS_HI})
    assert _diff(path, "--preset", preset, "--set", f"advantage={advantage}") == 0, capsys.readouterr().out
    assert _diff(path, "--preset", preset, "--set", f"advantage={advantage}", *flip) == 1


@pytest.mark.parametrize(
    ("preset", "eps", "std", "level", "flips"),
    [
        ("trl", 1e-4, "trl-batch", "batch", ("group", "batch-centred")),
        ("areal", 1e-5, "areal-batch", "batch-centred", ("group", "batch")),
    ],
)
def test_batch_std_matches_its_level_and_no_other_level(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], preset: str, eps: float, std: str, level: str,
    flips: tuple[str, str],
) -> None:  # fmt: skip
    """TRL ``scale_rewards="batch"`` is ``group_std_level=batch``, AReaL's group mean over a batch
    std is ``batch-centred``; the other two levels mismatch (the three stds differ on this batch)."""
    path = tmp_path / "step.safetensors"
    write_dump(path, _dump(eps, True, std), hparams={**HP, "kl_coef": 0.0, "cliprange_high": EPS_HI})
    base = ["--preset", preset, "--set", "advantage=grpo"]
    assert _diff(path, *base, "--set", f"group_std_level={level}") == 0, capsys.readouterr().out
    for other in flips:
        assert _diff(path, *base, "--set", f"group_std_level={other}") == 1, other


def test_trl_and_areal_variants_state_the_peers_values() -> None:
    """Spot values from the peers' sources (spec/conventions.md, critic-free table)."""
    t, _ = resolve_preset("trl", None, "grpo")
    assert (t["kl_in"], t["kl_estimator"], t["group_eps"], t["group_singleton"], t["loss_agg"]) == (
        "loss",
        "k3",
        1e-4,
        "zero",
        "token-mean",
    )
    a, _ = resolve_preset("areal", None, "rloo")
    assert (a["group_eps"], a["group_singleton"], a["group_kl"], a["whiten_advantages"]) == (
        1e-5,
        "score",
        "to_go",
        "none",
    )
    assert resolve_preset("areal", None, "grpo")[0]["group_singleton"] == "zero"
