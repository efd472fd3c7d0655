"""``--detect`` walks the rollout correction and solves its caps (issue #22 item 3).

Dumps come from the naive twins (``oracle_helpers.naive_dump``: ``is_weights_naive`` into the
corrected surrogate token by token) with behaviour log-probs ``l^prox − noise`` (weights from ≈ 0.3
to ≈ 5, so every cap binds on some tokens and not on others). ``--detect`` starts from refppo's
defaults (correction off): the generating correction must be listed, with a cap that is not a named
value solved from ``pg_loss``; a dump made with the correction off lists no correction that acts;
a dump without ``rollout_logprobs`` walks no ``rollout_is*`` key. The solvers are checked on fixed,
hand-computed vectors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs, naive_dump, save, setup_for, with_behaviour

from refppo.dump.load import load_dump
from refppo.oracle.detect.correction import nicest_in, step_intervals
from refppo.oracle.detect.detection import detect
from refppo.oracle.detect.search import Search
from refppo.oracle.detect.solve import solve_min_hinge

KEYS = ("rollout_is", "rollout_is_agg", "rollout_is_mode", "rollout_is_low", "rollout_is_high")


def _inputs(with_beh: bool = True) -> dict[str, torch.Tensor]:
    x = make_inputs(B=8, T=12, seed=5)
    return with_behaviour(x) if with_beh else x


def _detected(tmp: Path, conv: dict[str, Any], with_beh: bool = True) -> Any:
    made = setup_for(None, conv)
    path = save(tmp, naive_dump(_inputs(with_beh), made), setup_for(None, {}))
    return detect(load_dump(path), setup_for(None, {}))


def _rc(entry: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(entry[k] for k in KEYS)


CASES: dict[str, tuple[dict[str, Any], tuple[Any, ...], tuple[str, float] | None]] = {
    # (the dump's correction, the entry expected, the bound solved (not a named value) or None)
    "token-tis-1.7": (
        {"rollout_is": "token", "rollout_is_high": 1.7},
        ("token", "product", "truncate", None, 1.7),
        ("rollout_is_high", 1.7),
    ),
    "token-tis-named-2": (
        {"rollout_is": "token", "rollout_is_high": 2.0}, ("token", "product", "truncate", None, 2.0), None
    ),
    "token-truncate-low-0.6": (
        {"rollout_is": "token", "rollout_is_low": 0.6, "rollout_is_high": 2.0},
        ("token", "product", "truncate", 0.6, 2.0),
        ("rollout_is_low", 0.6),
    ),
    "sequence-icepop-named": (
        {"rollout_is": "sequence", "rollout_is_mode": "mask", "rollout_is_low": 0.5, "rollout_is_high": 2.0},
        ("sequence", "product", "mask", 0.5, 2.0),
        None,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_generating_correction_is_listed_and_its_cap_solved(tmp_path: Path, case: str) -> None:
    conv, want, solved = CASES[case]
    found = _detected(tmp_path, conv)
    assert found.detected, (found.unmatched_stages, found.nearest)
    listed = {_rc(e) for e in found.detected}
    assert want in listed, sorted(listed, key=str)[:10]
    assert (None, "product", "truncate", None, None) not in listed  # off does not reproduce it
    if solved is not None:
        key, value = solved
        assert value in found.solved.get(key, []), found.solved


def test_a_masked_cap_is_solved_to_an_interval_of_equivalent_values(tmp_path: Path) -> None:
    """A mask's cap is fixed only between two observed weights: the listed value gives the
    generating weights (every token kept or dropped alike), checked through the pipeline."""
    conv = {"rollout_is": "sequence", "rollout_is_mode": "mask", "rollout_is_high": 2.5}
    found = _detected(tmp_path, conv)
    hits = [e for e in found.detected if _rc(e)[:4] == ("sequence", "product", "mask", None)]
    assert hits, sorted({_rc(e) for e in found.detected}, key=str)
    assert "rollout_is_high" in found.solved


def test_a_dump_without_the_correction_lists_no_acting_correction(tmp_path: Path) -> None:
    """The control: the correction off; with rollout_logprobs every acting correction changes
    pg_loss, so off (or an equivalent inactive one) is all that is listed."""
    found = _detected(tmp_path, {})
    assert found.detected
    assert {_rc(e)[0] for e in found.detected} == {None}, sorted({_rc(e) for e in found.detected}, key=str)


def test_without_rollout_logprobs_no_correction_key_is_walked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps: list[str] = []
    real = Search.expand

    def expand(self: Search, groups: Any, options: Any, checks: Any, stage: str) -> Any:
        steps.append(stage)
        return real(self, groups, options, checks, stage)

    monkeypatch.setattr(Search, "expand", expand)
    found = _detected(tmp_path, {}, with_beh=False)
    assert found.detected and "correction" not in steps and "policy" in steps
    assert all(e["rollout_is"] is None for e in found.detected)
    assert not any("rollout_is" in n for n in found.notes)  # a matching dump's report is unchanged


def test_without_rollout_logprobs_an_unmatched_policy_says_why(tmp_path: Path) -> None:
    """A corrected dump stripped of rollout_logprobs: no convention reproduces pg_loss, and the
    report says the correction could not be tried for want of that key."""
    conv = {"rollout_is": "token", "rollout_is_high": 1.7}
    made = setup_for(None, conv)
    tensors = naive_dump(_inputs(), made)
    del tensors["rollout_logprobs"]
    found = detect(load_dump(save(tmp_path, tensors, setup_for(None, {}))), setup_for(None, {}))
    assert not found.detected
    assert any(
        n.startswith("rollout_is: not walked (off): the dump has no rollout_logprobs") for n in found.notes
    )


def test_the_hinge_solver_on_fixed_weights() -> None:
    """pg(C) = Σ c_t·min(w_t, C) with w = (0.5, 1, 3), c = (1, 2, −1): at C = 2,
    0.5 + 2 − 2 = 0.5; on [1, 3] the slope is −1, so target 0.5 has the one root C = 2."""
    w = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64)
    c = torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)
    assert solve_min_hinge(w, c, 0.0, 0.5, 0.5, 3.0) == [2.0]


def test_the_step_solver_and_the_nicest_value_on_fixed_weights() -> None:
    """Σ_{w_t ≤ C} c_t·w_t with w = (0.5, 1.2, 1.9, 4), c·w = (1, 2, 4, 8): the target 3 is
    reached on [1.2, 1.9) only; the fewest digits inside is 1.3 (1.5 has as few; 1.3 is smaller)."""
    w = torch.tensor([1.9, 0.5, 4.0, 1.2], dtype=torch.float64)
    cw = torch.tensor([4.0, 1.0, 8.0, 2.0], dtype=torch.float64)
    assert step_intervals(w, cw, 3.0, 1e-9) == [(1.2, 1.9)]
    assert step_intervals(w, cw, 3.5, 1e-9) == []
    assert nicest_in(1.2, 1.9) == 1.3
    assert nicest_in(1.95, 2.4) == 2.0
    assert nicest_in(0.75, 0.7512) == 0.751
    assert nicest_in(2.0, 2.0) is None
