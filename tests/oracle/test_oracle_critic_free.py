"""The oracle without a critic: ``group_index``, optional values, ``--set advantage=…`` presets.

Dumps of a critic-free step are built here from the naive twins of :mod:`refppo.core.group` (with
the KL folded into the score by plain loops), not from the pipeline the oracle runs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from oracle_helpers import HP, make_inputs

from refppo.conventions import Variance
from refppo.core.group_naive import group_advantages_naive
from refppo.core.policy import clipped_policy_loss
from refppo.dump.write import write_dump
from refppo.errors import ConventionError
from refppo.oracle.cli import main
from refppo.oracle.presets.registry import VARIANTS, critic_free_variant, resolve_preset
from refppo.pipeline.settings import FLAT, Convention

B = 8
GROUPS = torch.tensor([3, 1, 3, 1, 3, 1, 3, 1])  # two interleaved groups of 4


def _grpo_dump(beta: float = 0.1, eps: float = 1e-6) -> dict[str, torch.Tensor]:
    """verl-style GRPO step (KL folded into the score, no whitening), outputs from the naive twin."""
    x = make_inputs(B=B, T=10, seed=4)
    for k in ("old_values", "values", "entropy"):
        x.pop(k)
    m = x["response_mask"].bool()
    o, r = x["old_logprobs"].tolist(), x["ref_logprobs"].tolist()
    folded = [
        float(x["scores"][i]) - beta * sum(o[i][t] - r[i][t] for t in range(10) if m[i, t]) for i in range(B)
    ]
    adv = group_advantages_naive(
        torch.tensor(folded, dtype=torch.float64), GROUPS, m, estimator="grpo", eps=eps
    )
    kl = [[o[i][t] - r[i][t] if m[i, t] else 0.0 for t in range(10)] for i in range(B)]
    last = [int(m[i].sum()) - 1 for i in range(B)]
    rewards = [
        [(float(x["scores"][i]) if t == last[i] else 0.0) - beta * kl[i][t] for t in range(10)]
        for i in range(B)
    ]
    outs = {
        "kl": torch.tensor(kl, dtype=torch.float64),
        "token_rewards": torch.tensor(rewards, dtype=torch.float64),
    }
    return {**x, **outs, "group_index": GROUPS.clone(), "advantages": adv, "returns": adv.clone()}


def _write(tmp: Path, d: dict[str, torch.Tensor], hp: dict[str, float] | None = None) -> Path:
    path = tmp / "step.safetensors"
    write_dump(path, d, hparams={**HP, "kl_coef": 0.1, **(hp or {})})
    return path


def _diff(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("preset", ["verl", "skyrl"])
def test_grpo_dump_matches_the_peer_variant_and_not_gae(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], preset: str
) -> None:
    p = _write(tmp_path, _grpo_dump())
    extra = ["--set", "kl_in=reward", "--set", "kl_estimator=k1"] if preset == "skyrl" else []
    rc, out, _ = _diff(capsys, str(p), "--preset", preset, "--set", "advantage=grpo", *extra)
    assert rc == 0, out
    # OpenRLHF's variant adds the KL as a return-to-go after grouping, eps 1e-9: it must differ.
    rc, out, _ = _diff(capsys, str(p), "--preset", "openrlhf", "--set", "advantage=grpo")
    assert rc == 1 and "first divergence" in out
    flip = ["--set", "group_kl=to_go"]
    rc, out, _ = _diff(capsys, str(p), "--preset", preset, "--set", "advantage=grpo", *flip, *extra)
    assert rc == 1


def test_the_advantage_can_come_from_the_sidecar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "step.safetensors"
    write_dump(p, _grpo_dump(), hparams={**HP, "kl_coef": 0.1}, convention={"advantage": "grpo"})
    rc, out, _ = _diff(capsys, str(p), "--preset", "verl")
    assert rc == 0, out
    assert "advantage=grpo" in out and "whiten_advantages=none" in out


@pytest.mark.parametrize(
    ("edit", "argv", "pattern"),
    [
        (
            "float_index",
            ["--set", "advantage=grpo"],
            r"group_index: expected an integer tensor, got dtype torch\.float",
        ),
        ("wide_index", ["--set", "advantage=grpo"], r"group_index: expected shape \[B\] = \[8\]"),
        ("no_index", ["--set", "advantage=rloo"], r"missing key 'group_index' \(advantage=rloo needs"),
        ("none", [], r"missing required key 'old_values' \(advantage=gae"),
        (
            "vf_loss",
            ["--set", "advantage=grpo"],
            r"missing required key 'old_values' .*\['vf_loss'\] are given",
        ),
        ("none", ["--preset", "trl", "--set", "advantage=rloo"], r"--preset trl: no critic-free estimator"),
        ("none", ["--set", "advantage=ppo"], r"advantage: unknown name 'ppo'"),
        ("none", ["--set", "group_eps=tiny"], r"group_eps: expected a number"),
    ],
)
def test_bad_critic_free_input_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: str, argv: list[str], pattern: str
) -> None:
    d = _grpo_dump()
    if edit == "float_index":
        d["group_index"] = d["group_index"].to(torch.float32)
    elif edit == "wide_index":
        d["group_index"] = d["group_index"].reshape(B, 1)
    elif edit == "no_index":
        d.pop("group_index")
    elif edit == "vf_loss":
        d["vf_loss"] = torch.tensor(0.5, dtype=torch.float64)
    rc, _, err = _diff(capsys, str(_write(tmp_path, d)), *argv)
    assert rc == 2
    assert len(err.strip().splitlines()) == 1
    assert re.search(pattern, err), err


def test_critic_free_report_has_no_value_quantities(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _grpo_dump()
    m = d["response_mask"].bool()
    # verl's policy loss (dual clip 3, log-ratio clamp 20), called on the core directly: no value term
    lp, old = d["logprobs"], d["old_logprobs"]
    pg = clipped_policy_loss(lp, old, d["advantages"], m, clip_low=0.2, dual_clip=3.0, log_ratio_clamp=20.0)
    d.update(pg_loss=pg.loss.detach().clone(), loss=pg.loss.detach().clone())
    argv = [
        str(_write(tmp_path, d, {"vf_coef": 0.5})),
        "--preset",
        "verl",
        "--set",
        "advantage=grpo",
        "--json",
    ]
    rc, out, _ = _diff(capsys, *argv)
    rep = json.loads(out)
    assert rc == 0
    assert {"advantages", "returns", "pg_loss", "loss"} <= set(rep["quantities"])
    assert not {"vf_loss", "vf_clipfrac"} & set(rep["quantities"])


def test_every_variant_is_a_valid_convention_with_a_source() -> None:
    fields = set(FLAT)
    for peer, ests in VARIANTS.items():
        for est, variant in ests.items():
            for key, (_, src) in variant.items():
                assert key in fields, (peer, est, key)
                assert len(src) > 10 and ("::" in src or ".py" in src), (peer, est, key, src)
            conv, _ = resolve_preset(peer, None, est)
            Convention.from_dict({k: v for k, v in conv.items() if k in FLAT})
            assert conv["advantage"] == est


def test_variants_state_what_the_peers_do() -> None:
    """Spot values from the peers' sources (spec/conventions.md, critic-free table)."""
    v, _ = resolve_preset("verl", None, "grpo")
    assert (v["whiten_advantages"], v["group_eps"], v["group_singleton"], v["group_kl"]) == (
        "none",
        1e-6,
        "score",
        "fold",
    )
    o, _ = resolve_preset("openrlhf", None, "reinforce++")
    assert (o["whiten_variance"], o["whiten_eps_at"], o["score_clip"]) == ("population", "clamp", 10.0)
    o, _ = resolve_preset("openrlhf", None, "grpo")
    assert (o["group_kl"], o["group_eps"], o["score_clip"]) == ("to_go", 1e-9, None)
    s, _ = resolve_preset("skyrl", None, "rloo")
    assert s["group_singleton"] == "zero" and s["kl_in"] == "loss"
    assert resolve_preset("verl", None, "gae")[0] == resolve_preset("verl")[0] | {"advantage": "gae"}
    assert critic_free_variant("refppo", "rloo") == {"advantage": "rloo"}
    with pytest.raises(ConventionError, match="areal: no critic-free estimator"):
        critic_free_variant("areal", "reinforce++")
    assert Variance.UNBIASED.value == v["group_std"]


def test_text_report_names_group_options_only_without_gae(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grpo = str(_write(tmp_path, _grpo_dump()))
    _, out, _ = _diff(capsys, grpo, "--preset", "verl", "--set", "advantage=grpo", "-v")
    assert "group_kl=fold" in out and "group_eps=1e-06" in out
    # without -v the line shows what differs from the preset as written, with its source
    _, out, _ = _diff(capsys, grpo, "--preset", "verl", "--set", "advantage=grpo")
    line = next(ln for ln in out.splitlines() if ln.startswith("convention:"))
    assert "advantage=grpo (--set)" in line and "whiten_advantages=none (preset)" in line, line
    assert "group_kl=" not in line and line.endswith("the rest preset verl's (-v lists every key)"), line
    x = make_inputs(B=4, T=6, seed=1)
    p = tmp_path / "gae.safetensors"
    write_dump(p, x, hparams=HP)
    _diff(capsys, str(p))  # inputs only: exit 2, nothing to compare
    write_dump(p, {**x, "pg_loss": torch.tensor(0.1, dtype=torch.float64)}, hparams=HP)
    _, out, _ = _diff(capsys, str(p), "-v")
    line = next(ln for ln in out.splitlines() if ln.startswith("convention:"))
    assert "advantage=gae" in line and "group_" not in line


def test_critic_free_gradient_is_checked_without_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """dump v2's ``grad_logprobs`` of a GRPO step: ∂pg_loss/∂logprobs from the core directly (autograd)."""
    d = _grpo_dump()
    m = d["response_mask"].bool()
    lp = d["logprobs"].clone().requires_grad_(True)
    pg = clipped_policy_loss(
        lp, d["old_logprobs"], d["advantages"], m, clip_low=0.2, dual_clip=3.0, log_ratio_clamp=20.0
    )
    (g,) = torch.autograd.grad(pg.loss, lp)
    d["grad_logprobs"] = torch.where(m, g, torch.zeros((), dtype=torch.float64))
    argv = ["--preset", "verl", "--set", "advantage=grpo", "--json"]
    rc, out, _ = _diff(capsys, str(_write(tmp_path, d, {"vf_coef": 0.5})), *argv)
    assert rc == 0 and "grad_logprobs" in json.loads(out)["quantities"], out
    d["grad_logprobs"] = 2.0 * d["grad_logprobs"]  # a normaliser off by 2
    rc, _, _ = _diff(capsys, str(_write(tmp_path, d, {"vf_coef": 0.5})), *argv)
    assert rc == 1


def test_detect_on_a_critic_free_dump_without_advantage_finds_the_estimator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--preset verl --detect`` with no ``advantage`` set: the checked convention (GAE) cannot run
    without ``old_values``, which is its verdict (exit 1, said in the diagnosis), and the search still
    runs and lists the generating estimator (was: exit 2 before detecting)."""
    p = _write(tmp_path, _grpo_dump())
    rc, out, err = _diff(capsys, str(p), "--preset", "verl", "--detect", "--json")
    assert rc == 1, err
    rep = json.loads(out)
    assert rep["match"] is False and rep["first_divergence"] == "inputs" and rep["quantities"] == {}
    assert any("missing required key 'old_values'" in d for d in rep["diagnosis"])
    grpo = [c for c in rep["detected"] if c["advantage"] == "grpo"]
    assert grpo and all(c["group_kl"] == "fold" and c["whiten_advantages"] == "none" for c in grpo)
    assert not any(c["advantage"] == "gae" for c in rep["detected"])
    rc, out, _ = _diff(capsys, str(p), "--preset", "verl", "--detect")
    assert rc == 1 and "cannot run on this dump's inputs" in out and "advantage=grpo" in out
    # without --detect it stays bad input (one line, exit 2)
    rc, _, err = _diff(capsys, str(p), "--preset", "verl")
    assert rc == 2 and "missing required key 'old_values'" in err
