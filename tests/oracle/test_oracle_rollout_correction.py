"""The rollout correction in the stage table, checked end to end: a dump whose policy term comes from
the core's naive twins (``is_weights_naive`` into ``corrected_policy_loss_naive``, token by token:
``oracle_helpers.naive_outputs``) with ``rollout_is`` on matches under ``--set rollout_is=...``, and
mismatches under the default (off) with its first divergence at ``pg_loss``; the same dump without
``rollout_logprobs`` under the correction is refused in one line naming the key and the stage, and
without the correction it is checked as before (the key is required only then). The dump contract's
new keys: the behaviour log-probs' peer aliases, ``policy_version`` and the sampling sidecar keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs, naive_dump, save, setup_for, with_behaviour

from refppo.core.rollout_correction import is_weights_naive
from refppo.dump.load import load_dump, validate
from refppo.dump.write import write_dump
from refppo.errors import DumpError
from refppo.oracle.run import check_step

CASES: dict[str, dict[str, Any]] = {
    "token-tis-2": {"rollout_is": "token", "rollout_is_high": 2.0},
    "sequence-geometric-mask": {
        "rollout_is": "sequence", "rollout_is_agg": "geometric", "rollout_is_mode": "mask",
        "rollout_is_low": 0.8, "rollout_is_high": 1.25,
    },
}  # fmt: skip


def _inputs() -> dict[str, torch.Tensor]:
    """make_inputs plus behaviour log-probs ``l^prox − noise``: exp(d) spans 0.3..5 (the cap 2 binds)."""
    return with_behaviour(make_inputs(B=8, T=12, seed=5))


def _dump(tmp: Path, conv: dict[str, Any]) -> Path:
    x = _inputs()
    s = setup_for(None, conv)
    return save(tmp, naive_dump(x, s), s)


def test_the_cases_bind() -> None:
    """The inputs make each correction act: the cap truncates some tokens and not others; the
    geometric mask rejects some rows and keeps others (else a match would prove nothing)."""
    x = _inputs()
    m = x["response_mask"].bool()
    w, raw, _ = is_weights_naive(x["old_logprobs"], x["rollout_logprobs"], m, high=2.0)
    flat = [
        (a, b)
        for wr, rr, mr in zip(w, raw, m.tolist(), strict=True)
        for a, b, ok in zip(wr, rr, mr, strict=True)
        if ok
    ]
    assert any(b > 2.0 for _, b in flat) and any(b < 2.0 for _, b in flat)
    _, _, keep = is_weights_naive(
        x["old_logprobs"], x["rollout_logprobs"], m, level="sequence", agg="geometric", mode="mask",
        low=0.8, high=1.25,
    )  # fmt: skip
    rows = [any(k) for k in keep]
    assert any(rows) and not all(rows), rows


@pytest.mark.parametrize("case", list(CASES))
def test_a_corrected_naive_dump_matches_under_its_correction(tmp_path: Path, case: str) -> None:
    conv = CASES[case]
    out = check_step(_dump(tmp_path, conv), overrides={k: str(v) for k, v in conv.items()})
    assert out.result.match, (case, out.result.first_divergence, out.result.diagnosis)
    assert "pg_loss" in out.result.quantities and "loss" in out.result.quantities


@pytest.mark.parametrize("case", list(CASES))
def test_a_corrected_dump_mismatches_without_the_correction_at_pg_loss(tmp_path: Path, case: str) -> None:
    out = check_step(_dump(tmp_path, CASES[case]))
    assert not out.result.match
    assert out.result.first_divergence == "pg_loss", out.result.first_divergence


def test_without_rollout_logprobs_the_correction_names_the_key_and_the_stage(tmp_path: Path) -> None:
    conv = CASES["token-tis-2"]
    x = _inputs()
    s = setup_for(None, conv)
    tensors = naive_dump(x, s)
    del tensors["rollout_logprobs"]
    path = save(tmp_path, tensors, s)
    with pytest.raises(DumpError) as err:
        check_step(path, overrides={k: str(v) for k, v in conv.items()})
    msg = str(err.value)
    assert "\n" not in msg and "'rollout_logprobs'" in msg and "rollout_correction" in msg, msg
    assert str(path) in msg
    # without the correction the key is not required: the dump is checked (and mismatches at pg_loss)
    out = check_step(path)
    assert not out.result.match and out.result.first_divergence == "pg_loss"


def test_an_uncorrected_dump_without_rollout_logprobs_still_matches(tmp_path: Path) -> None:
    x = make_inputs(B=6, T=10, seed=2)
    s = setup_for(None, {})
    assert check_step(save(tmp_path, naive_dump(x, s), s)).result.match


@pytest.mark.parametrize("alias", ["rollout_log_probs", "sampling_per_token_logps"])
def test_the_peers_names_of_the_behaviour_logprobs_are_read_as_rollout_logprobs(alias: str) -> None:
    x = _inputs()
    x[alias] = x.pop("rollout_logprobs")
    d = validate(Path("<t>"), x, hparams={})
    assert d.aliased == {alias: "rollout_logprobs"}
    assert torch.equal(d.tensors["rollout_logprobs"], x[alias])


def test_rollout_logprobs_is_validated_like_old_logprobs() -> None:
    x = _inputs()
    bad = {**x, "rollout_logprobs": x["rollout_logprobs"][:, :-1]}
    with pytest.raises(DumpError, match=r"rollout_logprobs: expected shape \[B, T\]"):
        validate(Path("<t>"), bad, hparams={})
    nan = x["rollout_logprobs"].clone()
    nan[0, 0] = float("nan")  # row 0 is full: a valid position
    with pytest.raises(DumpError, match="rollout_logprobs: non-finite value at valid position"):
        validate(Path("<t>"), {**x, "rollout_logprobs": nan}, hparams={})
    junk = x["rollout_logprobs"].clone()
    junk[~x["response_mask"].bool()] = float("nan")  # padding may hold anything
    validate(Path("<t>"), {**x, "rollout_logprobs": junk}, hparams={})


def test_policy_version_is_a_row_integer_key() -> None:
    x = _inputs()
    ok = validate(Path("<t>"), {**x, "policy_version": torch.arange(8)}, hparams={})
    assert ok.tensors["policy_version"].dtype == torch.int64
    with pytest.raises(DumpError, match=r"policy_version: expected shape \[B\]"):
        validate(Path("<t>"), {**x, "policy_version": torch.arange(7)}, hparams={})
    with pytest.raises(DumpError, match="policy_version: expected an integer tensor"):
        validate(Path("<t>"), {**x, "policy_version": torch.zeros(8)}, hparams={})
    with pytest.raises(DumpError, match="policy_version: expected integers >= 0"):
        validate(Path("<t>"), {**x, "policy_version": torch.full((8,), -1)}, hparams={})


SAMPLING_OK = {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.05, "logprobs_processed": True}
SAMPLING_BAD = [("top_p", 0.0), ("top_p", 1.5), ("top_k", 2.5), ("top_k", -2), ("min_p", 1.1),
                ("logprobs_processed", 1), ("temperature", 0)]  # fmt: skip


def test_the_sampling_sidecar_keys_are_accepted_and_checked(tmp_path: Path) -> None:
    x = _inputs()
    d = validate(Path("<t>"), x, hparams=dict(SAMPLING_OK))
    assert {k: d.hparams[k] for k in SAMPLING_OK} == SAMPLING_OK
    write_dump(tmp_path / "ok.safetensors", x, hparams={**SAMPLING_OK})  # the writer accepts them too
    for key, value in SAMPLING_BAD:
        with pytest.raises(DumpError, match=rf"{key}: expected"):
            validate(Path("<t>"), x, hparams={**SAMPLING_OK, key: value})
        with pytest.raises(DumpError, match=rf"{key}: expected"):
            write_dump(tmp_path / "bad.safetensors", x, hparams={key: value})


def test_a_sampling_sidecar_does_not_change_the_check(tmp_path: Path) -> None:
    """The sampling keys are no PPO setting: a dump with them is checked as without."""
    x = make_inputs(B=6, T=10, seed=2)
    s = setup_for(None, {})
    path = save(tmp_path, naive_dump(x, s), s)
    assert check_step(load_dump(path), hparams=None).result.match
    assert check_step(path, hparams=dict(SAMPLING_OK)).result.match


def test_the_step_recorder_takes_the_behaviour_logprobs_and_the_policy_version(tmp_path: Path) -> None:
    from refppo.capture.recorder import StepRecorder

    x = _inputs()
    rec = StepRecorder(hparams={"cliprange": 0.2, "top_p": 0.9, "logprobs_processed": False}, grads=False)
    half = {k: v[:4] for k, v in x.items()}
    rest = {k: v[4:] for k, v in x.items()}
    for part, versions in ((half, [3, 3, 2, 2]), (rest, [1, 1, 0, 0])):
        rec.record(
            response_mask=part["response_mask"], old_logprobs=part["old_logprobs"],
            ref_logprobs=part["ref_logprobs"], old_values=part["old_values"], scores=part["scores"],
            rollout_logprobs=part["rollout_logprobs"], policy_version=torch.tensor(versions),
        )  # fmt: skip
    rec.write(tmp_path / "rec.safetensors")
    d = load_dump(tmp_path / "rec.safetensors")
    m = d.mask
    assert torch.equal(d.tensors["rollout_logprobs"][m], x["rollout_logprobs"][m])
    assert d.tensors["policy_version"].tolist() == [3, 3, 2, 2, 1, 1, 0, 0]
    assert d.hparams["top_p"] == 0.9 and d.hparams["logprobs_processed"] is False


@pytest.mark.parametrize("case", list(CASES))
def test_detect_evaluates_the_checked_correction(tmp_path: Path, case: str) -> None:
    """``--detect`` under ``--set rollout_is=...``: the policy step weights ``ℓ`` by the checked
    setting's ``w'`` (the rollout_correction stage), so the generating convention is detected and
    every stage is matched; the keys themselves are not walked yet (NOT_WALKED)."""
    conv = CASES[case]
    out = check_step(
        _dump(tmp_path, conv), overrides={k: str(v) for k, v in conv.items()}, detect_conventions=True
    )
    det = out.detection
    assert det is not None and det.n_detected >= 1 and not det.unmatched_stages, (
        det.unmatched_stages,
        det.notes,
    )


def test_the_diagnosis_names_the_correction_left_off(tmp_path: Path) -> None:
    """A trainer that applies verl's token TIS (cap 2, its default threshold) checked without the
    correction: the diagnosis names the correction, and that the checked setting leaves it off."""
    out = check_step(_dump(tmp_path, CASES["token-tis-2"]))
    r = out.result
    assert r.first_divergence == "pg_loss"
    changes = [e["change"] for e in r.explained_by if e["kind"] == "convention"]
    assert {
        "rollout_is": "token",
        "rollout_is_mode": "truncate",
        "rollout_is_low": None,
        "rollout_is_high": 2.0,
    } in changes
    assert any("rollout_is=token" in line and "rollout correction off" in line for line in r.diagnosis), (
        r.diagnosis
    )


def test_the_diagnosis_names_the_correction_the_trainer_does_not_apply(tmp_path: Path) -> None:
    """The converse: an uncorrected dump (with its engine log-probs) checked under the correction."""
    x = _inputs()
    s = setup_for(None, {})
    path = save(tmp_path, naive_dump(x, s), s)
    conv = CASES["token-tis-2"]
    r = check_step(path, overrides={k: str(v) for k, v in conv.items()}).result
    assert r.first_divergence == "pg_loss"
    assert {"rollout_is": None} in [e["change"] for e in r.explained_by]
    assert any("rollout_is=none" in line and "rollout correction on" in line for line in r.diagnosis), (
        r.diagnosis
    )


def test_assert_step_matches_takes_the_correction_and_the_behaviour_logprobs() -> None:
    from refppo.testing import assert_step_matches

    x = _inputs()
    s = setup_for(None, CASES["token-tis-2"])
    tensors = naive_dump(x, s)
    hp = {**{k: v for k, v in s.hparams_dict().items() if v is not None}, "top_p": 0.95}
    assert_step_matches(
        tensors, hparams=hp, require=("pg_loss", "loss"), rollout_is="token", rollout_is_high=2.0
    )
    with pytest.raises(AssertionError, match="pg_loss"):
        assert_step_matches(tensors, hparams=hp, require=("pg_loss", "loss"))
