"""refppo.train.rundir.resume_mismatch on a checkpoint written by an older refppo (config keys added since).

Plain dicts stand for the configs: "old" is the config as the older refppo wrote it, "now" the
same run's config under this refppo, which has one more ``[ppo]`` key, a new ``[extra]`` section
and a new resumable ``[run]`` key. The hashes written by the older refppo are ``config_hash(old)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from refppo.train import rundir

SKIP = ("iterations", "progress")
OLD: dict[str, Any] = {"run": {"iterations": 3, "seed": 0}, "ppo": {"cliprange": 0.2}}
DEFAULTS: dict[str, Any] = {
    "run": {"iterations": 10, "seed": 0, "progress": True},
    "ppo": {"cliprange": 0.2, "score_clip": None},
    "extra": {"knob": 1.0},
}


def _now(**ppo: Any) -> dict[str, Any]:
    return {
        "run": {"iterations": 5, "seed": 0, "progress": False},  # progress: new, resumable, not default
        "ppo": {"cliprange": 0.2, "score_clip": None, **ppo},
        "extra": {"knob": 1.0},
    }


def _check(now: dict[str, Any], saved: dict[str, Any] = OLD, tmp: Path = Path("ck")) -> str | None:
    old_hash = rundir.config_hash(saved, SKIP)
    state = {"run_id": "abc", "config_hash": old_hash, "config": saved}
    ident = rundir.RunIdentity("abc", old_hash, "")
    return rundir.resume_mismatch(
        state, ident, now, rundir.config_hash(now, SKIP), SKIP, tmp, defaults=DEFAULTS
    )


def test_keys_added_at_their_default_are_accepted_with_the_older_hash() -> None:
    now = _now()
    assert rundir.config_hash(now, SKIP) != rundir.config_hash(OLD, SKIP)  # a plain hash check refuses
    assert rundir.absent_keys(OLD, now, SKIP) == ("ppo.score_clip", "extra.knob")
    assert rundir.without_keys(now, ["ppo.score_clip", "extra.knob"]) == {
        "run": {"iterations": 5, "seed": 0, "progress": False},
        "ppo": {"cliprange": 0.2},
    }
    assert _check(now) is None
    # without defaults, no absent key is accepted
    old_hash = rundir.config_hash(OLD, SKIP)
    state = {"run_id": "abc", "config_hash": old_hash, "config": OLD}
    plain = rundir.resume_mismatch(state, rundir.RunIdentity("abc", old_hash, ""), now, "h", SKIP, Path("ck"))
    assert "ppo.score_clip=None, extra.knob=1.0 are not in the checkpoint's config" in str(plain)


@pytest.mark.parametrize(
    ("now", "expected"),
    [
        (
            _now(score_clip=2.0),
            "--resume: ppo.score_clip=2.0 is not in the checkpoint's config (written by an older refppo, "
            "which had no such key): resuming would change the run (it ran as ppo.score_clip=None)",
        ),
        (
            {**_now(), "extra": {"knob": 3}},
            "--resume: extra.knob=3 is not in the checkpoint's config (written by an older refppo, "
            "which had no such key): resuming would change the run (it ran as extra.knob=1.0)",
        ),
    ],
    ids=["ppo-key", "new-section"],
)
def test_an_added_key_set_otherwise_is_refused_in_one_line(now: dict[str, Any], expected: str) -> None:
    assert _check(now) == expected


def test_a_saved_key_unknown_here_is_refused_and_named() -> None:
    saved = {"run": {"iterations": 3, "seed": 0}, "ppo": {"cliprange": 0.2, "gone": 1}, "old": {"x": 1}}
    problem = _check(_now(), saved, Path("ck"))
    assert problem == (
        "--resume: the config of checkpoint 'ck' has ppo.gone, old, which this refppo does not know "
        "(written by a newer refppo?): resuming would change the run"
    )


def test_a_changed_key_and_a_wrong_hash_are_still_refused() -> None:
    saved = {"run": {"iterations": 3, "seed": 0}, "ppo": {"cliprange": 0.1}}
    assert _check(_now(), saved) == (
        "--resume with a different config (only run.iterations and logging may change): "
        "ppo.cliprange: 0.1 -> 0.2"
    )
    now = _now()
    old_hash = rundir.config_hash(OLD, SKIP)
    state = {"run_id": "abc", "config_hash": old_hash, "config": OLD}
    other_run_hash = rundir.RunIdentity("abc", "h0", "")
    problem = rundir.resume_mismatch(state, other_run_hash, now, "h", SKIP, Path("ck"), defaults=DEFAULTS)
    assert "config hashes" in str(problem)
