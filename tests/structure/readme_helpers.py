"""What the README tests share: the README's fenced blocks, running a README command, and a PPO
step computed by hand.

The hand-written step is plain torch written from spec/ppo.md (refppo's defaults: k1 KL in the
reward, score on the last valid token, GAE, whitened advantages, clipped losses, token-mean), never
refppo's own code, so a wrong reference cannot agree with it by construction. ``refppo train`` runs
get the tiny sizes of :data:`TINY` appended for the keys the README's command does not set itself.
:data:`SCENARIOS` names the README commands the tests run, :data:`BY_HAND` those they do not.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from refppo.cli import main as refppo_main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
HP = {"gamma": 0.99, "lam": 0.9, "kl_coef": 0.1, "cliprange": 0.2, "cliprange_value": 0.2, "vf_coef": 0.1}

TINY: tuple[str, ...] = (
    "model.n_embd=32",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_positions=24",
    "model.threads=1",
    "model.device=cpu",
    "task.sft_steps=5",
    "task.sft_batch_size=8",
    "task.rm_steps=5",
    "task.rm_pairs=32",
    "task.rm_batch_size=16",
    "rollout.batch_size=8",
    "rollout.max_new_tokens=6",
    "ppo.epochs=2",
    "ppo.minibatches=2",
    "ppo.micro_batches=2",
    "run.iterations=2",
    "run.sample_every=0",
    "run.progress=false",
    "run.plot=false",
)
"""Appended to each ``refppo train`` run, minus the keys the README's command sets itself."""

BY_HAND: dict[str, str] = {
    "make demo": "installs and trains ~30 s; run by hand (figures in benchmarks/RESULTS.md)",
    "make test": "the whole suite (20-30 min)",
    "refppo demo": "the demo preset, ~25 s; run by hand (benchmarks/RESULTS.md)",
    "refppo demo --grpo": "the demo preset, ~15 s; run by hand (benchmarks/RESULTS.md)",
    "torchrun --nproc-per-node 2 -m refppo train --device cpu": "2 processes, the default 30 "
    "iterations; run by hand (tests/train/test_ddp.py runs torchrun at test size)",
    "torchrun --nproc-per-node 4 -m refppo train --config my.toml --device cuda": "needs 4 GPUs",
}


# --- the README ---------------------------------------------------------------------------------


def blocks(lang: str) -> list[str]:
    """The bodies of the README's fenced blocks of ``lang``."""
    text = README.read_text(encoding="utf-8")
    return [m.group(1) for m in re.finditer(rf"^```{lang}\n(.*?)^```$", text, re.S | re.M)]


def command_key(line: str) -> str:
    """A README line as one command: its words, the trailing ``# comment`` dropped."""
    return " ".join(shlex.split(line, comments=True))


def readme_commands() -> list[str]:
    cmds = [command_key(line) for body in blocks("bash") for line in body.splitlines()]
    return [c for c in cmds if c]


def python_block(first_line: str) -> str:
    found = [b for b in blocks("python") if b.splitlines()[0] == first_line]
    assert len(found) == 1, (
        f"README.md: expected one python block starting {first_line!r}, found {len(found)}"
    )
    return found[0]


# --- running a command --------------------------------------------------------------------------


@dataclass
class Result:
    rc: int
    out: str
    err: str


def run(cmd: str, cwd: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> Result:
    """Run a README command in ``cwd``: ``refppo`` in this process (the console script's entry
    point), ``python`` as a subprocess of this interpreter."""
    argv = shlex.split(cmd) + list(extra)
    if argv[0] == "python":
        p = subprocess.run([sys.executable, *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=600)
        return Result(p.returncode, p.stdout, p.stderr)
    assert argv[0] == "refppo", cmd
    old = Path.cwd()
    os.chdir(cwd)
    try:
        capsys.readouterr()
        try:
            rc = refppo_main(argv[1:])
        except SystemExit as e:  # argparse's --help / usage errors
            rc = int(e.code or 0)
    finally:
        os.chdir(old)
    got = capsys.readouterr()
    return Result(rc, got.out, got.err)


def set_keys(argv: list[str]) -> set[str]:
    return {argv[i + 1].split("=", 1)[0] for i, a in enumerate(argv[:-1]) if a == "--set"}


FLAG_KEYS = {"--iterations": "run.iterations", "--device": "model.device", "--out": "run.out_dir"}


def tiny_for(cmd: str) -> list[str]:
    """``--set`` pairs of :data:`TINY` for the keys ``cmd`` leaves alone."""
    argv = shlex.split(cmd)
    own = set_keys(argv) | {FLAG_KEYS[a] for a in argv if a in FLAG_KEYS}
    out: list[str] = []
    for kv in TINY:
        if kv.split("=", 1)[0] not in own:
            out += ["--set", kv]
    return out


def train(cmd: str, cwd: Path, capsys: pytest.CaptureFixture[str]) -> Result:
    r = run(cmd, cwd, capsys, *tiny_for(cmd))
    assert r.rc == 0, f"{cmd}: exit {r.rc}\n{r.err[-2000:]}"
    return r


# --- a PPO step by hand (refppo's default convention), the dump it makes -------------------------


def hand_step(lengths: list[int], T: int, seed: int = 0) -> dict[str, Tensor]:
    """Inputs and rollout outputs of one PPO step, computed by plain loops (spec/ppo.md)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    f64: dict[str, Any] = {"dtype": torch.float64}
    mask = torch.zeros(B, T, **f64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    old = -0.5 - torch.rand(B, T, generator=g, **f64)
    ref = old + 0.1 * torch.randn(B, T, generator=g, **f64)
    old_values = torch.randn(B, T, generator=g, **f64)
    scores = torch.randn(B, generator=g, **f64)
    kl = (old - ref) * mask  # k1
    rewards = -HP["kl_coef"] * kl
    adv = torch.zeros(B, T, **f64)
    for b, n in enumerate(lengths):
        rewards[b, n - 1] += scores[b]
        nxt, a = 0.0, 0.0
        for t in reversed(range(n)):
            delta = float(rewards[b, t]) + HP["gamma"] * nxt - float(old_values[b, t])
            a = delta + HP["gamma"] * HP["lam"] * a
            adv[b, t], nxt = a, float(old_values[b, t])
    returns = (adv + old_values) * mask
    n_tok = float(mask.sum())
    mu = float((adv * mask).sum()) / n_tok
    var = float((((adv - mu) * mask) ** 2).sum()) / (n_tok - 1)
    white = (adv - mu) / (var + 1e-8) ** 0.5 * mask
    return {
        "mask": mask,
        "old_logprobs": old,
        "ref_logprobs": ref,
        "old_values": old_values,
        "scores": scores,
        "kl": kl,
        "token_rewards": rewards,
        "advantages": white,
        "returns": returns,
        "logprobs": old + 0.05 * torch.randn(B, T, generator=g, **f64),
        "values": old_values + 0.3 * torch.randn(B, T, generator=g, **f64),
    }


def token_losses(step: dict[str, Tensor], lp: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token clipped policy loss and ½·max((V − R)², (V_clip − R)²), clipped around V_old."""
    eps, eps_v = HP["cliprange"], HP["cliprange_value"]
    a = step["advantages"]
    ratio = torch.exp(lp - step["old_logprobs"])
    pg = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - eps, 1 + eps))
    v_clip = torch.clamp(v, step["old_values"] - eps_v, step["old_values"] + eps_v)
    vf = 0.5 * torch.maximum((v - step["returns"]) ** 2, (v_clip - step["returns"]) ** 2)
    return pg, vf


def dump_names(step: dict[str, Tensor]) -> dict[str, Any]:
    """The names the README's ``write_dump`` block reads: the step and its token-mean losses."""
    pg, vf = token_losses(step, step["logprobs"], step["values"])
    n = step["mask"].sum()
    return dict(step, pg_loss=(pg * step["mask"]).sum() / n, vf_loss=(vf * step["mask"]).sum() / n)


def write_readme_dump(tmp: Path, name: str) -> None:
    """Run the README's ``write_dump`` block in ``tmp`` on the hand step (the file renamed to ``name``)."""
    code = python_block("from refppo.dump import write_dump")
    exec_in(tmp, code.replace('"step.safetensors"', f'"{name}"'), dump_names(hand_step([5, 3, 4], T=5)))


def exec_in(cwd: Path, code: str, names: dict[str, Any]) -> dict[str, Any]:
    old = Path.cwd()
    os.chdir(cwd)
    try:
        exec(compile(code, str(README), "exec"), names)  # the README's own code
    finally:
        os.chdir(old)
    return names


def tiny_gpt2(kind: str, vocab: int, pad: int) -> Any:
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=vocab, n_embd=16, n_layer=1, n_head=2, n_positions=32, num_labels=1
    )
    cfg.pad_token_id = pad
    return getattr(transformers, kind)(cfg)


def save_local_models(tmp: Path) -> None:
    """./my-sft-model (a causal LM with a word-level tokenizer), ./my-rm, prompts.txt, myrewards.py."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "<eos>", "review", ":", "the", "a", "movie", "was", "good", "bad", "plot"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )
    tok.save_pretrained(tmp / "my-sft-model")
    lm = tiny_gpt2("GPT2LMHeadModel", len(words), 0)
    lm.config.eos_token_id = 2
    lm.save_pretrained(tmp / "my-sft-model")
    tiny_gpt2("GPT2ForSequenceClassification", len(words), 0).save_pretrained(tmp / "my-rm")
    (tmp / "prompts.txt").write_text("review : the movie\nreview : a plot was\n")
    (tmp / "myrewards.py").write_text(
        textwrap.dedent(
            """
            def score(prompt: str, response: str) -> float:
                return float(response.split().count("good"))
            """
        )
    )


def metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


DIFF = [
    "refppo diff step.safetensors",
    "refppo diff step.safetensors --preset trl",
    "refppo diff step.pt --preset verl --set kl_estimator=k3 --set loss_agg=seq-mean-token-mean",
    "refppo diff step.npz --hparams hp.json --detect --json",
    "python tools/diff_against.py step.safetensors --preset trl",
]
RESCORE = [
    "refppo diff step.safetensors --actor ckpt/actor --ref ckpt/ref --critic ckpt/critic"
    " --reward-model ckpt/rm"
]


SCENARIOS: dict[str, list[str]] = {
    "diff": DIFF,
    "rescore": RESCORE,
    "help": ["refppo train --help-config ppo", "refppo train --print-config"],
    "config": [
        "refppo train --config my.toml --set ppo.cliprange=0.1 --set ppo.loss_agg=seq-mean-token-sum",
        "refppo train --set kl.adaptive=true --set kl.target=6 --set kl.horizon=10000",
        "refppo train --set ppo.advantage=grpo --set rollout.group_size=8 --set ppo.whiten_advantages=none",
    ],
    "local": [
        "refppo train --model ./my-sft-model --reward-model ./my-rm --prompts prompts.txt",
        "refppo train --model ./my-sft-model --reward myrewards:score --prompts prompts.txt",
    ],
    "run_folder": [
        "refppo train --out runs/a --set run.checkpoint_every=10",
        "refppo train --out runs/a --resume --set run.iterations=40",
        "refppo train --out runs/a --overwrite",
    ],
    "dump": [
        "refppo train --out runs/dumped --set run.iterations=2 --set run.dump_iteration=2"
        " --set ppo.minibatches=1",
        "refppo diff runs/dumped/dumps/iter_000002.safetensors",
    ],
}
"""The README commands this file runs, by the test that runs them."""
