"""Dump v2: the oracle checks the gradient of the whole optimizer step and names what is off.

The dumps come from the small hand-written trainer of ``grad_helpers`` (2 ranks simulated in one
process × 2 micro-batches of unequal token counts, DDP's 1/W applied by hand); each bug is injected
there, from its definition. Expected factors are computed here from the row layout alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from grad_helpers import (
    LENGTHS,
    MICRO,
    ONE_RANK_THREE_MB,
    RANK,
    TWO_RANKS_TWO_MB,
    Bugs,
    Layout,
    save_step,
    step_dump,
)

from refppo.oracle.cli import main

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
TWO_RANKS_ONE_MB = Layout(rank=tuple(RANK), micro=(0,) * 8, W=2, K=1)


def run(
    tmp: Path,
    d: dict[str, torch.Tensor],
    capsys: pytest.CaptureFixture[str],
    conv: dict[str, Any] | None = None,
    layout: Layout = TWO_RANKS_TWO_MB,
    **extra: Any,
) -> tuple[int, dict[str, Any]]:
    path = save_step(tmp, d, conv, layout, **extra)
    rc = main([str(path), "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out) if out else {}


@pytest.mark.parametrize("mode", MODES)
def test_correct_step_matches_every_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    conv = {"loss_agg": mode}
    rc, rep = run(tmp_path, step_dump(conv), capsys, conv)
    assert rc == 0, rep["diagnosis"]
    assert list(rep["quantities"])[-2:] == ["grad_logprobs", "grad_values"]  # pipeline order, after loss
    assert all(q["ok"] for q in rep["quantities"].values())
    assert (rep["dump"]["world_size"], rep["dump"]["micro_batches"], rep["dump"]["separate_critic"]) == (
        2,
        2,
        False,
    )


@pytest.mark.parametrize("layout", [ONE_RANK_THREE_MB, TWO_RANKS_ONE_MB], ids=["1x3", "2x1"])
def test_correct_step_matches_other_layouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: Layout
) -> None:
    rc, rep = run(tmp_path, step_dump(layout=layout), capsys, layout=layout)
    assert rc == 0, rep["diagnosis"]


def test_correct_step_matches_in_float32_and_with_kl_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, rep = run(tmp_path, step_dump(dtype=torch.float32), capsys)
    assert rc == 0 and rep["dump"]["dtype"] == "float32", rep["diagnosis"]
    conv = {"kl_in": "loss", "kl_estimator": "k3"}
    rc, rep = run(tmp_path, step_dump(conv), capsys, conv)
    assert rc == 0, rep["diagnosis"]


@pytest.mark.parametrize("seed", [11, 29, 36])  # the dual clip binds on 2, 3 and 1 tokens
def test_correct_step_matches_with_dual_clip_over_seeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], seed: int
) -> None:
    conv = {"dual_clip": 1.3, "loss_agg": "seq-mean-token-sum"}
    d = step_dump(conv, seed=seed)
    ratio = torch.exp(d["logprobs"] - d["old_logprobs"])
    valid = d["response_mask"].bool()
    capped = valid & (d["advantages"] < 0) & (ratio > 1.3)
    assert bool(capped.any())  # the dual clip binds somewhere, so the control below must differ
    rc, rep = run(tmp_path, d, capsys, conv)
    assert rc == 0, rep["diagnosis"]
    d = step_dump({**conv, "dual_clip": None}, seed=seed)  # a trainer without the dual clip
    rc, rep = run(tmp_path, d, capsys, conv)
    assert rc == 1


def _group_factor_text(count: str) -> list[str]:
    """``micro-batch k of rank r: factor f`` with f = step count / (K·W·group count), from the layout."""
    out = []
    for r in (0, 1):
        for k in (0, 1):
            rows = [b for b in range(8) if RANK[b] == r and MICRO[b] == k]
            if count == "tokens":
                n_step, n = float(sum(LENGTHS)), float(sum(LENGTHS[b] for b in rows))
            else:
                n_step, n = 8.0, float(len(rows))
            if n_step != 4 * n:  # the groups holding a quarter of the step are not off
                out.append(f"micro-batch {k} of rank {r}: factor {n_step / (4 * n):.4g}")
    return out


def _summed_factor_text() -> list[str]:
    """Every group's factor N_step/(W·N_mb) (summed micro-batch means, DDP 1/W), from the layout."""
    out = []
    for r in (0, 1):
        for k in (0, 1):
            n = float(sum(LENGTHS[b] for b in range(8) if RANK[b] == r and MICRO[b] == k))
            out.append(f"micro-batch {k} of rank {r}: factor {sum(LENGTHS) / (2 * n):.4g}")
    return out


CASES: list[tuple[str, dict[str, Any], Bugs, Layout, str, str, list[str]]] = [
    (
        "per-micro-batch token-mean summed (verl without the global batch info)",
        {},
        Bugs(local_norm_summed=True),
        TWO_RANKS_TWO_MB,
        "grad_logprobs",
        "local_normaliser_summed",
        ["micro-batch losses are summed", *_summed_factor_text()],
    ),
    (
        "per-micro-batch token-mean averaged",
        {},
        Bugs(local_norm=True),
        TWO_RANKS_TWO_MB,
        "grad_logprobs",
        "local_normaliser",
        _group_factor_text("tokens"),
    ),
    (
        "per-micro-batch sequence count",
        {"loss_agg": "seq-mean-token-mean"},
        Bugs(local_norm=True),
        TWO_RANKS_TWO_MB,
        "grad_logprobs",
        "local_normaliser",
        ["own sequence count", *_group_factor_text("sequences")],
    ),
    (
        "summed where DDP averages",
        {},
        Bugs(ddp_sum=True),
        TWO_RANKS_ONE_MB,
        "grad_logprobs",
        "factor_W",
        ["constant factor W = 2", "summed over ranks where DDP averages", "rank 1: 2"],
    ),
    (
        "missing 1/accumulation",
        {},
        Bugs(missing_accum=True),
        ONE_RANK_THREE_MB,
        "grad_logprobs",
        "factor_K",
        ["constant factor K = 3", "1/K missing", "micro-batch 2 of rank 0: 3"],
    ),
    (
        "W = K: both readings",
        {},
        Bugs(missing_accum=True),
        TWO_RANKS_TWO_MB,
        "grad_logprobs",
        "factor_W = K",
        ["summed over ranks", "1/K missing"],
    ),
    (
        "per-rank normaliser",
        {},
        Bugs(rank_norm=True),
        TWO_RANKS_TWO_MB,
        "grad_logprobs",
        "rank_normaliser",
        [f"rank 0: factor {48 / (2 * 22):.4g}", f"rank 1: factor {48 / (2 * 26):.4g}"],  # 22 + 26 tokens
    ),
    (
        "padded positions counted by the token mean",
        {},
        Bugs(count_padding=True),
        TWO_RANKS_TWO_MB,
        "grad_logprobs",
        "loss_agg=seq-mean-token-sum-norm|padded_tokens_counted",  # Σ m·L/(B·T) is both, exactly
        ["(80 = B·T, not 48 tokens)"],
    ),
    (
        "sequence normalisation where the convention says token-mean",
        {},
        Bugs(loss_agg="seq-mean-token-mean"),
        TWO_RANKS_TWO_MB,
        "grad_logprobs",
        "loss_agg=seq-mean-token-mean",
        ["per-row factors range"],
    ),
    (
        "advantages not detached",
        {},
        Bugs(adv_not_detached=True),
        TWO_RANKS_TWO_MB,
        "grad_values",
        "advantages_not_detached",
        ["advantages are not detached"],
    ),
    (
        "advantages not detached, log-ratio clamp binding",
        {"log_ratio_clamp": 0.25},  # binds at |l − l_old| > 0.25 (exp(0.25) > 1 + ε: clipped there too)
        Bugs(adv_not_detached=True),
        TWO_RANKS_TWO_MB,
        "grad_values",
        "advantages_not_detached",
        ["advantages are not detached"],
    ),
    (
        "advantages not detached, GSPO with its clamp binding",
        {"policy_loss": "gspo", "log_ratio_clamp": 0.02},
        Bugs(adv_not_detached=True),
        TWO_RANKS_TWO_MB,
        "grad_values",
        "advantages_not_detached",
        ["advantages are not detached"],
    ),
    (
        "clipped-region gradient",
        {},
        Bugs(clip_straight_through=True),
        TWO_RANKS_TWO_MB,
        "grad_logprobs",
        "clip_not_in_gradient",
        ["unclipped branch's gradient"],
    ),
    (
        "padding leak",
        {},
        Bugs(leak_rows=[5]),
        TWO_RANKS_TWO_MB,
        "grad_logprobs",
        "padding_leak",
        ["padding leak", "in rows [5] (micro-batch 0 of rank 1)", f"at {10 - LENGTHS[5]} padded positions"],
    ),
    (
        "KL-in-loss gradient of another estimator",
        {"kl_in": "loss", "kl_estimator": "k1"},
        Bugs(kl_estimator="k3"),
        TWO_RANKS_TWO_MB,
        "grad_logprobs",
        "kl_estimator=k3",
        ["kl_estimator=k3 (not k1)"],
    ),
]


@pytest.mark.parametrize(
    ("what", "conv", "bugs", "layout", "first", "bug_id", "texts"), CASES, ids=[c[0] for c in CASES]
)
def test_injected_bug_is_caught_and_named(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    what: str,
    conv: dict[str, Any],
    bugs: Bugs,
    layout: Layout,
    first: str,
    bug_id: str,
    texts: list[str],
) -> None:
    rc, rep = run(tmp_path, step_dump(conv, bugs, layout=layout), capsys, conv, layout)
    assert rc == 1
    assert rep["first_divergence"] == first
    assert [e["bug"] for e in rep["explained_by"]] == bug_id.split("|"), rep["diagnosis"]
    text = "\n".join(rep["diagnosis"])
    for t in texts:
        assert t in text, (t, text)


CLAMPED = [{"log_ratio_clamp": 0.25}, {"policy_loss": "gspo", "log_ratio_clamp": 0.02}]


@pytest.mark.parametrize("conv", CLAMPED, ids=["token", "gspo"])
def test_clamped_ratio_steps_match_and_the_clamp_binds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], conv: dict[str, Any]
) -> None:
    """The controls of the two clamp cases above: the correct step matches, and the clamp binds at
    tokens of both advantage signs (where ∂ρ/∂l = 0 but ∂ℓ/∂A ≠ 0: the old diagnosis lost them)."""
    d = step_dump(conv)
    m = d["response_mask"].bool()
    dl = d["logprobs"] - d["old_logprobs"]
    if conv.get("policy_loss") == "gspo":  # the row's mean log-ratio against the upper clamp
        s = torch.where(m, dl, torch.zeros(())).sum(1) / m.sum(1)
        bound = m & (s > 0.02).unsqueeze(1)
    else:
        bound = m & (dl.abs() > 0.25)
    adv = d["advantages"]
    assert bool((bound & (adv > 0)).any()) and bool((bound & (adv < 0)).any())
    rc, rep = run(tmp_path, d, capsys, conv)
    assert rc == 0, rep["diagnosis"]


def test_gradient_named_when_a_logged_scalar_diverges_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's user story: pg_loss logged as something else; the gradient still names the bug."""
    d = step_dump({}, Bugs(local_norm=True), keep_scalars=True)
    d["pg_loss"] = d["pg_loss"] * 1.3
    rc, rep = run(tmp_path, d, capsys)
    assert rc == 1 and rep["first_divergence"] == "pg_loss"
    assert [e["bug"] for e in rep["explained_by"]] == ["local_normaliser"], rep["diagnosis"]
    assert not any(line.startswith("no single convention change") for line in rep["diagnosis"])


def test_gradient_tolerance_is_relative_to_the_gradient_scale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A float32 gradient 1e-4 of the reference is below float32's absolute atol (1e-5) and still fails."""
    d = step_dump(dtype=torch.float32)
    assert float(d["grad_logprobs"].abs().max()) * 1e-4 < 1e-5
    for k in ("grad_logprobs", "grad_values"):
        d[k] = d[k] * 1e-4
    rc, rep = run(tmp_path, d, capsys)
    assert rc == 1 and rep["first_divergence"] == "grad_logprobs"


def test_separate_critic_loss_key_has_no_value_term(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = step_dump(keep_scalars=True)
    actor = d["pg_loss"] - 0.01 * d["entropy_loss"]  # ent_coef = 0.01 (grad_helpers.HP); no KL loss
    assert abs(float(d["loss"] - actor)) > 1e-3  # the value term is not negligible here
    d["loss"] = actor
    rc, rep = run(tmp_path, d, capsys, separate_critic=True)
    assert rc == 0, rep["diagnosis"]
    rc, rep = run(tmp_path, d, capsys)  # without the flag the value term is expected in `loss`
    assert rc == 1 and rep["first_divergence"] == "loss"


def test_nonfinite_gradient_is_a_mismatch_not_a_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = step_dump()
    d["grad_values"][2, 0] = float("nan")
    rc, rep = run(tmp_path, d, capsys)
    assert rc == 1 and rep["first_divergence"] == "grad_values"
    d = step_dump()
    d["grad_logprobs"][1, 9] = float("inf")  # row 1 has 3 tokens: a padded position
    rc, rep = run(tmp_path, d, capsys)
    assert rc == 1 and rep["first_divergence"] == "grad_logprobs"


@pytest.mark.parametrize(
    ("key", "pos", "value", "word", "where"),
    [
        ("grad_values", (2, 0), math.nan, "NaN", "row 2, token 0 (micro-batch 1 of rank 0)"),
        ("grad_logprobs", (5, 3), math.nan, "NaN", "row 5, token 3 (micro-batch 0 of rank 1)"),
        ("grad_logprobs", (1, 9), -math.inf, "-inf", "row 1, token 9 (micro-batch 1 of rank 0)"),  # padded
    ],
)
def test_nonfinite_gradient_is_named_with_its_value_and_first_position(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    key: str,
    pos: tuple[int, int],
    value: float,
    word: str,
    where: str,
) -> None:
    """NaN is reported as NaN (it used to read ``inf``, with no position), at its first position in
    row-major order with its micro-batch and rank (``grad_helpers.RANK``/``MICRO``)."""
    d = step_dump()
    d[key][pos] = value
    if word == "NaN":
        d[key][7, 1] = math.inf  # a later infinity: the NaN is still the one named
        d[key][pos[0], pos[1] + 1] = math.nan  # a second NaN after the first
    rc, rep = run(tmp_path, d, capsys)
    assert rc == 1 and rep["first_divergence"] == key
    assert rep["diagnosis"][0] == f"first divergence: {key} (the dump holds {word} at {where})"
    assert f"{key}: the dump holds {word} at {where}, the first of" in "\n".join(rep["diagnosis"])
    entry = rep["explained_by"][0]
    assert (entry["bug"], entry["value"], entry["row"], entry["token"]) == (
        "non_finite",
        {"NaN": "nan"}.get(word, word),
        *pos,
    )
    assert (entry["micro_batch"], entry["rank"]) == (MICRO[pos[0]], RANK[pos[0]])
    assert (entry["nan_count"], entry["inf_count"]) == ((2, 1) if word == "NaN" else (0, 1))


def test_zero_reference_gradient_has_zero_tolerance_and_the_report_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vf_coef = 0: the reference grad_values is exactly 0, so its tolerance is 0 (deliberate: an
    objective without a value term gives exact zeros). 1e-9 at one token is a mismatch, and the
    report says why instead of printing a ratio to 0."""
    d = step_dump()
    d["grad_values"] = torch.zeros_like(d["grad_values"])
    rc, rep = run(tmp_path, d, capsys, vf_coef=0.0)
    assert rc == 0, rep["diagnosis"]  # control: exact zeros match
    assert rep["quantities"]["grad_values"]["tol"] == 0.0
    d["grad_values"][6, 4] = 1e-9
    rc, rep = run(tmp_path, d, capsys, vf_coef=0.0)
    assert rc == 1 and rep["first_divergence"] == "grad_values"
    text = "\n".join(rep["diagnosis"])
    assert (
        "grad_values: the reference gradient is exactly 0 here (every position), so its tolerance "
        "(rtol + atol)·max|ref grad| is 0 and any nonzero value is a mismatch; the dump has 1e-09 at "
        "row 6, token 4 (micro-batch 1 of rank 1)"
    ) in text
    assert "dump/reference by group" not in text  # no ratio to a zero reference


def test_v1_dump_without_step_keys_is_unchanged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = {k: v for k, v in step_dump(keep_scalars=True).items() if not k.startswith("grad_")}
    d.pop("rank")
    d.pop("micro_batch")
    rc, rep = run(tmp_path, d, capsys, layout=Layout(rank=(0,) * 8, micro=(0,) * 8, W=1, K=1))
    assert rc == 0 and "grad_logprobs" not in rep["quantities"]


def _tie_token(d: dict[str, torch.Tensor]) -> tuple[int, int, float]:
    """A valid token with A > 0 and a float32 log-prob on whose ratio float32 and float64 arithmetic
    disagree about the clip (``exp(lp − old) > 1.2`` in one and not the other): a tie the dtype breaks."""
    adv, old = d["advantages"], d["old_logprobs"]
    bound32 = torch.tensor(1.2, dtype=torch.float32)
    for b in range(8):
        for t in range(LENGTHS[b]):
            if float(adv[b, t]) <= 0:
                continue
            o32 = old[b, t].to(torch.float32)
            lp = (o32.double() + torch.log(torch.tensor(1.2, dtype=torch.float64))).to(torch.float32)
            for _ in range(40):
                lp = torch.nextafter(lp, torch.tensor(-1e9, dtype=torch.float32))
            for _ in range(80):
                clipped32 = bool(torch.exp(lp - o32) > bound32)
                clipped64 = float(torch.exp(lp.double() - o32.double())) > 1.2
                if clipped32 != clipped64:
                    return b, t, float(lp)
                lp = torch.nextafter(lp, torch.tensor(1e9, dtype=torch.float32))
    raise AssertionError("no float32 tie token in this dump")


def test_clip_boundary_tie_accepts_either_branch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A float32 step whose trainer (float64 arithmetic) puts a boundary token on one side of the clip
    while float32 arithmetic puts it on the other: the gradient there is the trainer's choice."""
    from grad_helpers import trainer_grads

    d = step_dump()
    b, t, lp = _tie_token(d)
    d["old_logprobs"] = d["old_logprobs"].to(torch.float32).double()
    d["logprobs"] = d["logprobs"].to(torch.float32).double()
    d["logprobs"][b, t] = lp
    d.update(trainer_grads(d, {}, Bugs()))
    d32 = {k: (v.to(torch.float32) if v.is_floating_point() else v) for k, v in d.items()}
    rc, rep = run(tmp_path, d32, capsys)
    assert rc == 0, rep["diagnosis"]
    d32["grad_logprobs"][b, t] = 7.77 * d32["grad_logprobs"].abs().max()  # neither branch: a mismatch
    rc, rep = run(tmp_path, d32, capsys)
    assert rc == 1 and rep["first_divergence"] == "grad_logprobs"


def test_vf_coef_zero_with_grad_values_points_at_separate_critic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = step_dump()
    rc, rep = run(tmp_path, d, capsys, vf_coef=0.0)  # the v1 advice, kept in a v2 dump
    assert rc == 1 and rep["first_divergence"] == "grad_values"
    assert any("set separate_critic: true" in line for line in rep["diagnosis"]), rep["diagnosis"]


def test_clip_ties_under_gspo_are_read_on_the_sequence_ratio() -> None:
    # one row whose token log-ratios ln(1.2) ± 0.05 average to ln(1.2): GSPO's ratio s = 1.2 sits on
    # the clip boundary 1 + ε (a tie), although neither token ratio (1.26, 1.14) is near it
    import math

    import torch
    from oracle_helpers import setup_for

    from refppo.oracle.check.recompute import pg_tie_mask

    base = math.log(1.2)
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    lp = old + torch.tensor([[base + 0.05, base - 0.05]], dtype=torch.float64)
    adv = torch.ones(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    gspo = setup_for(conv={"policy_loss": "gspo"})
    assert pg_tie_mask(lp, old, adv, mask, gspo, 1e-7).tolist() == [[True, True]]
    vanilla = setup_for(conv={})
    assert pg_tie_mask(lp, old, adv, mask, vanilla, 1e-7).tolist() == [[False, False]]
