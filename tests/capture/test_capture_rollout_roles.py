"""Issue #22 item 1 through capture: ``StepRecorder`` records the three log-prob roles (behaviour
``rollout_logprobs``, proximal ``old_logprobs``, current ``logprobs``), ``policy_version`` and the
engine's sampling parameters; ``assert_step_matches`` checks a step with the rollout correction on.

The trainer here is written by hand (not refppo's pipeline): a critic-free GRPO step at β = 0 (no
reference log-probs), two micro-batches with a global token-mean, the clipped surrogate multiplied by
the truncated importance weight ``w_t = min(π_prox/π_beh, C)`` (TIS, detached; verl's
``rollout_is=token`` with ``rollout_is_threshold``), ``C = 2``.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from refppo.capture import CaptureError, StepRecorder
from refppo.errors import RefPPOError
from refppo.testing import assert_step_matches

EPS, CAP = 0.2, 2.0
HP = {"kl_coef": 0.0, "cliprange": EPS}  # β = 0, critic-free: nothing else is read
CONV = {
    "advantage": "grpo",
    "whiten_advantages": "none",
    "loss_agg": "token-mean",
    "rollout_is": "token",
    "rollout_is_mode": "truncate",
    "rollout_is_high": CAP,
}
LENGTHS = ([5, 2, 3], [1, 4, 6])
GROUPS = [0, 0, 1, 1, 1, 0]
REQUIRE = ("advantages", "pg_loss", "grad_logprobs")


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    lengths = [n for part in LENGTHS for n in part]
    B, T = len(lengths), 6
    mask = (torch.arange(T).expand(B, T) < torch.tensor(lengths).unsqueeze(1)).double()
    old = -1.0 + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25, 1.0, 0.75], dtype=torch.float64)
    ids = torch.tensor(GROUPS)
    adv = torch.zeros(B, dtype=torch.float64)
    for grp in ids.unique():  # GRPO by hand: (s − mean) / (std + 1e-6) within each group
        rows = ids == grp
        adv[rows] = (scores[rows] - scores[rows].mean()) / (scores[rows].std() + 1e-6)
    return {
        "response_mask": mask,
        "old_logprobs": old,
        # the engine's log-probs: π_prox/π_beh = exp(old − rollout) above C = 2 on some tokens
        "rollout_logprobs": old - 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64),
        "logprobs_init": old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
        "scores": scores,
        "group_index": ids,
        "advantages": adv[:, None] * mask,
        "policy_version": torch.tensor([3, 3, 2, 3, 1, 3]),
    }


def _loss(
    b: dict[str, Any], rows: slice, lp: torch.Tensor, T: int, n_tokens: float, bug: str
) -> torch.Tensor:
    """The trainer's micro-batch loss: Σ m·w·max(−A·r, −A·clip(r, 1 ± ε)) / N (N: the step's tokens)."""
    m, old, beh = b["response_mask"][rows, :T], b["old_logprobs"][rows, :T], b["rollout_logprobs"][rows, :T]
    a = b["advantages"][rows, :T]
    w = torch.exp(old - beh) if bug == "not truncated" else torch.clamp(torch.exp(old - beh), max=CAP)
    if bug == "not detached":  # the weight carries ∂/∂logprobs (π/π_beh instead of π_prox/π_beh)
        w = torch.clamp(torch.exp(lp - beh), max=CAP)
        w = w.detach() + (w - w.detach())
    else:
        w = w.detach()
    r = torch.exp(lp - old)
    per_token = torch.maximum(-a * r, -a * torch.clamp(r, 1 - EPS, 1 + EPS))
    return (m * w * per_token).sum() / n_tokens


def _record(b: dict[str, Any], path: Path, bug: str = "", sampling: Any = None, **skip: bool) -> Path:
    rec = StepRecorder(hparams=HP, conventions=CONV, sampling=sampling)
    n_tokens, start = float(b["response_mask"].sum()), 0
    for part in LENGTHS:
        rows, T = slice(start, start + len(part)), max(part)
        start += len(part)
        lp = b["logprobs_init"][rows, :T].clone().requires_grad_(True)
        loss = _loss(b, rows, lp, T, n_tokens, bug)
        extra = {} if skip.get("no_rollout") else {"rollout_logprobs": b["rollout_logprobs"][rows, :T]}
        rec.record(
            logprobs=lp,
            response_mask=b["response_mask"][rows, :T],
            old_logprobs=b["old_logprobs"][rows, :T],
            scores=b["scores"][rows],
            group_index=b["group_index"][rows],
            policy_version=b["policy_version"][rows],
            advantages=b["advantages"][rows, :T],
            pg_loss=loss,
            **extra,
        )
        loss.backward()
    side = rec.write(path)
    assert side is not None
    return path


def test_the_recorder_writes_the_three_roles_the_version_and_the_sampling(tmp_path: Path) -> None:
    b = _batch()
    sampling = {"temperature": 0.6, "top_p": 0.8, "top_k": -1, "logprobs_mode": "processed_logprobs"}
    path = _record(b, tmp_path / "step.safetensors", sampling=sampling)
    d = load_file(str(path))
    m = b["response_mask"].bool()
    for key in ("rollout_logprobs", "old_logprobs"):  # two roles, each the one given
        assert torch.equal(d[key][m], b[key][m]), key
    assert "ref_logprobs" not in d and "logprobs" in d and "grad_logprobs" in d
    assert d["policy_version"].dtype == torch.int64 and d["policy_version"].tolist() == [3, 3, 2, 3, 1, 3]
    side = json.loads(Path(f"{path}.json").read_text())
    assert {k: side[k] for k in ("temperature", "top_p", "top_k", "logprobs_processed")} == {
        "temperature": 0.6,
        "top_p": 0.8,
        "top_k": -1,
        "logprobs_processed": True,
    }
    assert side["rollout_is"] == "token" and side["rollout_is_high"] == CAP
    out = assert_step_matches(path, require=REQUIRE)
    assert out.passed


def test_sampling_from_an_engine_parameter_object(tmp_path: Path) -> None:
    """vLLM's ``SamplingParams`` is read by attribute (a stand-in with its field names)."""
    params = types.SimpleNamespace(temperature=1.0, top_p=1.0, top_k=50, min_p=0.05, n=4, seed=None)
    path = _record(_batch(), tmp_path / "step.safetensors", sampling=params)
    side = json.loads(Path(f"{path}.json").read_text())
    assert (side["temperature"], side["top_p"], side["top_k"], side["min_p"]) == (1.0, 1.0, 50, 0.05)
    assert "n" not in side and "logprobs_processed" not in side
    with pytest.raises(CaptureError, match=r"^sampling: top_p: expected a number in \(0, 1\], got 1\.5$"):
        StepRecorder(hparams=HP, sampling={"top_p": 1.5})
    with pytest.raises(CaptureError, match=r"^sampling: unknown key\(s\) \['topp'\]"):
        StepRecorder(hparams=HP, sampling={"topp": 0.9})


@pytest.mark.parametrize("bug", ["not truncated", "not detached"])
def test_assert_step_matches_catches_a_wrong_correction(tmp_path: Path, bug: str) -> None:
    path = _record(_batch(), tmp_path / "bug.safetensors", bug=bug)
    with pytest.raises(AssertionError):
        assert_step_matches(path, require=REQUIRE)
    # the same dump checked without the correction mismatches too: the correction is load-bearing
    good = _record(_batch(), tmp_path / "good.safetensors")
    with pytest.raises(AssertionError):
        assert_step_matches(good, require=REQUIRE, rollout_is="none")


def test_a_missing_behaviour_logprob_with_the_correction_on_is_one_line(tmp_path: Path) -> None:
    b = _batch()
    want = (
        r"missing required key 'rollout_logprobs' \[B, T\]: read by the rollout_correction stage "
        r"under rollout_is=token"
    )
    with pytest.raises(CaptureError, match="^record: " + want) as exc:
        _record(b, tmp_path / "x.safetensors", no_rollout=True)
    assert "\n" not in str(exc.value)
    # a dump without them (written off the recorder) checked with the correction on: the same line
    t = {k: v for k, v in load_file(str(_record(b, tmp_path / "ok.safetensors"))).items()}
    t.pop("rollout_logprobs")
    with pytest.raises(RefPPOError, match=want) as exc2:
        assert_step_matches(t, hparams={**HP, **CONV, "world_size": 1, "micro_batches": 2}, require=REQUIRE)
    assert "\n" not in str(exc2.value)


def test_the_recorder_refuses_a_negative_or_fractional_policy_version() -> None:
    b = _batch()
    rec = StepRecorder(hparams=HP, conventions={"advantage": "grpo"})
    kw = {k: b[k] for k in ("response_mask", "old_logprobs", "scores", "group_index")}
    with pytest.raises(CaptureError, match=r"policy_version must hold integers, got torch\.float64"):
        rec.record(**kw, policy_version=b["policy_version"].double())
    with pytest.raises(CaptureError, match="policy_version must hold integers >= 0"):
        rec.record(**kw, policy_version=-b["policy_version"])
    with pytest.raises(CaptureError, match=r"policy_version has shape \[5\], expected \[6\]"):
        rec.record(**kw, policy_version=b["policy_version"][:5])


@pytest.mark.parametrize("alias", ["rollout_log_probs", "sampling_per_token_logps"])
def test_assert_step_matches_reads_the_peers_names_of_the_behaviour_log_probs(
    tmp_path: Path, alias: str
) -> None:
    """verl/OpenRLHF ``rollout_log_probs`` and TRL ``sampling_per_token_logps`` are ``rollout_logprobs``."""
    t = dict(load_file(str(_record(_batch(), tmp_path / "s.safetensors"))))
    t[alias] = t.pop("rollout_logprobs")
    side = {**HP, **CONV, "world_size": 1, "micro_batches": 2}
    assert assert_step_matches(t, hparams=side, require=REQUIRE).passed
    t[alias] = t[alias] + 0.5  # a different behaviour policy: the weights move, the check fails
    with pytest.raises(AssertionError):
        assert_step_matches(t, hparams=side, require=REQUIRE)
