"""``loss_agg=prompt-mean`` (SkyRL 0.4.0 ``loss_reduction="prompt_mean"``) as a convention of the
pipeline: the stages against their naive twins, the gradient against the naive gradient, a step
split into ranks × micro-batches (the step's ``N_p`` table) against the core called directly
(:func:`refppo.core.aggregate.prompt_mean_loss`), and every :class:`LossAgg` member either taken or
refused in one line naming its key by each per-term core function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import LossAgg
from refppo.core.aggregate import (
    agg_weights_naive,
    aggregate_loss,
    aggregate_loss_naive,
    prompt_mean_loss,
)
from refppo.core.cispo import cispo_policy_loss
from refppo.core.gspo import gspo_policy_loss
from refppo.core.objective import entropy_bonus, kl_loss
from refppo.core.policy import clipped_policy_loss, clipped_policy_token_loss
from refppo.core.rollout_losses import Norms, corrected_policy_loss
from refppo.core.value import value_loss
from refppo.errors import ConventionError
from refppo.pipeline.blocks import Normalisers
from refppo.pipeline.grad_naive import objective_grads_naive
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import update_grads, update_inputs, update_quantities, update_quantities_naive

HP = Hyperparams(cliprange=0.2, cliprange_high=0.28, cliprange_value=0.2, vf_coef=0.5, ent_coef=0.01)
GROUPS = torch.tensor([5, 2, 5, 9, 2, 5, 9, 5])
"""Three prompts (4, 2, 2 rows), rows of a prompt not adjacent."""


def _inputs(seed: int) -> dict[str, Any]:
    x = make_inputs(B=8, T=9, seed=seed)
    m = x.pop("response_mask").bool()
    adv = torch.randn(8, 9, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return {
        "logprobs": x["logprobs"], "values": x["values"], "old_logprobs": x["old_logprobs"],
        "old_values": x["old_values"], "advantages": adv, "returns": x["values"] + 0.3 * adv, "mask": m,
        "ref_logprobs": x["ref_logprobs"], "entropy": x["old_logprobs"].abs(),
    }  # fmt: skip


CONV = Convention.of(loss_agg="prompt-mean", value_loss_agg="token-mean")


@pytest.mark.parametrize("seed", range(6))
def test_the_stages_are_the_naive_twins_and_pg_loss_the_core(seed: int) -> None:
    x = _inputs(seed)
    uq = update_quantities(**x, group_index=GROUPS, hp=HP, conv=CONV)
    nv = update_quantities_naive(update_inputs(**x, group_index=GROUPS), hp=HP, conv=CONV)
    for name in ("pg_loss", "entropy_loss", "vf_loss", "loss"):
        torch.testing.assert_close(getattr(uq, name), getattr(nv, name), rtol=1e-12, atol=1e-14, msg=name)
    per_token = clipped_policy_token_loss(
        x["logprobs"], x["old_logprobs"], x["advantages"], x["mask"], clip_low=0.2, clip_high=0.28
    ).per_token
    want = prompt_mean_loss(per_token, x["mask"], GROUPS)
    torch.testing.assert_close(uq.pg_loss, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(uq.entropy_loss, prompt_mean_loss(x["entropy"], x["mask"], GROUPS))
    control = aggregate_loss(per_token, x["mask"], "seq-mean-token-mean")
    assert abs(float(control - want)) > 1e-4  # prompts of 4, 2 and 2 rows: not a mean over rows


@pytest.mark.parametrize("seed", range(4))
def test_the_gradient_is_the_naive_gradient(seed: int) -> None:
    x = _inputs(seed)
    got = update_grads(update_inputs(**x, group_index=GROUPS), hp=HP, conv=CONV)
    g_lp, g_v = objective_grads_naive(**{k: v for k, v in x.items() if k != "mask"}, mask=x["mask"],
                                      hp=HP, conv=CONV, group_index=GROUPS)  # fmt: skip
    m = x["mask"]
    torch.testing.assert_close(got["grad_logprobs"], torch.where(m, g_lp, 0.0), rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(got["grad_values"], torch.where(m, g_v, 0.0), rtol=1e-10, atol=1e-14)


def _table(m: torch.Tensor, groups: torch.Tensor) -> tuple[tuple[int, float], ...]:
    """The whole step's ``N_p`` by prompt id, counted row by row."""
    n: dict[int, float] = {}
    for row, g in zip(m.tolist(), groups.tolist(), strict=True):
        n[int(g)] = n.get(int(g), 0.0) + sum(row)
    return tuple(sorted(n.items()))


@pytest.mark.parametrize("seed", range(4))
def test_a_split_step_sums_to_the_whole_batch(seed: int) -> None:
    """2 ranks × 2 micro-batches of 2 rows (a permutation: each prompt's rows in several pieces):
    the pieces' ``pg_loss`` sum to the core's prompt mean of the whole batch, and their gradients
    are the whole batch's rows; without the table (each piece's own prompts) they do not."""
    x = _inputs(seed)
    m = x["mask"]
    norm = Normalisers(prompt_tokens=_table(m, GROUPS))
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(seed))
    whole = update_grads(update_inputs(**x, group_index=GROUPS), hp=HP, conv=CONV, objective="pg_loss")
    total, local = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for rows in perm.view(4, 2):
        piece = {k: v[rows] for k, v in x.items()}
        uq = update_quantities(**piece, group_index=GROUPS[rows], hp=HP, conv=CONV, norm=norm)
        total += uq.pg_loss
        local += update_quantities(**piece, group_index=GROUPS[rows], hp=HP, conv=CONV).pg_loss
        q = update_inputs(**piece, group_index=GROUPS[rows])
        g = update_grads(q, hp=HP, conv=CONV, norm=norm, objective="pg_loss")["grad_logprobs"]
        torch.testing.assert_close(g, whole["grad_logprobs"][rows], rtol=1e-12, atol=1e-15)
    per_token = clipped_policy_token_loss(
        x["logprobs"], x["old_logprobs"], x["advantages"], m, clip_low=0.2, clip_high=0.28
    ).per_token
    want = prompt_mean_loss(per_token, m, GROUPS)
    torch.testing.assert_close(total, want, rtol=1e-12, atol=1e-14)
    assert abs(float(local - want)) > 1e-4  # control: each piece's own prompt mean


def test_refusals_name_the_key() -> None:
    x = _inputs(0)
    with pytest.raises(ConventionError, match=r"^loss_agg=prompt-mean needs group_index"):
        update_quantities(**x, hp=HP, conv=CONV)
    for key in ("value_loss_agg", "kl_loss_agg", "kl_metric_agg"):
        with pytest.raises(ConventionError, match=rf"^{key}=prompt-mean is not supported"):
            Convention.of(**{key: "prompt-mean"})
    with pytest.raises(ConventionError, match=r"^value_loss_agg=prompt-mean is not supported"):
        update_quantities(**x, group_index=GROUPS, hp=HP, conv=Convention.of(loss_agg="prompt-mean"))
    kl_conv = Convention.of(loss_agg="prompt-mean", value_loss_agg="token-mean", kl_in="loss")
    with pytest.raises(ConventionError, match=r"^kl_loss_agg=prompt-mean is not supported"):
        update_quantities(**x, group_index=GROUPS, hp=HP, conv=kl_conv)
    ok = Convention.of(
        loss_agg="prompt-mean", value_loss_agg="token-mean", kl_in="loss", kl_loss_agg="token-mean"
    )
    assert float(update_quantities(**x, group_index=GROUPS, hp=HP, conv=ok).kl_loss) != 0.0  # type: ignore[arg-type]  # kl_loss is a tensor under kl_in=loss


def _core_calls(x: dict[str, Any]) -> dict[str, Callable[[LossAgg], object]]:
    lp, old, adv, m = x["logprobs"], x["old_logprobs"], x["advantages"], x["mask"]
    return {
        "aggregate_loss": lambda a: aggregate_loss(adv, m, a),
        "aggregate_loss_naive": lambda a: aggregate_loss_naive(adv, m, a),
        "agg_weights_naive": lambda a: agg_weights_naive(m, a),
        "clipped_policy_loss": lambda a: clipped_policy_loss(lp, old, adv, m, agg=a),
        "gspo_policy_loss": lambda a: gspo_policy_loss(lp, old, adv, m, agg=a),
        "cispo_policy_loss": lambda a: cispo_policy_loss(lp, old, adv, m, norms=Norms(agg=a)),
        "corrected_policy_loss": lambda a: corrected_policy_loss(
            lp, old, adv, m, torch.ones_like(adv), norms=Norms(agg=a)
        ),
        "value_loss": lambda a: value_loss(x["values"], x["old_values"], x["returns"], m, clip=0.2, agg=a),
        "entropy_bonus": lambda a: entropy_bonus(x["entropy"], m, a),
        "kl_loss": lambda a: kl_loss(lp, x["ref_logprobs"], m, "k3", a),
    }


def test_every_member_is_taken_or_refused_in_one_line_by_each_core_function() -> None:
    """The per-term core functions take :data:`MASK_AGGS`; ``prompt-mean`` (which reads the prompts)
    is refused by each in one line naming ``loss_agg`` — never a silent fall-through to another mode."""
    x = _inputs(1)
    for name, call in _core_calls(x).items():
        for agg in LossAgg:
            if agg in MASK_AGGS:
                call(agg)
                continue
            with pytest.raises(ConventionError) as info:
                call(agg)
            msg = str(info.value)
            assert "\n" not in msg and msg.startswith("loss_agg=prompt-mean needs"), (name, msg)


def test_the_trainer_config_refuses_prompt_mean_in_one_line() -> None:
    from refppo.errors import RefPPOError
    from refppo.train.config.schema import load_config

    for overrides, want in (
        (
            ["ppo.loss_agg=prompt-mean"],
            "ppo.loss_agg=prompt-mean aggregates the policy terms only: the value term needs its own "
            "ppo.value_loss_agg",
        ),
        (
            ["ppo.loss_agg=prompt-mean", "ppo.value_loss_agg=token-mean", "ppo.kl_in=loss"],
            "ppo.loss_agg=prompt-mean aggregates the policy terms only: the kl term needs its own "
            "ppo.kl_loss_agg",
        ),
        (["ppo.value_loss_agg=prompt-mean"], "[ppo]: value_loss_agg=prompt-mean is not supported"),
    ):
        with pytest.raises(RefPPOError) as info:
            load_config(None, overrides)
        assert str(info.value).startswith(want) and "\n" not in str(info.value), str(info.value)
    load_config(None, ["ppo.loss_agg=seq-mean-token-mean"])  # control: another mode loads
    # the trainer runs it (tests/train/test_train_prompt_mean.py) with the value loss's own mode
    assert load_config(None, ["ppo.loss_agg=prompt-mean", "ppo.value_loss_agg=token-mean"]).ppo
    assert load_config(None, ["ppo.entropy_agg=prompt-mean"]).ppo
