"""Every command of README.md works as written (#20 item 7, #21 item 9): the oracle's side.

The README's fenced ``bash`` lines are extracted and each one is either run for real by this file or
``test_readme_train_commands.py`` — in a scratch folder holding the files it names (a dump written by
the README's own ``write_dump`` block from a PPO step computed by hand, ``my.toml`` from the README's
``toml`` block, local models) — or listed in ``readme_helpers.BY_HAND`` with the reason it is not
(minutes of work or a GPU); a README command in neither list fails. Every flag of every command, run
or not, must exist in its program's ``--help`` (``--set SECTION.KEY`` of the trainer: in
``--help-config``). The README's Python blocks (``write_dump``, the ``StepRecorder`` loop and its
``assert_step_matches`` test) are executed with a hand-written trainer's tensors bound to their names.
"""

from __future__ import annotations

import inspect
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from readme_helpers import (
    BY_HAND,
    DIFF,
    HP,
    README,
    RESCORE,
    ROOT,
    SCENARIOS,
    blocks,
    dump_names,
    exec_in,
    hand_step,
    python_block,
    readme_commands,
    run,
    set_keys,
    tiny_gpt2,
    token_losses,
    write_readme_dump,
)
from torch import Tensor


@pytest.fixture
def dumps(tmp_path: Path) -> Path:
    """step.safetensors, step.pt, step.npz (sidecar moved to hp.json) by the README's block."""
    for name in ("step.safetensors", "step.pt", "step.npz"):
        write_readme_dump(tmp_path, name)
    (tmp_path / "step.npz.json").rename(tmp_path / "hp.json")
    (tmp_path / "tools").symlink_to(ROOT / "tools")
    return tmp_path


# --- classification and flags -------------------------------------------------------------------


def test_every_readme_command_is_run_here_or_listed_by_hand() -> None:
    cmds = readme_commands()
    assert len(cmds) == len(set(cmds)), "a README command appears twice"
    ran = {c for cases in SCENARIOS.values() for c in cases}
    unknown = [c for c in cmds if c not in ran and c not in BY_HAND]
    assert not unknown, f"README commands neither run by this test nor listed in BY_HAND: {unknown}"
    stale = sorted((ran | set(BY_HAND)) - set(cmds))
    assert not stale, f"commands this test runs that the README no longer shows: {stale}"


@cache
def help_text(*argv: str) -> str:
    """What ``argv --help`` prints (``refppo SUB``, ``torchrun``, ``python SCRIPT``)."""
    if argv[0] == "refppo":
        p = subprocess.run(
            [sys.executable, "-m", "refppo", *argv[1:], "--help"], capture_output=True, text=True, timeout=300
        )
    elif argv[0] == "torchrun":
        p = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--help"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    else:
        p = subprocess.run(
            [sys.executable, *argv[1:], "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
        )
    assert p.returncode == 0, f"{argv} --help: exit {p.returncode}: {p.stderr[-500:]}"
    return p.stdout


@cache
def train_keys() -> set[str]:
    p = subprocess.run(
        [sys.executable, "-m", "refppo", "train", "--help-config"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    return set(re.findall(r"^  ([a-z_]+\.[a-z_]+)  \(", p.stdout, re.M))


def flags_of(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def programs(cmd: str) -> Iterator[tuple[tuple[str, ...], list[str]]]:
    """(the program whose --help lists a flag, the flags) of each program ``cmd`` runs."""
    argv = shlex.split(cmd)
    if argv[0] == "torchrun":
        i = argv.index("-m")
        yield ("torchrun",), flags_of(argv[1:i])
        argv = ["refppo", *argv[i + 2 :]]
    if argv[0] == "refppo":
        yield ("refppo", argv[1]), flags_of(argv[2:])
    elif argv[0] == "python":
        yield ("python", argv[1]), flags_of(argv[2:])


@pytest.mark.parametrize("cmd", readme_commands())
def test_every_flag_of_a_readme_command_exists(cmd: str) -> None:
    argv = shlex.split(cmd)
    if argv[0] == "make":
        makefile = (ROOT / "Makefile").read_text()
        assert re.search(rf"^{re.escape(argv[1])}:", makefile, re.M), f"Makefile has no target {argv[1]!r}"
        return
    assert argv[0] in ("refppo", "torchrun", "python"), f"unknown program in README: {cmd}"
    for prog, flags in programs(cmd):
        text = help_text(*prog)
        for flag in flags:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), (
                f"{cmd}: {flag} not in {prog} --help"
            )
    if argv[0] != "python" and "train" in argv:
        unknown = set_keys(argv) - train_keys()
        assert not unknown, f"{cmd}: --set keys not in refppo train --help-config: {unknown}"


# --- the oracle's commands ----------------------------------------------------------------------


def test_diff_commands_on_the_dump_of_the_readme_block(
    dumps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hand step under refppo's defaults matches; under the trl preset (score one slot later)
    and verl's preset with k3 it does not; --detect finds the default; the console script and the
    tools/ wrapper give the same verdicts."""
    plain, trl, verl, detect, tool = (run(c, dumps, capsys) for c in DIFF)
    assert (plain.rc, "MATCH" in plain.out) == (0, True), plain.out + plain.err
    assert "pg_loss" in plain.out and "vf_loss" in plain.out and "advantages" in plain.out
    assert trl.rc == 1 and "first divergence" in trl.out, trl.out + trl.err
    assert verl.rc == 1 and "first divergence: kl" in verl.out, verl.out + verl.err
    assert detect.rc == 0, detect.err
    report = json.loads(detect.out)
    assert report["match"] is True and report["detected_count"] >= 1 and report["detected_changes"][0] == {}
    assert (tool.rc, tool.out) == (trl.rc, trl.out)
    script = Path(sys.executable).with_name("refppo")
    if script.exists():
        p = subprocess.run(
            [str(script), *shlex.split(DIFF[0])[1:]], cwd=dumps, capture_output=True, text=True
        )
        assert (p.returncode, p.stdout) == (0, plain.out)


def test_rescore_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's re-scoring command on a dump with sequences: it runs (no bad input), re-scores
    every model given, and reports the hand step's log-probs as not the actor's (exit 1)."""
    torch.manual_seed(0)
    names = dump_names(hand_step([5, 3, 4], T=5))
    B, T = names["mask"].shape
    P, vocab = 3, 40
    ids = torch.randint(3, vocab, (B, P + T))
    am = torch.ones(B, P + T, dtype=torch.long)
    am[:, P:] = names["mask"].long()
    am[0, 0] = 0  # a left-padded prompt
    ids[am == 0] = 0
    names.update(input_ids=ids, attention_mask=am)
    code = python_block("from refppo.dump import write_dump")
    code = code.replace(
        '"vf_loss": vf_loss}', '"vf_loss": vf_loss, "input_ids": input_ids, "attention_mask": attention_mask}'
    )
    code = code.replace('"vf_coef": 0.1}', '"vf_coef": 0.1, "temperature": 0.7}')
    assert "input_ids" in code and "temperature" in code
    exec_in(tmp_path, code, names)
    for d, kind in [
        ("actor", "GPT2LMHeadModel"),
        ("ref", "GPT2LMHeadModel"),
        ("critic", "GPT2ForTokenClassification"),
        ("rm", "GPT2ForSequenceClassification"),
    ]:
        tiny_gpt2(kind, vocab, 0).save_pretrained(tmp_path / "ckpt" / d)
    r = run(RESCORE[0], tmp_path, capsys)
    assert r.rc == 1, r.out + r.err
    assert "old_logprobs" in r.out and "re-scor" in r.out.lower(), r.out


# --- the CI section: StepRecorder + assert_step_matches -----------------------------------------


def ci_loop_names(buggy: bool) -> dict[str, Any]:
    """What the README's recorder block reads: two micro-batches of 16 and 12 tokens (28 in the
    step), a policy and a critic that are parameters, and ``my_loss`` — token-mean over the step
    (``buggy``: over each micro-batch, the micro-batch losses averaged), returning the loss and its
    terms as the trainer logs them."""
    step = hand_step([5, 6, 5, 4, 3, 5], T=6, seed=1)
    n_step = step["mask"].sum()
    mbs = []
    for rows in (slice(0, 3), slice(3, 6)):
        mb = SimpleNamespace(**{k: v[rows] for k, v in step.items()})
        mb.theta = mb.logprobs.clone().requires_grad_(True)
        mb.phi = mb.values.clone().requires_grad_(True)
        mbs.append(mb)
    assert [float(mb.mask.sum()) for mb in mbs] == [16.0, 12.0]

    def my_loss(logprobs: Tensor, values: Tensor, mb: SimpleNamespace) -> tuple[Tensor, SimpleNamespace]:
        pg, vf = token_losses(vars(mb), logprobs, values)
        n = mb.mask.sum() * len(mbs) if buggy else n_step
        terms = SimpleNamespace(pg_loss=(pg * mb.mask).sum() / n, vf_loss=(vf * mb.mask).sum() / n)
        return terms.pg_loss + HP["vf_coef"] * terms.vf_loss, terms

    params = [p for mb in mbs for p in (mb.theta, mb.phi)]
    return {
        "micro_batches": mbs,
        "policy": lambda mb: mb.theta * 1.0,
        "critic": lambda mb: mb.phi * 1.0,
        "my_loss": my_loss,
        "optimizer": torch.optim.SGD(params, lr=0.0),
    }


@pytest.mark.parametrize("buggy", [False, True], ids=["correct", "per_micro_batch_mean"])
def test_ci_section_blocks(tmp_path: Path, buggy: bool) -> None:
    """The README's recorder loop and its test, run as written: a correct loop passes; the
    per-micro-batch mean fails with exactly the README's quoted explanation."""
    recorder = python_block("from refppo.capture import StepRecorder")
    test_code = python_block("# tests/test_ppo_step.py in your repository")

    def run_one_step(path: Path) -> Path:
        exec_in(path, recorder, ci_loop_names(buggy))
        return path / "step.safetensors"

    ns = exec_in(tmp_path, test_code, {"run_one_step": run_one_step})
    quoted = [line for b in blocks("text") for line in b.splitlines() if line.strip()]
    assert quoted, "README.md: the failure the CI section quotes is gone"
    if not buggy:
        ns["test_one_step_matches_refppo"](tmp_path)
        sidecar = json.loads((tmp_path / "step.safetensors.json").read_text())
        assert sidecar["micro_batches"] == 2 and {k: sidecar[k] for k in HP} == HP
        return
    with pytest.raises(AssertionError) as e:
        ns["test_one_step_matches_refppo"](tmp_path)
    report = str(e.value)
    for line in quoted:
        assert line in report, f"the README quotes a line the oracle does not print:\n{line}\n---\n{report}"


def test_readme_signatures_exist() -> None:
    """The call forms the README spells out exist with those parameters."""
    from refppo.capture import adapters
    from refppo.testing import assert_step_matches

    text = README.read_text(encoding="utf-8")
    assert (
        'assert_step_matches(dump_or_tensors, *, preset=None, hparams=None, require="all", **conventions)'
        in " ".join(text.split())
    )
    P = inspect.Parameter
    got = [(p.name, p.kind, p.default) for p in inspect.signature(assert_step_matches).parameters.values()]
    assert got == [
        ("dump_or_tensors", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("preset", P.KEYWORD_ONLY, None),
        ("hparams", P.KEYWORD_ONLY, None),
        ("require", P.KEYWORD_ONLY, "all"),
        ("conventions", P.VAR_KEYWORD, P.empty),
    ]
    for call in re.findall(r"`((?:from|trace|verl|openrlhf|trl)_?\w*\([^`]*\))`", text):
        name, args = call.split("(", 1)
        fn: Callable[..., Any] = getattr(adapters, name)
        params = inspect.signature(fn).parameters
        for kw in re.findall(r"(\w+)=", args):
            assert kw in params, f"README: {name}() has no parameter {kw!r}"


# --- the trainer's commands ---------------------------------------------------------------------
