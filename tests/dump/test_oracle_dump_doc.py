"""spec/dump-format.md's worked examples use refppo's defaults and say what the oracle really prints.

- "Writing a dump from a trainer": the code block, run on refppo's own pipeline outputs, writes a
  dump (and sidecar) that ``refppo diff`` matches without a preset.
- "Report and exit codes": the JSON example is the report of the scenario it describes — a dump
  from a refppo-default trainer whose GAE bootstraps the last valid token from the padded slot's
  value (bug written here from its definition, as in test_oracle_bugs.py), checked with no preset.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from oracle_helpers import (
    HP,
    gae_loop,
    lengths_of,
    make_inputs,
    refppo_dump,
    rows,
    save,
    setup_for,
    whiten_list,
)

from refppo.oracle.cli import main

DOC = Path(__file__).resolve().parents[2] / "spec" / "dump-format.md"


def _block(heading: str, lang: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    section = text.split(heading, 1)[1]
    match = re.search(rf"```{lang}\n(.*?)```", section, re.S)
    assert match, f"no ```{lang} block after {heading!r}"
    return match.group(1)


def test_write_dump_example_uses_refppo_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = _block("## Writing a dump from a trainer", "python")
    inputs = make_inputs(seed=7)
    tensors = refppo_dump(inputs, setup_for())  # refppo's own pipeline under its defaults
    names = {k: v for k, v in tensors.items() if k != "response_mask"}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dumps").mkdir()
    exec(compile(code, str(DOC), "exec"), {**names, "response_mask": inputs["response_mask"], "step": 1})
    dumps = sorted((tmp_path / "dumps").glob("*.safetensors"))
    assert len(dumps) == 1
    assert main([str(dumps[0])]) == 0  # no preset: the sidecar's conventions are refppo's own


def _bootstrap_bug_dump() -> dict[str, torch.Tensor]:
    d = refppo_dump(make_inputs(seed=7), setup_for())
    lengths = lengths_of(d["response_mask"])
    B, T = d["response_mask"].shape
    r, v = rows(d["token_rewards"]), rows(d["old_values"])
    adv = []
    for b in range(B):
        n = lengths[b]
        boot = v[b][n] if n < T else 0.0  # the bug: V of the first padded slot (junk) bootstraps
        adv.append(gae_loop(r[b], v[b], n, HP["gamma"], HP["lam"], boot) + [0.0] * (T - n))
    d["returns"] = torch.tensor(
        [[adv[b][t] + v[b][t] if t < lengths[b] else 0.0 for t in range(T)] for b in range(B)],
        dtype=torch.float64,
    )
    flat = [a for row, n in zip(adv, lengths, strict=True) for a in row[:n]]
    mu, inv = whiten_list(flat)
    d["advantages"] = torch.tensor(
        [[(adv[b][t] - mu) * inv if t < lengths[b] else 0.0 for t in range(T)] for b in range(B)],
        dtype=torch.float64,
    )
    for k in ("pg_loss", "pg_clipfrac", "approx_kl", "vf_loss", "vf_clipfrac", "entropy_loss", "loss"):
        d.pop(k)
    return d


def test_json_report_example_is_real_output_under_refppo_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shown = json.loads(_block("## Report and exit codes", "json"))
    assert shown["preset"] is None
    path = save(tmp_path, _bootstrap_bug_dump(), setup_for())
    assert main([str(path), "--json"]) == 1
    real = json.loads(capsys.readouterr().out)
    for key in ("match", "first_divergence", "diagnosis", "explained_by", "preset"):
        assert shown[key] == real[key], key
    for key, value in shown["convention"].items():  # the keys shown are the run's (refppo defaults)
        if key != "...":
            assert real["convention"][key] == value, key
    for key, value in shown["hparams"].items():
        if key != "...":
            assert real["hparams"][key] == value, key
    for name, q in shown["quantities"].items():
        if name != "...":
            assert real["quantities"][name]["ok"] == q["ok"], name


def _v2_block(lang: str) -> str:
    return _block("## v2: the whole optimizer step", lang)


def test_v2_worked_example_is_real_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from grad_helpers import Bugs, save_step, step_dump

    shown = json.loads(_v2_block("json"))
    path = save_step(tmp_path, step_dump({}, Bugs(local_norm=True)), {})
    assert main([str(path), "--json"]) == 1
    real = json.loads(capsys.readouterr().out)
    for key in ("match", "first_divergence", "diagnosis", "explained_by", "preset"):
        assert shown[key] == real[key], key
    for key in ("B", "T", "dtype"):
        assert shown["dump"][key] == real["dump"][key], key
    assert list(shown["quantities"]) == list(real["quantities"])
    for name, q in shown["quantities"].items():
        assert real["quantities"][name]["ok"] == q["ok"], name
        for k in ("max_abs_err", "max_rel_err", "tol"):
            if k in q:  # shown to 2-3 significant digits
                assert abs(real["quantities"][name][k] - q[k]) <= 0.01 * q[k], (name, k)


def test_v2_ci_example_runs_as_a_user_test(tmp_path: Path) -> None:
    from grad_helpers import Bugs, step_dump

    code = _block("### Check your trainer in CI", "python")
    ns: dict[str, object] = {"run_one_optimizer_step": lambda tmp: step_dump(logged_losses=True)}
    exec(compile(code, str(DOC), "exec"), ns)
    test = ns["test_one_optimizer_step_matches_refppo"]
    assert callable(test)
    test(tmp_path)  # a correct step passes
    ns["run_one_optimizer_step"] = lambda tmp: step_dump(bugs=Bugs(ddp_sum=True), logged_losses=True)
    with pytest.raises(AssertionError, match="summed over ranks where DDP averages"):
        test(tmp_path)
    # the same correct step without its loss scalars fails: every output its inputs allow is required
    ns["run_one_optimizer_step"] = lambda tmp: step_dump()
    with pytest.raises(AssertionError, match=r"required output\(s\) pg_loss, vf_loss, entropy_loss, loss"):
        test(tmp_path)
