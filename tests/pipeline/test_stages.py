"""The stage table (refppo/pipeline/stages.py): consistent, honest about what each stage reads, walked
the same way through the vectorized functions and the naive twins.

- every quantity a stage reads is an input of the step or made by an earlier stage;
- a stage's outputs do not change when a convention key or hyperparameter it does not declare (or,
  under a given convention, does not read: :meth:`Stage.reads_now`) changes — the oracle's caches
  (fastcheck's keys) are derived from these declarations, so a stage that read more than it says
  would make them return a wrong rollout;
- the walk reuses a given upstream result and frees what no later stage reads;
- the naive walk (each stage's naive twin) equals the vectorized walk under varied conventions.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs

from refppo.errors import RefPPOError
from refppo.pipeline.settings import FLAT, HPARAM_KEYS, Convention, Hyperparams, enum_keys
from refppo.pipeline.stage_graph import downstream, keys_upstream
from refppo.pipeline.stages import (
    BY_NAME,
    OUTPUTS,
    ROLLOUT_STAGES,
    STAGES,
    UPDATE_STAGES,
    walk,
)
from refppo.pipeline.step import (
    rollout_quantities,
    rollout_quantities_naive,
    update_grads,
    update_inputs,
    update_quantities,
    update_quantities_naive,
)

INPUTS = {
    "scores", "old_logprobs", "ref_logprobs", "old_values", "mask", "group_index", "logprobs", "values",
    "advantages", "returns", "value_mask", "entropy", "rollout_logprobs", "bootstrap_values", "truncated",
}  # fmt: skip
"""The step's inputs (the rollout's cached tensors, the current policy and critic)."""
HP = Hyperparams(gamma=0.97, lam=0.9, kl_coef=0.1, ent_coef=0.01, cliprange_value=0.3)
BASES = {
    "verl-like": {"kl_estimator": "k3", "kl_log_ratio_clamp": (-20.0, 20.0), "kl_value_clamp": 10.0},
    "trl-like": {"score_at": "after_last_valid", "whiten_rewards": "masked_no_shift", "score_clip": 2.0},
    "kl-loss": {"kl_in": "loss", "kl_estimator": "k2", "loss_agg": "seq-mean-token-mean", "dual_clip": 3.0},
    "grpo": {"advantage": "grpo", "whiten_advantages": "none", "group_singleton": "score"},
    "rollout-mis": {
        "rollout_is": "sequence",
        "rollout_is_agg": "geometric",
        "rollout_is_mode": "mask",
        "rollout_is_low": 0.8,
        "rollout_is_high": 1.25,
        "loss_agg": "seq-mean-token-mean",
    },
    "rollout-drop": {
        "rollout_rs": "token",
        "rollout_rs_stat": "k2",
        "rollout_rs_order": "behaviour",
        "rollout_rs_high": 0.03,
        "rollout_rs_effect": "drop_mask",
        "loss_agg": "seq-mean-token-mean",
    },
    "kl-both": {"kl_in": "both", "kl_estimator": "k3", "loss_agg": "seq-mean-token-mean", "dual_clip": 3.0},
    "bootstrap": {"gae_bootstrap": "truncated", "gae_padding": "through", "score_at": "after_last_valid"},
}


def test_the_table_reads_only_what_is_given_or_made_before() -> None:
    made = set(INPUTS)
    for s in STAGES:
        missing = set(s.reads) - made
        assert not missing, (s.name, missing)
        assert not set(s.makes) & (made - INPUTS), (s.name, "made twice")
        made |= set(s.makes)
    assert set(OUTPUTS) <= made
    assert {s.phase for s in ROLLOUT_STAGES} == {"rollout"} and {s.phase for s in UPDATE_STAGES} == {"update"}
    for s in STAGES:
        assert set(s.groups) <= {FLAT[k].group for k in FLAT}
        for name in s.reads_now(Convention()):
            assert name in s.keys or name in s.hparams, (s.name, name)


def _full_walk(conv: Convention, seed: int = 3) -> dict[str, Any]:
    """Every quantity of one step under ``conv`` (the vectorized walk, inputs of make_inputs)."""
    x = make_inputs(B=6, T=10, seed=seed)
    m = x.pop("response_mask").bool()
    q: dict[str, Any] = {**x, "mask": m, "group_index": torch.tensor([0, 0, 1, 1, 2, 2])}
    q["rollout_logprobs"] = _behaviour(x)
    q["bootstrap_values"] = 0.5 * x["scores"]  # row 0 fills the frame: truncated
    if conv.adv.estimator.value != "gae":
        q["old_values"] = None
    out = walk(ROLLOUT_STAGES, q, conv, HP)
    upd = update_inputs(
        logprobs=out["logprobs"], values=out["values"] if q["old_values"] is not None else None,
        old_logprobs=out["old_logprobs"], old_values=out["old_values"], advantages=out["advantages"],
        returns=out["returns"], mask=m, value_mask_=out["value_mask"], ref_logprobs=out["ref_logprobs"],
        entropy=out["entropy"], rollout_logprobs=q["rollout_logprobs"],
    )  # fmt: skip
    return {**out, **walk(UPDATE_STAGES, upd, conv, HP)}


def _behaviour(x: dict[str, Any]) -> torch.Tensor:
    """Behaviour log-probs ``l^prox − N(0, 0.3²)``: the rollout-mis band keeps some rows, not all."""
    g = torch.Generator().manual_seed(23)
    out: torch.Tensor = x["old_logprobs"] - 0.3 * torch.randn(
        x["old_logprobs"].shape, generator=g, dtype=torch.float64
    )
    return out


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (
        a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)))
    )


def _other_values(key: str, value: Any) -> list[Any]:
    """A few other values of flat key ``key`` (every other member of an enum key)."""
    enums = enum_keys()
    if key in enums:
        members: list[Any] = list(enums[key])
        if FLAT[key].default is None:
            members.append(None)
        return [m for m in members if m != value]
    if key == "kl_log_ratio_clamp":
        return [v for v in (None, (-0.3, 0.3)) if v != value]
    if isinstance(value, float) or value is None:
        return [v for v in (None, 0.7, 3.0) if v != value]
    return []


@pytest.mark.parametrize("base", list(BASES))
def test_a_stage_ignores_every_key_it_does_not_read(base: str) -> None:
    conv = Convention.of(**BASES[base])
    q = _full_walk(conv)
    varied = 0
    for stage in STAGES:
        if stage.phase == "grad":
            continue
        want = stage.run(q, conv, HP)
        unread = [k for k in FLAT if k not in stage.reads_now(conv)]
        for key in unread:
            for v in _other_values(key, conv.get(key)):
                try:
                    other = conv.with_updates({key: v})
                    got = stage.run(q, other, HP)
                except RefPPOError:
                    continue  # a combination the stage (or the Convention) refuses
                varied += 1
                assert all(_same(got[n], want[n]) for n in stage.makes), (stage.name, key, v)
        for name in HPARAM_KEYS:
            if name in stage.reads_now(conv):
                continue
            value = getattr(HP, name)
            hp2 = dataclasses.replace(HP, **{name: 0.37 if value != 0.37 else 0.41})
            got = stage.run(q, conv, hp2)
            assert all(_same(got[n], want[n]) for n in stage.makes), (stage.name, name)
    assert varied > 100


def test_declared_reads_are_not_empty_promises() -> None:
    """Control for the test above: each stage's outputs DO change with some key it reads."""
    conv = Convention.of(**BASES["trl-like"])
    q = _full_walk(conv)
    for stage in (s for s in STAGES if s.name in ("kl", "rewards", "whitening", "policy_agg", "value")):
        want = stage.run(q, conv, HP)
        changed = False
        for key in stage.reads_now(conv):
            if key not in FLAT:
                continue
            for v in _other_values(key, conv.get(key)):
                try:
                    got = stage.run(q, conv.with_updates({key: v}), HP)
                except RefPPOError:
                    continue
                changed |= not all(_same(got[n], want[n]) for n in stage.makes)
        assert changed, stage.name


def test_walk_reuses_a_given_upstream_result_and_frees_the_rest() -> None:
    conv = Convention()
    q = _full_walk(conv)
    given = {k: q[k] for k in ("scores", "old_logprobs", "ref_logprobs", "mask")}
    kl = torch.full_like(q["kl"], 0.25)
    out = walk(ROLLOUT_STAGES[:5], {**given, "kl": kl}, conv, HP)
    assert out["kl"] is kl  # the KL stage did not run
    beta = HP.kl_coef
    r = out["token_rewards"]
    m = q["mask"]
    assert torch.allclose(torch.where(m, r, 0.0).sum(1), q["scores"] - beta * 0.25 * m.sum(1))
    kept = walk(ROLLOUT_STAGES[:5], given, conv, HP, keep=("token_rewards",))
    assert set(kept) == {"token_rewards"}


@pytest.mark.parametrize("base", list(BASES))
def test_the_naive_walk_equals_the_vectorized_walk(base: str) -> None:
    conv = Convention.of(**{k: v for k, v in BASES[base].items() if k != "dual_clip"})
    x = make_inputs(B=6, T=10, seed=5)
    m = x["response_mask"].bool()
    critic = conv.adv.estimator.value == "gae"
    kw: dict[str, Any] = dict(
        scores=x["scores"], old_logprobs=x["old_logprobs"], ref_logprobs=x["ref_logprobs"],
        old_values=x["old_values"] if critic else None, mask=m, hp=HP, conv=conv,
        group_index=torch.tensor([0, 0, 1, 1, 2, 2]), bootstrap_values=0.5 * x["scores"],
        rollout_logprobs=_behaviour(x),
    )  # fmt: skip
    vec, nai = rollout_quantities(**kw), rollout_quantities_naive(**kw)
    for name in ("token_rewards", "advantages", "returns"):
        a, b = getattr(vec, name), getattr(nai, name)
        assert float(torch.where(vec.value_mask, a - b, 0.0).abs().max()) <= 1e-10, name
    upd = dict(
        logprobs=x["logprobs"], values=x["values"] if critic else None, old_logprobs=x["old_logprobs"],
        old_values=x["old_values"] if critic else None, advantages=vec.advantages, returns=vec.returns,
        mask=m, value_mask_=vec.value_mask, ref_logprobs=x["ref_logprobs"], entropy=x["entropy"],
        rollout_logprobs=_behaviour(x),
    )  # fmt: skip
    uq = update_quantities(**upd, hp=HP, conv=conv)
    un = update_quantities_naive(update_inputs(**upd), hp=HP, conv=conv)
    for name in ("loss", "pg_loss", "vf_loss", "entropy_loss", "kl_loss", "pg_clipfrac", "approx_kl"):
        assert abs(float(getattr(uq, name)) - float(getattr(un, name))) <= 1e-10, name


def test_downstream_and_upstream_follow_the_table() -> None:
    assert downstream({"whitening"}) & set(OUTPUTS) == {
        "advantages", "pg_loss", "pg_clipfrac", "loss", "grad_logprobs", "grad_values",
    }  # fmt: skip
    assert "approx_kl" not in downstream({"advantages"})  # the ratio's statistics read no advantages
    assert keys_upstream("kl") == ("kl_estimator", "kl_log_ratio_clamp", "kl_value_clamp")
    assert "whiten_advantages" not in keys_upstream("vf_loss")  # returns are the raw advantages
    assert {"loss_agg", "value_loss_agg", "vf_mask"} <= set(keys_upstream("vf_loss"))


def test_an_enum_key_is_parsed_from_its_name_in_every_group() -> None:
    for key, enum in enum_keys().items():
        member = next(iter(enum))
        assert isinstance(member, Enum)
        assert Convention.of(**{key: member.value}).get(key) is member, key


def stage_table_markdown() -> str:
    """The stage table of spec/ppo.md, as :data:`STAGES` has it."""

    def code(names: tuple[str, ...]) -> str:
        return ", ".join(f"`{n}`" for n in names) or "—"

    def where(f: Any) -> str:
        return f"`{f.__module__.removeprefix('refppo.')}.{f.__name__}`"

    rows = ["| stage | keys read | hyperparameters | reads | makes | function | naive twin | core |"]
    rows.append("|---|---|---|---|---|---|---|---|")
    for s in STAGES:
        cells = (f"`{s.name}`", code(s.keys), code(s.hparams), code(s.reads), code(s.makes))
        rows.append("| " + " | ".join((*cells, where(s.fn), where(s.naive), s.core)) + " |")
    return "\n".join(rows)


def group_table_markdown() -> str:
    """The Convention groups' table of spec/conventions.md, as :data:`FLAT` has it."""
    rows = ["| group | flat keys |", "|---|---|"]
    for group in dict.fromkeys(fk.group for fk in FLAT.values()):
        keys = [f"`{k}`" for k, fk in FLAT.items() if fk.group == group]
        rows.append(f"| `{group}` | {', '.join(keys)} |")
    return "\n".join(rows)


def _between(text: str, begin: str) -> str:
    start = text.index(begin) + len(begin)
    return text[start : text.index("<!-- end -->", start)].strip()


def test_the_spec_tables_are_the_stage_table() -> None:
    from pathlib import Path

    spec = Path(__file__).resolve().parents[2] / "spec"
    assert _between((spec / "ppo.md").read_text(), "<!-- stage table -->") == stage_table_markdown()
    assert _between((spec / "conventions.md").read_text(), "<!-- group table -->") == group_table_markdown()


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_the_corrected_gradient_is_the_naive_twins(mode: str) -> None:
    """Under the rollout correction, autograd through the stages (the weighted ``ℓ``) equals the
    grads stage's naive twin (``w'_t·∂pg/∂l_t`` from the closed-form gradient), and the weight binds
    (the uncorrected gradient differs)."""
    x = make_inputs(B=6, T=10, seed=4)
    m = x["response_mask"].bool()
    conv = Convention.of(rollout_is="token", rollout_is_mode=mode, rollout_is_low=0.8, rollout_is_high=1.2)
    ro = rollout_quantities(
        scores=x["scores"], old_logprobs=x["old_logprobs"], ref_logprobs=x["ref_logprobs"],
        old_values=x["old_values"], mask=m, hp=HP, conv=conv,
    )  # fmt: skip
    q = update_inputs(
        logprobs=x["logprobs"], values=x["values"], old_logprobs=x["old_logprobs"],
        old_values=x["old_values"], advantages=ro.advantages, returns=ro.returns, mask=m,
        value_mask_=ro.value_mask, ref_logprobs=x["ref_logprobs"], entropy=x["entropy"],
        rollout_logprobs=_behaviour(x),
    )  # fmt: skip
    auto = update_grads(q, hp=HP, conv=conv)["grad_logprobs"]
    out = walk(UPDATE_STAGES, q, conv, HP, naive=True)
    naive = BY_NAME["grads"].run(out, conv, HP, naive=True)["grad_logprobs"]
    assert float((auto - naive).abs().max()) <= 1e-12
    plain = update_grads(q, hp=HP, conv=Convention())["grad_logprobs"]
    assert float((auto - plain).abs().max()) > 1e-3
