"""Issue #21: a CI gate that cannot pass on a wrong step.

The steps come from the hand-written trainer of ``grad_helpers`` (two simulated ranks × two
micro-batches, its own losses and autograd gradients); the bugs are switches of that trainer, never
the oracle's own re-enactments. Covered: misspelt output keys (``write_dump``, the loader,
``refppo diff``, ``assert_step_matches``), what was compared and what was not, the required outputs,
the provenance of every hyperparameter and a missing sidecar, and the rough edges of the key space
(``--set`` typos, a sidecar's unknown key, ``StepRecorder``'s conventions).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from grad_helpers import HP, TWO_RANKS_TWO_MB, Bugs, save_step, step_dump
from oracle_helpers import make_inputs, naive_dump, setup_for
from safetensors.torch import save_file

from refppo.dump.write import sidecar_for, write_dump
from refppo.errors import DumpError, RefPPOError
from refppo.oracle.cli import main
from refppo.oracle.presets.registry import PRESETS
from refppo.oracle.run import check_step
from refppo.testing import assert_step_matches

SIDECAR = {**HP, **TWO_RANKS_TWO_MB.sidecar()}
TYPOS = {"grad_logprobs": "grad_log_probs", "grad_values": "gradvalues", "pg_loss": "pgloss"}
"""The issue's misspellings of three outputs."""


def _renamed(d: dict[str, torch.Tensor], renames: dict[str, str]) -> dict[str, torch.Tensor]:
    return {renames.get(k, k): v for k, v in d.items()}


def _diff(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ---- 1. misspelt outputs ------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "typo"), sorted(TYPOS.items()))
def test_write_dump_refuses_a_misspelt_output_naming_it(tmp_path: Path, key: str, typo: str) -> None:
    d = _renamed(step_dump(logged_losses=True), {key: typo})
    assert typo in d
    path = tmp_path / "step.safetensors"
    with pytest.raises(DumpError, match=rf"unknown tensor key '{typo}' \(did you mean {key}\?\)"):
        write_dump(path, d, hparams=SIDECAR)
    assert not path.exists() and not sidecar_for(path).exists()  # nothing half-written


def test_write_dump_keeps_a_tensor_of_its_own(tmp_path: Path) -> None:
    # a key unlike any dump key (or only loosely like one: verl's token_level_scores) is the
    # trainer's own: written, and ignored by the oracle with a hint
    d = step_dump()
    d["token_level_scores"] = d["advantages"].clone()
    write_dump(tmp_path / "step.safetensors", d, hparams=SIDECAR)
    out = check_step(tmp_path / "step.safetensors", require=None)
    assert any("ignored unknown tensor key 'token_level_scores'" in n for n in out.result.diagnosis)


def test_the_issues_misspelt_buggy_step_never_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The per-micro-batch-mean bug with its outputs written as grad_log_probs, gradvalues, pgloss
    reported "MATCH: all 4 quantities", exit 0, and assert_step_matches passed."""
    d = _renamed(step_dump(bugs=Bugs(local_norm=True), logged_losses=True), TYPOS)
    with pytest.raises(RefPPOError, match="did you mean"):  # the user's own test fails
        assert_step_matches(d, hparams=SIDECAR)
    with pytest.raises(RefPPOError, match="did you mean"):  # even asking for nothing in particular
        assert_step_matches(d, hparams=SIDECAR, require=())
    # a file written without write_dump (as a trainer of its own might): refppo diff, exit 2
    path = tmp_path / "step.safetensors"
    save_file({k: v.contiguous() for k, v in d.items()}, str(path))
    sidecar_for(path).write_text(json.dumps(SIDECAR))
    rc, out, err = _diff(capsys, str(path))
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    for key, typo in TYPOS.items():
        assert f"'{typo}' (did you mean {key}?)" in err, err
    # spelt right, the same step fails and is named
    with pytest.raises(AssertionError, match="per-micro-batch normaliser"):
        assert_step_matches(_renamed(d, {v: k for k, v in TYPOS.items()}), hparams=SIDECAR)


# ---- 1. what was compared, what was required ----------------------------------------------------


def test_report_lists_what_was_compared_and_why_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = make_inputs(B=6, T=12, seed=2)
    inputs.pop("logprobs")  # no update-step policy input: pg_loss & co cannot be computed
    d = naive_dump(inputs, setup_for(), keep=("kl", "token_rewards", "advantages", "returns", "vf_loss"))
    path = tmp_path / "step.safetensors"
    write_dump(path, d, hparams=HP)
    rc, out, _ = _diff(capsys, str(path))
    assert rc == 0
    assert "compared:     kl, token_rewards, advantages, returns, vf_loss" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("not compared:"))
    assert "vf_clipfrac, entropy_loss, grad_values (not in the dump)" in line, line
    assert (
        "pg_loss, pg_clipfrac, approx_kl, loss, grad_logprobs "
        "(not computable from the dump's inputs (no logprobs))" in line
    )
    assert "kl_loss (kl_in=reward: no KL loss)" in line
    rc, out, _ = _diff(capsys, str(path), "--json")
    rep = json.loads(out)
    assert rep["compared"] == ["kl", "token_rewards", "advantages", "returns", "vf_loss"]
    assert rep["not_compared"]["pg_loss"].startswith("not computable") and rep["not_compared"][
        "entropy_loss"
    ] == ("not in the dump")
    every = ("kl", "token_rewards", "advantages", "returns", "pg_loss", "pg_clipfrac", "approx_kl", "vf_loss")
    every += ("vf_clipfrac", "entropy_loss", "kl_loss", "loss", "grad_logprobs", "grad_values")
    assert set(rep["compared"]) | set(rep["not_compared"]) == set(every)


def test_an_update_input_nothing_reads_is_warned(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    d = naive_dump(make_inputs(B=6, T=12, seed=2), setup_for(), keep=("kl", "token_rewards", "advantages"))
    write_dump(tmp_path / "s.safetensors", d, hparams=HP)  # holds logprobs, values, entropy
    rc, out, _ = _diff(capsys, str(tmp_path / "s.safetensors"))
    assert rc == 0
    assert "warning: the dump holds logprobs but none of the outputs computed from it" in out
    assert (
        "returns, pg_loss, vf_loss, entropy_loss, loss, grad_logprobs, grad_values: the dump's inputs allow"
        in out
    )


def test_assert_step_matches_requires_every_output_the_inputs_allow() -> None:
    d = step_dump()  # a correct step: gradients and rollout outputs, no loss scalars
    with pytest.raises(AssertionError) as err:
        assert_step_matches(d, hparams=SIDECAR)
    msg = str(err.value)
    assert msg.startswith(
        "assert_step_matches: the required output(s) pg_loss, vf_loss, entropy_loss, loss were not compared"
    ), msg
    assert "require=()" in msg and "MATCH: all 6 quantities" in msg  # how to opt out; what did match
    assert assert_step_matches(d, hparams=SIDECAR, require=()).match
    assert assert_step_matches(d, hparams=SIDECAR, require=("grad_logprobs", "advantages")).match
    with pytest.raises(AssertionError, match=r"required output\(s\) pg_loss were not compared"):
        assert_step_matches(d, hparams=SIDECAR, require=("pg_loss", "grad_logprobs"))
    with pytest.raises(RefPPOError, match=r"'pgloss' is not a trainer output \(did you mean pg_loss\?\)"):
        assert_step_matches(d, hparams=SIDECAR, require=("pgloss",))
    # the logged metrics are compared when dumped but required only by name
    full = step_dump(logged_losses=True)
    assert assert_step_matches(full, hparams=SIDECAR).passed
    with pytest.raises(AssertionError, match=r"required output\(s\) pg_clipfrac were not compared"):
        assert_step_matches(full, hparams=SIDECAR, require=("pg_clipfrac",))


def test_diff_require_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_step(tmp_path, step_dump())
    assert _diff(capsys, str(path))[0] == 0  # nothing required: a match on what was compared
    rc, out, _ = _diff(capsys, str(path), "--require", "all")
    assert rc == 1 and "REQUIRED BUT NOT COMPARED: pg_loss, vf_loss, entropy_loss, loss" in out
    assert _diff(capsys, str(path), "--require", "grad_logprobs,grad_values")[0] == 0
    rc, out, _ = _diff(capsys, str(path), "--require", "all", "--json")
    rep = json.loads(out)
    assert (
        rc == 1
        and rep["match"] is True
        and rep["required_missing"] == ["pg_loss", "vf_loss", "entropy_loss", "loss"]
    )
    rc, _, err = _diff(capsys, str(path), "--require", "gradlogprobs")
    assert rc == 2 and "did you mean grad_logprobs?" in err


# ---- 2. where every hyperparameter came from; no sidecar ----------------------------------------


def test_missing_sidecar_under_a_preset_leads_with_no_sidecar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = save_step(tmp_path, step_dump(logged_losses=True))
    sidecar_for(path).unlink()
    rc, out, err = _diff(capsys, str(path), "--preset", "verl")
    # two ranks × two micro-batches, no sidecar: never "set ... in the sidecar" as if it existed
    assert rc == 2 and "in the sidecar" not in err
    assert (
        "(there is no sidecar: write step.safetensors.json beside the dump with world_size and the run's"
        in err
    )
    d = {k: v for k, v in step_dump(logged_losses=True).items() if k not in ("rank", "micro_batch")}
    p1 = tmp_path / "one.safetensors"
    write_dump(p1, d)
    sidecar_for(p1).unlink()
    rc, out, _ = _diff(capsys, str(p1), "--preset", "verl")
    lines = out.splitlines()
    assert lines[1].startswith("no sidecar: no one.safetensors.json beside the dump and no --hparams FILE"), (
        out
    )
    assert "hyperparameters from preset verl's defaults: gamma, lam" in out, out
    rc, out, _ = _diff(capsys, str(p1), "--preset", "verl", "--json")
    rep = json.loads(out)
    assert rep["sidecar"] is None and rep["diagnosis"][0].startswith("no sidecar")
    assert rep["hparams_source"]["vf_coef"] == "preset" and rep["hparams_source"]["whiten_eps"] == "default"
    # without a preset the missing hyperparameters are named after the missing sidecar
    rc, _, err = _diff(capsys, str(p1))
    assert (
        rc == 2
        and err.startswith("refppo diff: error: no sidecar: no one.safetensors.json")
        and "missing hyperparameters" in err
    )


def test_every_hyperparameter_names_its_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_step(tmp_path, step_dump(logged_losses=True))
    side = json.loads(sidecar_for(path).read_text())
    side.pop("vf_coef")
    sidecar_for(path).write_text(json.dumps(side))
    _, out, _ = _diff(capsys, str(path), "--preset", "verl", "--set", "cliprange=0.2", "--json")
    src = json.loads(out)["hparams_source"]
    assert src["gamma"] == "sidecar" and src["cliprange"] == "set" and src["vf_coef"] == "preset"
    assert src["horizon"] == "default"
    _, out, _ = _diff(capsys, str(path), "--preset", "verl", "--set", "cliprange=0.2")
    assert (
        "hyperparameters from the sidecar: gamma, lam, kl_coef, cliprange_value, ent_coef; --set: cliprange; "
        in out
    )
    assert "preset verl's defaults: vf_coef" in out and "no sidecar" not in out


def test_convention_line_shows_what_differs_and_all_under_v(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    conv = {"loss_agg": "seq-mean-token-mean"}
    path = save_step(tmp_path, step_dump(conv, logged_losses=True), conv)
    _, out, _ = _diff(capsys, str(path))
    line = next(ln for ln in out.splitlines() if ln.startswith("convention:"))
    assert (
        line == "convention: loss_agg=seq-mean-token-mean (the sidecar); "
        "the rest refppo's defaults (-v lists every key)"
    )
    _, out, _ = _diff(capsys, str(path), "-v")
    line = next(ln for ln in out.splitlines() if ln.startswith("convention:"))
    assert "kl_estimator=k1" in line and "loss_agg=seq-mean-token-mean" in line and "vf_mask=value" in line


# ---- rough edges of the key space ---------------------------------------------------------------


def test_set_typos_are_short_and_the_train_spelling_is_understood(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = save_step(tmp_path, step_dump(logged_losses=True))
    rc, _, err = _diff(capsys, str(path), "--set", "cliprang=0.1")
    assert rc == 2 and "did you mean cliprange?" in err and len(err) < 160, err
    rc, out, _ = _diff(capsys, str(path), "--set", "ppo.cliprange=0.1", "--json")
    rep = json.loads(out)
    assert rep["hparams"]["cliprange"] == 0.1 and rep["hparams_source"]["cliprange"] == "set"
    rc, _, err = _diff(capsys, str(path), "--set", "rollout.cliprange=0.1")
    assert rc == 2 and "did you mean cliprange? (refppo diff's keys have no section)" in err


def test_an_unknown_sidecar_key_names_the_sidecar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_step(tmp_path, step_dump(logged_losses=True))
    side = json.loads(sidecar_for(path).read_text())
    sidecar_for(path).write_text(json.dumps({**side, "clip_range": 0.2}))
    rc, _, err = _diff(capsys, str(path))
    assert rc == 2 and err.startswith(f"refppo diff: error: {sidecar_for(path)}: unknown key 'clip_range'"), (
        err
    )
    assert "did you mean cliprange?" in err


def test_write_dump_refuses_a_sidecar_the_oracle_would_refuse(tmp_path: Path) -> None:
    with pytest.raises(DumpError, match=r"unknown sidecar key 'clip_range' \(did you mean cliprange\?\)"):
        write_dump(tmp_path / "a.safetensors", step_dump(), hparams={**SIDECAR, "clip_range": 0.2})
    with pytest.raises(DumpError, match="loss_agg: unknown name 'token_mean'"):
        write_dump(
            tmp_path / "b.safetensors", step_dump(), hparams=SIDECAR, convention={"loss_agg": "token_mean"}
        )
    assert not any(tmp_path.iterdir())


def test_diff_help_lists_every_preset(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--preset NAME a peer's conventions: " + ", ".join(PRESETS) in text
    assert {"skyrl", "areal"} <= set(PRESETS)


def test_malicious_pt_is_one_clean_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "evil.pt"
    path.write_bytes(
        b"\x80\x02cposix\nsystem\nq\x00X\n\x00\x00\x00echo pwnedq\x01\x85q\x02Rq\x03."
    )  # a protocol-2 pickle calling os.system (never run: the load is weights-only)
    rc, out, err = _diff(capsys, str(path))
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "it is a pickle that calls posix.system, which the weights-only unpickler blocks" in err, err
    assert "\x1b[" not in err and "weights_only=False" not in err and not err.rstrip().endswith("...")


def test_assert_step_matches_hides_its_frames_from_pytest(tmp_path: Path) -> None:
    dump = save_step(tmp_path, step_dump(bugs=Bugs(ddp_sum=True), logged_losses=True))
    test = tmp_path / "test_user.py"
    test.write_text(
        textwrap.dedent(
            f"""
            from refppo.testing import assert_step_matches

            def test_step():
                assert_step_matches({str(dump)!r})
            """
        )
    )
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        check=False,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "summed over ranks where DDP averages" in r.stdout  # the report is the failure message
    assert "refppo/testing.py" not in r.stdout and "outcome = check_step(" not in r.stdout, r.stdout


def test_the_sidecar_keys_write_dump_accepts_are_the_oracles() -> None:
    from refppo.dump.keys import SIDECAR_SAMPLING_KEYS, SIDECAR_SCORING_KEYS, STEP_KEYS
    from refppo.dump.write import SIDECAR_KEYS
    from refppo.oracle.check.settings import ALL_KEYS

    assert set(SIDECAR_KEYS) == set(ALL_KEYS) | SIDECAR_SCORING_KEYS | SIDECAR_SAMPLING_KEYS | set(STEP_KEYS)
