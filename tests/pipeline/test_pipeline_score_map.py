"""The score map ``clip((s + b)·k, ±C)`` is the pipeline's step 0 (a core function with a naive
twin), not an oracle helper: the trainer, the oracle and ``--detect``'s re-checks share it.

The pipeline's outputs under a ``ScoreMap`` are compared with the pipeline fed the scores mapped by
the NAIVE twin (Python floats), and the twin itself with hand-worked values.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs, refppo_dump, save, setup_for

from refppo.core.score_map import map_scores, map_scores_naive
from refppo.dump.load import load_dump
from refppo.errors import HyperparameterError
from refppo.oracle.check.diagnose import check
from refppo.oracle.detect.detection import detect, setup_from_json
from refppo.pipeline import rollout as m_rollout
from refppo.pipeline.groups import ScoreMap
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import rollout_quantities

F64 = torch.float64
MAPS = [
    ScoreMap(),
    ScoreMap(bias=-0.5, scale=2.0),
    ScoreMap(clip=1.0),
    ScoreMap(bias=0.3, scale=-1.5, clip=2.0),
]


def test_naive_twin_hand_worked() -> None:
    s = torch.tensor([1.0, -4.0, 10.0, -0.0], dtype=F64)
    # AReaL's order: the affine map first, then the clip
    assert map_scores_naive(s, bias=0.5, scale=2.0, clip=5.0) == [3.0, -5.0, 5.0, 1.0]
    assert map_scores_naive(s, clip=4.0) == [1.0, -4.0, 4.0, 0.0]
    ident = map_scores(s)
    assert ident is s  # the identity map returns the scores themselves (bit for bit, −0.0 kept)


@pytest.mark.parametrize("smap", MAPS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_map_scores_matches_its_naive_twin(smap: ScoreMap, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    s = (torch.randn(64, generator=g, dtype=F64) * 3.0).to(dtype)
    got = map_scores(s, bias=smap.bias, scale=smap.scale, clip=smap.clip)
    want = torch.tensor(map_scores_naive(s, bias=smap.bias, scale=smap.scale, clip=smap.clip), dtype=F64)
    tol = 0.0 if dtype == F64 else 4e-7 * float(want.abs().max())
    assert float((got.double() - want).abs().max()) <= tol
    if smap.clip is not None:
        assert bool((want.abs() == smap.clip).any())  # control: the clip binds somewhere


def test_bad_score_map_is_one_clear_line() -> None:
    with pytest.raises(
        HyperparameterError, match=r"score_clip: expected a finite number > 0 or none, got -1\.0"
    ):
        ScoreMap(clip=-1.0)
    with pytest.raises(HyperparameterError, match=r"score_scale: expected a finite number, got nan"):
        ScoreMap(scale=math.nan)


def _inputs() -> dict[str, torch.Tensor]:
    x = make_inputs(B=6, T=8, seed=11)
    x["mask"] = x.pop("response_mask").bool()
    return x


def _rollout(x: dict[str, torch.Tensor], conv: Convention, scores: torch.Tensor, **kw: Any) -> Any:
    return rollout_quantities(
        scores=scores, old_logprobs=x["old_logprobs"], ref_logprobs=x["ref_logprobs"],
        old_values=x["old_values"] if conv.adv.estimator.value == "gae" else None, mask=x["mask"],
        hp=Hyperparams(kl_coef=0.1), conv=conv, group_index=torch.tensor([0, 0, 1, 1, 2, 2]), **kw,
    )  # fmt: skip


CONVS = {
    "gae": Convention(),
    "grpo-to_go": Convention.of(advantage="grpo", group_kl="to_go", whiten_advantages="none"),  # type: ignore[arg-type]  # parsed
}


@pytest.mark.parametrize("smap", MAPS[1:], ids=str)
@pytest.mark.parametrize("conv_id", list(CONVS))
def test_pipeline_applies_the_score_map_as_the_naive_twin(smap: ScoreMap, conv_id: str) -> None:
    """Every rollout output under ``score_map`` equals the pipeline fed the twin's mapped scores
    (``grpo`` with ``to_go`` reads the scores directly, not through the token rewards)."""
    x, conv = _inputs(), CONVS[conv_id]
    twin = torch.tensor(
        map_scores_naive(x["scores"], bias=smap.bias, scale=smap.scale, clip=smap.clip), dtype=F64
    )
    got = _rollout(x, replace(conv, score=smap), x["scores"])
    want = _rollout(x, conv, twin)
    for name in ("token_rewards", "advantages_raw", "advantages", "returns"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    plain = _rollout(x, conv, x["scores"])
    assert not torch.equal(got.advantages_raw, plain.advantages_raw)  # control: the map matters


def test_detected_score_bias_is_rechecked_through_the_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--detect`` solves AReaL's bias and scale; the re-check of the detected setting maps the
    scores through the pipeline's step 0 (the call is observed there), and matches."""
    made = setup_for(None, {"score_bias": -0.5, "score_scale": 2.0})
    start = setup_for(None, {})
    dump = load_dump(save(tmp_path, refppo_dump(make_inputs(B=8, T=16, seed=5), made), start))
    found = detect(dump, start)
    conv = next(c for c in found.detected if (c["score_bias"], c["score_scale"]) == (-0.5, 2.0))
    seen: list[tuple[float, float, float | None]] = []
    real = map_scores

    def spy(scores: torch.Tensor, **kw: Any) -> torch.Tensor:
        seen.append((kw["bias"], kw["scale"], kw["clip"]))
        return real(scores, **kw)

    monkeypatch.setattr(m_rollout, "map_scores", spy)
    res = check(dump, setup_from_json(start, conv), explain_divergence=False)
    assert res.match, res.diagnosis
    assert (-0.5, 2.0, None) in seen


@pytest.mark.parametrize("smap", MAPS[1:], ids=str)
def test_naive_pipeline_twin_takes_the_score_map(smap: ScoreMap) -> None:
    """``ppo_naive.rollout_quantities_naive`` (loops over floats) under the same ``score_map``."""
    from refppo.pipeline.step import rollout_quantities_naive

    x, conv = _inputs(), CONVS["gae"]
    got = _rollout(x, replace(conv, score=smap), x["scores"])
    naive = rollout_quantities_naive(
        scores=x["scores"], old_logprobs=x["old_logprobs"], ref_logprobs=x["ref_logprobs"],
        old_values=x["old_values"], mask=x["mask"], hp=Hyperparams(kl_coef=0.1),
        conv=replace(conv, score=smap),
    )  # fmt: skip
    for name in ("token_rewards", "advantages", "returns"):
        a, b = getattr(got, name), getattr(naive, name)
        assert float((torch.where(x["mask"], a - b, torch.zeros((), dtype=F64))).abs().max()) <= 1e-12, name
