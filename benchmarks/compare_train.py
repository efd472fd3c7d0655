"""Bit-identity of two source trees' PPO training: metrics, parameters, optimizer state, dumps.

Usage (by hand; not a test)::

    .venv/bin/python benchmarks/compare_train.py OLD_ROOT NEW_ROOT [--iterations 3]
                                                 [--scenario NAME ...]

``OLD_ROOT``/``NEW_ROOT`` are directories holding a ``refppo/`` package (e.g. ``git archive REV
refppo | tar -x -C /tmp/old``), of either layout: the in-process scenarios import each name from
its defining module in the layered layout (``refppo.pipeline.settings``,
``refppo.train.iteration``, ``refppo.models.rollout``, ``refppo.models.tiny``, ...) and fall back
to the flat one (``refppo.pipeline``, ``refppo.ppo``, ``refppo.models.rollout``, ``refppo.models``); the
line ``layout:`` says which modules each tree's names came from. Each scenario runs in fresh
interpreters per tree (same seeds, ``PYTHONPATH`` = the tree, checked), then every metric of every
iteration is compared with ``==`` (as Python floats; NaN equals NaN), every tensor with
``torch.equal``, every other file byte for byte. Prints the counts and the first differences; exit
0 when nothing differs, 1 otherwise (a difference, or a scenario that failed to run in a tree).

Scenarios:

- ``critic``: GAE, llama, 2 epochs × 2 minibatches × micro-batches of 2, PPO-ptx, clipped grad
  norms, a capture of one step (a v2 dump);
- ``critic-dropout``: gpt2 with dropout 0.1 in the update (the global RNG's order of use);
- ``grpo``: critic-free group estimator, gpt2, micro-batches of 2, capture;
- ``torchrun``: ``torchrun --standalone --nproc-per-node 2 -m refppo train`` (gloo, CPU, the
  ``test`` preset's sizes, rule reward): ``metrics.jsonl`` (all but the ``time/*`` keys), and every
  checkpoint file: ``*.safetensors`` and ``COMPLETE`` byte for byte, the ``*.pt`` files (optimizer
  states, each rank's RNG state) tensor by tensor, ``state.json`` and ``config.json`` as JSON
  without the run's identity (``run_id``) and folder (``run.out_dir``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

SCENARIOS = ("critic", "critic-dropout", "grpo", "torchrun")
PROMPTS = [[1, 5, 6], [1, 7, 8, 9], [1, 5, 6], [1, 7, 8, 9], [1, 4], [1, 3, 3], [1, 4], [1, 3, 3]]
GROUPS = [0, 1, 0, 1, 2, 3, 2, 3]
TRAIN_SETS = (
    "model.policy=tiny_gpt2", "model.n_embd=32", "model.n_layer=1", "model.n_head=2",
    "model.n_positions=24", "model.threads=1", "model.device=cpu", "task.sft_steps=3",
    "task.sft_batch_size=8", "task.rm_steps=5", "task.rm_pairs=32", "task.rm_batch_size=16",
    "task.reward=rule", "rollout.batch_size=8", "rollout.max_new_tokens=6", "ppo.epochs=2",
    "ppo.minibatches=2", "ppo.micro_batches=2", "run.sample_every=0", "run.progress=false",
    "run.plot=false",
)  # fmt: skip
"""``refppo train --set`` of the ``torchrun`` scenario (the ``test`` preset, rule reward): the same
for both trees, whatever their presets say; ``run.iterations`` is ``--iterations``."""


def _imports() -> tuple[dict[str, Any], list[str]]:
    """The names the in-process scenarios use, from the layered layout else the flat one."""
    import importlib

    table = {
        "Convention": ("refppo.pipeline.settings", "refppo.pipeline"),
        "Hyperparams": ("refppo.pipeline.settings", "refppo.pipeline"),
        "iteration": ("refppo.train.iteration", "refppo.ppo"),
        "CaptureRequest": ("refppo.train.update_config", "refppo.ppo"),
        "MinibatchRecord": ("refppo.train.update_config", "refppo.ppo"),
        "PPOUpdateConfig": ("refppo.train.update_config", "refppo.ppo"),
        "PtxBatch": ("refppo.train.update_config", "refppo.ppo"),
        "RolloutConfig": ("refppo.models.rollout", "refppo.models.rollout"),
        "left_pad": ("refppo.models.batch", "refppo.models"),
        "make_reference": ("refppo.models.roles", "refppo.models"),
        "tiny_actor": ("refppo.models.tiny", "refppo.models"),
        "tiny_critic": ("refppo.models.tiny", "refppo.models"),
        "StepRecorder": ("refppo.capture.recorder", "refppo.capture"),
    }
    names: dict[str, Any] = {}
    used: list[str] = []
    for name, modules in table.items():
        for module in modules:
            try:
                names[name] = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                continue
            used.append(f"{module}.{name}")
            break
        else:
            raise ImportError(f"{name}: in none of {modules}")
    return names, used


def _convention(conv_cls: Any, critic_free: bool) -> Any:
    keys = {"advantage": "grpo"} if critic_free else {}
    if hasattr(conv_cls, "from_dict"):
        return conv_cls.from_dict(keys)
    return conv_cls(**keys)


def _setup(scenario: str) -> dict[str, Any]:
    """Models, optimizers and update settings of an in-process scenario (seeded)."""
    import torch

    n, used = _imports()
    left_pad, make_reference, tiny_actor, tiny_critic = (
        n[k] for k in ("left_pad", "make_reference", "tiny_actor", "tiny_critic")
    )
    torch.manual_seed(123)
    critic_free = scenario == "grpo"
    arch: Literal["gpt2", "llama"] = "llama" if scenario == "critic" else "gpt2"
    drop = 0.1 if scenario == "critic-dropout" else 0.0
    actor = tiny_actor(arch, 32, seed=0, hidden=32, dropout=drop)
    critic = None if critic_free else tiny_critic(arch, 32, seed=1, hidden=32, dropout=drop)
    pids, pm = left_pad(PROMPTS, 0)
    ptx = n["PtxBatch"](
        torch.tensor([[1, 5, 6, 7, 2], [1, 7, 8, 2, 0]]), torch.tensor([[1] * 5, [1] * 4 + [0]])
    )
    cfg = n["PPOUpdateConfig"](
        ppo_epochs=2, num_minibatches=2, micro_batch_size=2, max_grad_norm=0.5,
        ptx_coef=0.0 if critic_free else 0.1, dropout_in_update=drop > 0,
    )  # fmt: skip
    return {
        "n": n, "used": used, "actor": actor, "critic": critic, "ref": make_reference(actor),
        "pids": pids, "pm": pm, "cfg": cfg, "critic_free": critic_free,
        "opt_a": torch.optim.Adam(actor.parameters(), lr=1e-2),
        "opt_c": torch.optim.Adam(critic.parameters(), lr=1e-2) if critic is not None else None,
        "conv": _convention(n["Convention"], critic_free), "hp": n["Hyperparams"](kl_coef=0.05),
        "ptx": None if critic_free else ptx,
    }  # fmt: skip


def _run(scenario: str, iterations: int, out: Path) -> None:
    """Run ``scenario`` with the ``refppo`` on ``sys.path``; write metrics.json, tensors.pt, dumps."""
    import torch

    s = _setup(scenario)
    n, hp, conv = s["n"], s["hp"], s["conv"]
    records: list[Any] = []
    gen = torch.Generator().manual_seed(7)
    metrics: list[dict[str, float]] = []
    for it in range(iterations):
        rec = n["StepRecorder"](hparams=hp, conventions=conv)
        cap = n["CaptureRequest"](1, 1, rec, str(out / f"dump{it}.safetensors"))
        res = n["iteration"](
            s["actor"], s["ref"], s["critic"], lambda p, r: float(sum(r) % 5) / 5.0, s["opt_a"],
            s["opt_c"], s["pids"], s["pm"], rollout_cfg=n["RolloutConfig"](max_new_tokens=5),
            update_cfg=s["cfg"], hp=hp, conv=conv, generator=gen, ptx_batch=s["ptx"],
            on_minibatch=records.append, capture=cap,
            group_index=torch.tensor(GROUPS) if s["critic_free"] else None,
        )  # fmt: skip
        metrics.append(res.metrics)
    tensors: dict[str, torch.Tensor] = {}
    for role, model in (("actor", s["actor"]), ("critic", s["critic"])):
        if model is not None:
            tensors.update({f"{role}.{k}": v for k, v in model.state_dict().items()})
    for role, opt in (("opt_a", s["opt_a"]), ("opt_c", s["opt_c"])):
        if opt is not None:
            for pid, state in opt.state_dict()["state"].items():
                tensors.update({f"{role}.{pid}.{k}": v for k, v in state.items() if torch.is_tensor(v)})
    for i, r in enumerate(records):
        tensors.update({f"rec{i}.rows": r.rows, f"rec{i}.old": r.old_logprobs, f"rec{i}.lp": r.logprobs})
        metrics.append({f"rec{i}.{k}": v for k, v in r.stats.items()})
    torch.save(tensors, out / "tensors.pt")
    (out / "metrics.json").write_text(json.dumps(metrics))
    (out / "layout.json").write_text(json.dumps(s["used"]))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def _compare_metrics(
    mo: list[dict[str, Any]], mn: list[dict[str, Any]], skip: str = "\0"
) -> tuple[int, list[str]]:
    diffs = [] if [list(d) for d in mo] == [list(d) for d in mn] else ["metric keys or their order differ"]
    count = 0
    for i, (do, dn) in enumerate(zip(mo, mn, strict=False)):
        for k in do:
            if k.startswith(skip):
                continue
            count += 1
            if k not in dn or not _same(do[k], dn[k]):
                diffs.append(f"metric [{i}] {k}: {do[k]!r} vs {dn.get(k)!r}")
    if len(mo) != len(mn):
        diffs.append(f"{len(mo)} vs {len(mn)} metric records")
    return count, diffs


def _compare_tensors(to: Any, tn: Any, where: str) -> tuple[int, list[str]]:
    """Tensors by ``torch.equal``, containers element by element, the rest by ``==``."""
    import torch

    if torch.is_tensor(to):
        same = torch.is_tensor(tn) and to.dtype == tn.dtype and torch.equal(to, tn)
        return 1, [] if same else [f"tensor {where} differs"]
    if isinstance(to, dict) and isinstance(tn, dict):
        if sorted(map(str, to)) != sorted(map(str, tn)):
            return 0, [f"{where}: keys differ"]
        parts = [_compare_tensors(to[k], tn[k], f"{where}.{k}") for k in to]
    elif isinstance(to, list | tuple) and isinstance(tn, list | tuple) and len(to) == len(tn):
        parts = [_compare_tensors(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(to, tn, strict=True))]
    else:
        return 0, [] if _same(to, tn) else [f"{where}: {to!r} vs {tn!r}"]
    return sum(c for c, _ in parts), [d for _, ds in parts for d in ds]


def _compare_iterations(old: Path, new: Path) -> tuple[dict[str, int], list[str]]:
    import torch

    counts, diffs = {}, []
    load = lambda p: json.loads(p.read_text())  # noqa: E731
    counts["metrics"], d = _compare_metrics(load(old / "metrics.json"), load(new / "metrics.json"))
    diffs += d
    to, tn = (torch.load(p / "tensors.pt", weights_only=True) for p in (old, new))
    counts["tensors"], d = _compare_tensors(to, tn, "state")
    diffs += d
    counts["dump_files"] = 0
    for f in sorted(old.glob("dump*.safetensors")):
        counts["dump_files"] += 1
        if not (new / f.name).exists() or f.read_bytes() != (new / f.name).read_bytes():
            diffs.append(f"dump {f.name} differs")
    return counts, diffs


def _strip(doc: dict[str, Any]) -> dict[str, Any]:
    """``state.json``/``config.json`` without the run's identity and folder."""
    doc = {k: v for k, v in doc.items() if k != "run_id"}
    for cfg in (doc, doc.get("config", {})):
        if isinstance(cfg.get("run"), dict):
            cfg["run"] = {k: v for k, v in cfg["run"].items() if k != "out_dir"}
    return doc


def _compare_run(old: Path, new: Path) -> tuple[dict[str, int], list[str]]:
    """The ``torchrun`` scenario's run folders (module docstring)."""
    import torch

    counts = {"metrics": 0, "tensors": 0, "files": 0}
    lines = [[json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines()] for p in (old, new)]
    counts["metrics"], diffs = _compare_metrics(*lines, skip="time/")
    names = sorted(str(p.relative_to(old)) for p in old.rglob("*") if p.is_file())
    theirs = sorted(str(p.relative_to(new)) for p in new.rglob("*") if p.is_file())
    if names != theirs:
        diffs.append(f"files differ: {sorted(set(names) ^ set(theirs))}")
    for rel in names:
        a, b = old / rel, new / rel
        if rel in ("metrics.jsonl", "run.json") or not b.exists():
            continue  # run.json: the run's identity and creation time only
        counts["files"] += 1
        if rel.endswith(".pt"):
            c, d = _compare_tensors(*(torch.load(p, weights_only=True) for p in (a, b)), where=rel)
            counts["tensors"] += c
            diffs += d
        elif rel.endswith(("state.json", "config.json")):
            if _strip(json.loads(a.read_text())) != _strip(json.loads(b.read_text())):
                diffs.append(f"{rel} differs")
        elif a.read_bytes() != b.read_bytes():
            diffs.append(f"{rel} differs")
    return counts, diffs


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root.resolve()), "OMP_NUM_THREADS": "1"}


def _launch(scenario: str, root: Path, out: Path, iterations: int) -> str:
    """Run ``scenario`` with ``root``'s refppo into ``out``; ``""`` or why it failed."""
    env = _env(root)
    where = subprocess.run(
        [sys.executable, "-c", "import refppo; print(refppo.__file__)"],
        capture_output=True, text=True, env=env, cwd=root,
    ).stdout.strip()  # fmt: skip
    if not where.startswith(str(root.resolve())):
        return f"refppo imports from {where!r}, not from {root}"
    if scenario == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        argv += ["-m", "refppo", "train", "--out", str(out / "run")]
        for s in (*TRAIN_SETS, f"run.iterations={iterations}"):
            argv += ["--set", s]
    else:
        argv = [sys.executable, str(Path(__file__).resolve()), "--_run", scenario, str(out)]
        argv += ["--iterations", str(iterations), str(root), str(root)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=root, timeout=1800)
    if proc.returncode != 0:
        return f"exit {proc.returncode}: " + " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Bit-identity of two trees' PPO training")
    ap.add_argument("old_root", type=Path)
    ap.add_argument("new_root", type=Path)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--scenario", choices=SCENARIOS, action="append", help="default: all")
    ap.add_argument("--_run", nargs=2, metavar=("SCENARIO", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._run:
        _run(args._run[0], args.iterations, Path(args._run[1]))
        return 0
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in args.scenario or SCENARIOS:
            outs = [Path(tmp) / scenario / tag for tag in ("old", "new")]
            errors = []
            for out, root in zip(outs, (args.old_root, args.new_root), strict=True):
                out.mkdir(parents=True)
                why = _launch(scenario, root, out, args.iterations)
                if why:
                    errors.append(f"{root}: {why}")
            if errors:
                bad += 1
                print(f"{scenario}: FAILED TO RUN" + "".join(f"\n  {e}" for e in errors))
                continue
            if scenario == "torchrun":
                counts, diffs = _compare_run(outs[0] / "run", outs[1] / "run")
            else:
                counts, diffs = _compare_iterations(*outs)
                layouts = [json.loads((o / "layout.json").read_text()) for o in outs]
                print(f"{scenario}: layout: old {_short(layouts[0])}; new {_short(layouts[1])}")
            bad += len(diffs)
            print(f"{scenario}: {counts} differences={len(diffs)}" + "".join(f"\n  {d}" for d in diffs[:10]))
    print(f"{bad} difference(s)")
    return 1 if bad else 0


def _short(used: list[str]) -> str:
    return ", ".join(sorted({u.rsplit(".", 1)[0] for u in used}))


if __name__ == "__main__":
    raise SystemExit(main())
