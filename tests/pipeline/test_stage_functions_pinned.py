"""Stage functions and table fields pinned against the core called directly or hand values (the
survivors of the mutation run over refppo/pipeline on the stage-table layout, #20)."""

from __future__ import annotations

import pytest
import torch

from refppo.core.value import value_token_loss
from refppo.errors import RefPPOError
from refppo.pipeline.blocks import Evaluation
from refppo.pipeline.groups import ScoreMap
from refppo.pipeline.settings import CONFIG_KEYS, Convention, Hyperparams
from refppo.pipeline.stages import BY_NAME, Stage, walk

F64 = torch.float64


def _batch(B: int = 5, T: int = 7, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 1, 6])[:B]
    mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(1)
    old = -torch.rand(B, T, generator=g, dtype=F64) - 0.1
    return {
        "mask": mask,
        "old_logprobs": old,
        "logprobs": old + 0.3 * torch.randn(B, T, generator=g, dtype=F64),
        "old_values": torch.randn(B, T, generator=g, dtype=F64),
        "values": torch.randn(B, T, generator=g, dtype=F64),
        "returns": torch.randn(B, T, generator=g, dtype=F64),
    }


def test_the_neg_k1_approx_kl_is_the_mean_of_l_minus_l_old() -> None:
    x = _batch()
    m = x["mask"]
    d = [float(x["logprobs"][b, t] - x["old_logprobs"][b, t]) for b in range(5) for t in range(7) if m[b, t]]
    hand = sum(d) / len(d)  # mean over the valid tokens of l − l^old (= −k1)
    q = {**x, "advantages": torch.zeros_like(x["logprobs"])}
    pol = BY_NAME["policy"].run(q, Convention(), Hyperparams())
    for metric, want in (("neg_k1", hand), ("k1", -hand)):
        out = BY_NAME["approx_kl"].run({**q, **pol}, Convention.of(approx_kl=metric), Hyperparams())
        assert abs(float(out["approx_kl"]) - want) <= 1e-14, metric


def test_the_value_stage_by_rows_passes_the_value_convention_and_clip_range() -> None:
    x = _batch()
    q = {**x, "value_mask": x["mask"]}
    conv = Convention.of(value_loss="clipped", value_clip_form="delta")
    hp = Hyperparams(cliprange_value=0.05)
    got = BY_NAME["value"].run(q, conv, hp, Evaluation(rows=2))
    core = value_token_loss(
        x["values"], x["old_values"], x["returns"], x["mask"], clip=0.05, kind=conv.value.loss,
        clip_form=conv.value.clip_form,
    )  # fmt: skip
    assert torch.equal(got["vf_per_token"], core.per_token)
    assert float(got["vf_clipfrac"]) == float(core.clipfrac) and float(core.clipfrac) > 0  # ε_v binds


def test_a_critic_free_update_with_old_values_but_no_values_has_no_value_term() -> None:
    x = _batch()
    q = {**x, "values": None, "value_mask": x["mask"]}
    out = BY_NAME["value"].run(q, Convention.of(advantage="grpo"), Hyperparams())
    assert out["vf_per_token"] is None and float(out["vf_clipfrac"]) == 0.0
    q2 = {**x, "old_values": None, "value_mask": x["mask"]}
    assert BY_NAME["value"].run(q2, Convention.of(advantage="grpo"), Hyperparams())["vf_per_token"] is None


def test_walk_runs_the_naive_twin_when_asked() -> None:
    st = Stage(
        "probe", "update", (), (), ("a",), ("b",), lambda q, c, h, e: {"b": 1}, lambda q, c, h, e: {"b": 2}
    )
    assert walk([st], {"a": 0}, Convention(), Hyperparams())["b"] == 1
    assert walk([st], {"a": 0}, Convention(), Hyperparams(), naive=True)["b"] == 2


@pytest.mark.parametrize("clip", [0.0, -1.0, float("inf")])
def test_a_score_clip_must_be_a_finite_positive_number(clip: float) -> None:
    with pytest.raises(RefPPOError, match="score_clip"):
        ScoreMap(clip=clip)


def test_keys_that_describe_an_observed_trainer_are_not_trainer_config_keys() -> None:
    # how a trainer logs approx_kl or masks its value loss is not a choice of refppo's trainer
    assert "approx_kl" not in CONFIG_KEYS and "vf_mask" not in CONFIG_KEYS
    assert {"dual_clip", "value_clip_form", "score_clip"} <= set(CONFIG_KEYS)
