"""The diagnosis's shortcuts change no result (issue #9's scale work).

:class:`refppo.oracle.check.fastcheck.PrefixCheck` computes the KL/reward pre-test once per
:func:`~refppo.oracle.check.fastcheck.reward_key`; :func:`refppo.oracle.check.recompute.recompute` can
continue a
rollout-only result with the update stage. Each is checked against the direct computation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle_helpers import make_inputs, refppo_dump, save, setup_for, with_behaviour

from refppo.conventions import (
    AdvantageEstimator,
    GaeHoles,
    GaePadding,
    KLPlacement,
    Variance,
    WhitenEps,
    WhitenHoles,
    Whitening,
)
from refppo.dump.load import load_dump
from refppo.errors import RefPPOError
from refppo.group_conventions import GroupKL, GroupSingleton, GroupStdLevel
from refppo.oracle.check.alternatives import ALTERNATIVES
from refppo.oracle.check.diagnose import compare_all
from refppo.oracle.check.fastcheck import PrefixCheck, reward_key, rollout_prefix_ok
from refppo.oracle.check.recompute import BUGS, recompute
from refppo.oracle.check.settings import Setup
from refppo.pipeline.step import reward_quantities

BASES = {
    "openrlhf": ("openrlhf", {}),
    "trl-whitened": ("trl", {"whiten_rewards": "masked", "score_bias": -0.3, "score_scale": 1.5}),
    "kl-in-loss": ("verl", {"kl_in": "loss", "kl_estimator": "k3"}),
}


def _alternatives(base: Setup) -> list[Setup]:
    out = []
    for alts in ALTERNATIVES.values():
        for upd in alts:
            out.append(
                base.with_convention({k: tuple(v) if isinstance(v, list) else v for k, v in upd.items()})
            )
    return out


def _rewards(dump, setup: Setup, bug: str | None) -> tuple[torch.Tensor, ...]:  # type: ignore[no-untyped-def]
    t = dump.tensors
    src = "logprobs" if bug == "kl_from_current_logprobs" else "old_logprobs"
    kw = {
        "scores": t["scores"],
        "old_logprobs": t[src],
        "ref_logprobs": t["ref_logprobs"],
        "mask": dump.mask,
        "hp": setup.hp,
        "conv": setup.conv,
    }
    out = reward_quantities(**kw)
    if bug == "kl_reward_sign_flipped":  # the same estimate, the reward's penalty with + (BUGS)
        return (out[0], *reward_quantities(**kw, kl=-out[0])[1:])
    return out


@pytest.mark.parametrize("base_name", sorted(BASES))
def test_reward_key_covers_what_the_reward_step_reads(tmp_path: Path, base_name: str) -> None:
    """Two settings with the same key give bit-identical kl, token_rewards and value mask, and the
    memoised pre-test gives the direct pre-test's verdict for every candidate of the diagnosis."""
    preset, upd = BASES[base_name]
    base = setup_for(preset, upd)
    inp = make_inputs(B=6, T=12, seed=5)
    inp["scores"] = inp["scores"] * 4.0
    dump = load_dump(save(tmp_path, refppo_dump(inp, base), base))
    seen: dict[tuple[object, ...], tuple[torch.Tensor, ...]] = {}
    n_shared = 0
    for first in ("kl", "token_rewards", "advantages"):
        memo = PrefixCheck(dump, first)
        for alt in _alternatives(base):
            for bug in (None, "kl_from_current_logprobs", "kl_reward_sign_flipped"):
                assert memo(alt, bug) == rollout_prefix_ok(dump, alt, first, bug), (alt, bug)
                if first != "kl":
                    continue
                got = _rewards(dump, alt, bug)
                key = reward_key(alt, bug)
                if key in seen:
                    n_shared += 1
                    for a, b in zip(seen[key], got, strict=True):
                        assert torch.equal(a, b), (alt, bug)
                else:
                    seen[key] = got
        assert len(memo.verdicts) < len(_alternatives(base))  # the memo does share verdicts
    assert len(seen) > 3 and n_shared > 10


RC_CHECKED = {
    "is_sum_not_mean": {"rollout_is": "sequence", "rollout_is_agg": "geometric", "rollout_is_high": 2.0},
    **{b: {"rollout_is": "token", "rollout_is_mode": "mask", "rollout_is_low": 0.5, "rollout_is_high": 2.0}
       for b in ("truncate_mask_swapped", "cap_on_log_ratio", "old_is_behaviour", "is_weight_against_current",
                 "nonfinite_through_mask")},
}  # fmt: skip
"""The rollout correction's bugs (refppo.pipeline.bugs_rollout) under a correction each can run
(``is_weight_not_detached`` needs a gradient: not in this dump)."""


@pytest.mark.parametrize("bug", [None, *(b for b in BUGS if b != "is_weight_not_detached")])
def test_update_stage_continues_a_rollout_only_reference(tmp_path: Path, bug: str | None) -> None:
    """``recompute(rollout=recompute(rollout_only=True))`` equals one full ``recompute``, bit for
    bit, and ``compare_all(known=...)`` the comparison of everything."""
    made = setup_for("openrlhf", {"kl_estimator": "k3"})
    checked = setup_for("verl", RC_CHECKED.get(bug or "", {}))
    inp = with_behaviour(make_inputs(B=5, T=10, seed=6))
    dump = load_dump(save(tmp_path, refppo_dump(inp, made), made))
    whole = recompute(dump, checked, bug=bug)
    ro = recompute(dump, checked, bug=bug, rollout_only=True)
    assert set(ro.values) < set(whole.values)
    cont = recompute(dump, checked, bug=bug, rollout=ro)
    assert list(cont.values) == list(whole.values)
    for name, v in whole.values.items():
        assert torch.equal(cont.values[name], v), name
    assert torch.equal(cont.value_mask, whole.value_mask)
    assert torch.equal(cont.advantages_raw, whole.advantages_raw)
    direct = compare_all(dump, whole)
    assert not all(r.ok for r in direct.values())  # a mismatching setting: the comparison says so
    assert compare_all(dump, cont, known=compare_all(dump, ro)) == direct


def test_index_helpers_match_their_definitions() -> None:
    """The last-True / score-slot / value-mask helpers without ``[B, T]`` int64 buffers equal the
    definitions they replaced (``where(m, arange(T), -1).amax(1)``, ``m | one_hot(pos)``), empty rows
    included."""
    from refppo.conventions import ScorePosition
    from refppo.core.rewards import _score_positions
    from refppo.oracle.check.compare import _last_true, _one_per_row
    from refppo.pipeline.rollout import value_mask

    g = torch.Generator().manual_seed(1)
    n_empty = 0
    for B, T in [(1, 1), (3, 5), (40, 97), (17, 1)]:
        for trial in range(12):
            m = torch.rand(B, T, generator=g) < torch.rand(1, generator=g)
            if trial % 3 == 0:
                m[0] = False
            n_empty += int((~m.any(dim=1)).sum())
            pos = torch.arange(T).expand(B, T)
            last = torch.where(m, pos, -1).amax(dim=1)
            assert torch.equal(_last_true(m), last)
            assert torch.equal(_one_per_row(last, T), pos == last.unsqueeze(1))
            assert torch.equal(_score_positions(m, ScorePosition.LAST_VALID), last)
            full = m.clone()
            full[:, 0] = True
            for where in ScorePosition:
                p = _score_positions(full, where)
                one_hot = torch.nn.functional.one_hot(p, num_classes=T).to(torch.bool)
                assert torch.equal(value_mask(full, where), full | one_hot)
    assert n_empty > 4


ROLLOUT_BASES = {**BASES, "grpo": ("verl", {"advantage": "grpo", "group_singleton": "score"})}


@pytest.mark.parametrize("base_name", sorted(ROLLOUT_BASES))
def test_rollout_key_covers_what_the_rollout_reads(tmp_path: Path, base_name: str) -> None:
    """Settings (and bugs) with the same :func:`rollout_key` get bit-identical steps 1-4, so the
    rollout memo of ``--detect``'s re-checks changes no result; a check through the memo equals one
    without it."""
    from refppo.oracle.check.diagnose import check
    from refppo.oracle.check.fastcheck import RolloutMemo, rollout_key

    preset, upd = ROLLOUT_BASES[base_name]
    base = setup_for(preset, upd)
    inp = make_inputs(B=5, T=11, seed=7)
    inp["group_index"] = torch.tensor([0, 0, 1, 1, 2])  # prompts (row 4 alone in its group)
    m = inp["response_mask"]
    rows = [b for b in range(m.shape[0]) if int(m[b].sum()) >= 4]
    m[rows, 1] = 0  # interior holes (multi-turn): the hole conventions then matter
    assert rows
    dump = load_dump(save(tmp_path, refppo_dump(inp, base), base))
    seen: dict[tuple[object, ...], object] = {}
    n_shared = 0
    memo = RolloutMemo(dump)
    enums = {
        "gae_padding": GaePadding,
        "gae_holes": GaeHoles,
        "whiten_holes": WhitenHoles,
        "whiten_advantages": Whitening,
        "whiten_variance": Variance,
        "whiten_eps_at": WhitenEps,
        "kl_in": KLPlacement,
        "advantage": AdvantageEstimator,
        "group_kl": GroupKL,
        "group_std": Variance,
        "group_std_level": GroupStdLevel,
        "group_singleton": GroupSingleton,
    }
    every = []
    for upd in [{k: v} for k, cls in enums.items() for v in cls] + [{"group_eps": 1e-3}]:
        try:
            every.append(base.with_convention(upd))
        except RefPPOError:  # a combination the Convention refuses (group_kl=to_go + whiten_rewards)
            continue
    for alt in _alternatives(base) + every:
        for bug in (None, *BUGS):
            try:
                ro = recompute(dump, alt, bug=bug, rollout_only=True)
            except (ValueError, RefPPOError):  # a bug needing logprobs, a singleton group refused
                continue
            key = rollout_key(alt, bug)
            if key in seen:
                n_shared += 1
                prev = seen[key]
                for name, v in ro.values.items():
                    assert torch.equal(prev.values[name], v), (alt, bug, name)  # type: ignore[attr-defined]
                assert torch.equal(prev.value_mask, ro.value_mask)  # type: ignore[attr-defined]
                assert torch.equal(prev.advantages_raw, ro.advantages_raw)  # type: ignore[attr-defined]
            else:
                seen[key] = ro
        try:
            direct = check(dump, alt, explain_divergence=False)
        except RefPPOError:
            continue
        via = check(dump, alt, explain_divergence=False, rollouts=memo)
        assert via.quantities == direct.quantities and via.diagnosis == direct.diagnosis, alt
    assert len(seen) > 3 and n_shared > 10
