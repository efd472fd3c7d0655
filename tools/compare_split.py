"""Bit-identity of two source trees' PPO iterations (the split of refppo/ppo.py and refppo/pipeline.py).

Usage::

    python tools/compare_split.py OLD_ROOT NEW_ROOT [--iterations 3]

``OLD_ROOT``/``NEW_ROOT`` are directories holding a ``refppo/`` package (e.g. ``git archive 86e8067
refppo | tar -x -C /tmp/old``). Each scenario runs in a fresh interpreter per tree (same seeds):
``refppo.train.iteration.iteration`` for a few iterations, then every metric of every iteration is compared
with
``==`` (as Python floats; NaN equals NaN), every actor/critic parameter and Adam state tensor with
``torch.equal``, every ``on_minibatch`` record's tensors with ``torch.equal``, and the captured v2
dump files byte for byte. Prints the counts; exit 1 on any difference.

Scenarios: ``critic`` (GAE, llama, 2 epochs × 2 minibatches × micro-batches of 2, PPO-ptx, clipped
grad norms, a capture of one step), ``critic-dropout`` (gpt2 with dropout 0.1 in the update: the
global RNG's order of use), ``grpo`` (critic-free group estimator, gpt2, micro-batches of 2, capture).
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

SCENARIOS = ("critic", "critic-dropout", "grpo")
PROMPTS = [[1, 5, 6], [1, 7, 8, 9], [1, 5, 6], [1, 7, 8, 9], [1, 4], [1, 3, 3], [1, 4], [1, 3, 3]]
GROUPS = [0, 1, 0, 1, 2, 3, 2, 3]


def _run(scenario: str, iterations: int, out: Path) -> None:
    """Run ``scenario`` with the ``refppo`` on ``sys.path``; write metrics.json, tensors.pt, dumps."""
    import torch

    from refppo.capture.recorder import StepRecorder
    from refppo.models.batch import left_pad
    from refppo.models.roles import make_reference
    from refppo.models.rollout import RolloutConfig
    from refppo.models.tiny import tiny_actor, tiny_critic
    from refppo.pipeline.settings import Convention, Hyperparams
    from refppo.train.iteration import iteration
    from refppo.train.update_config import CaptureRequest, MinibatchRecord, PPOUpdateConfig, PtxBatch

    torch.manual_seed(123)
    critic_free = scenario == "grpo"
    arch: Literal["gpt2", "llama"] = "llama" if scenario == "critic" else "gpt2"
    drop = 0.1 if scenario == "critic-dropout" else 0.0
    actor = tiny_actor(arch, 32, seed=0, hidden=32, dropout=drop)
    critic = None if critic_free else tiny_critic(arch, 32, seed=1, hidden=32, dropout=drop)
    ref = make_reference(actor)
    pids, pm = left_pad(PROMPTS, 0)
    opt_a = torch.optim.Adam(actor.parameters(), lr=1e-2)
    opt_c = torch.optim.Adam(critic.parameters(), lr=1e-2) if critic is not None else None
    conv = Convention.from_dict({"advantage": "grpo"}) if critic_free else Convention()  # old and new trees
    hp = Hyperparams(kl_coef=0.05)
    ptx = PtxBatch(torch.tensor([[1, 5, 6, 7, 2], [1, 7, 8, 2, 0]]), torch.tensor([[1] * 5, [1] * 4 + [0]]))
    cfg = PPOUpdateConfig(
        ppo_epochs=2,
        num_minibatches=2,
        micro_batch_size=2,
        max_grad_norm=0.5,
        ptx_coef=0.0 if critic_free else 0.1,
        dropout_in_update=drop > 0,
    )
    records: list[MinibatchRecord] = []
    gen = torch.Generator().manual_seed(7)
    metrics: list[dict[str, float]] = []
    for it in range(iterations):
        cap = CaptureRequest(
            1, 1, StepRecorder(hparams=hp, conventions=conv), str(out / f"dump{it}.safetensors")
        )
        res = iteration(
            actor, ref, critic, lambda p, r: float(sum(r) % 5) / 5.0, opt_a, opt_c, pids, pm,
            rollout_cfg=RolloutConfig(max_new_tokens=5), update_cfg=cfg, hp=hp, conv=conv, generator=gen,
            ptx_batch=None if critic_free else ptx, on_minibatch=records.append, capture=cap,
            group_index=torch.tensor(GROUPS) if critic_free else None,
        )  # fmt: skip
        metrics.append(res.metrics)
    tensors: dict[str, torch.Tensor] = {}
    for role, model in (("actor", actor), ("critic", critic)):
        if model is not None:
            tensors.update({f"{role}.{k}": v for k, v in model.state_dict().items()})
    for role, opt in (("opt_a", opt_a), ("opt_c", opt_c)):
        if opt is not None:
            for pid, state in opt.state_dict()["state"].items():
                tensors.update({f"{role}.{pid}.{k}": v for k, v in state.items() if torch.is_tensor(v)})
    for i, r in enumerate(records):
        tensors.update({f"rec{i}.rows": r.rows, f"rec{i}.old": r.old_logprobs, f"rec{i}.lp": r.logprobs})
        metrics.append({f"rec{i}.{k}": v for k, v in r.stats.items()})
    torch.save(tensors, out / "tensors.pt")
    (out / "metrics.json").write_text(json.dumps(metrics))


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _compare(old: Path, new: Path) -> tuple[dict[str, int], list[str]]:
    import torch

    counts = {"metrics": 0, "tensors": 0, "dump_files": 0}
    diffs: list[str] = []
    mo: list[dict[str, float]] = json.loads((old / "metrics.json").read_text())
    mn: list[dict[str, float]] = json.loads((new / "metrics.json").read_text())
    if [list(d) for d in mo] != [list(d) for d in mn]:
        diffs.append("metric keys or their order differ")
    for do, dn in zip(mo, mn, strict=True):
        for k in do:
            counts["metrics"] += 1
            if k not in dn or not _same(do[k], dn[k]):
                diffs.append(f"metric {k}: {do[k]!r} vs {dn.get(k)!r}")
    to: dict[str, Any] = torch.load(old / "tensors.pt", weights_only=True)
    tn: dict[str, Any] = torch.load(new / "tensors.pt", weights_only=True)
    if sorted(to) != sorted(tn):
        diffs.append("tensor names differ")
    for k in to:
        counts["tensors"] += 1
        if k not in tn or not torch.equal(to[k], tn[k]):
            diffs.append(f"tensor {k} differs")
    for f in sorted(old.glob("dump*.safetensors")):
        counts["dump_files"] += 1
        if not (new / f.name).exists() or f.read_bytes() != (new / f.name).read_bytes():
            diffs.append(f"dump {f.name} differs")
    return counts, diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Bit-identity of two trees' PPO iterations")
    ap.add_argument("old_root", type=Path)
    ap.add_argument("new_root", type=Path)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--_run", nargs=2, metavar=("SCENARIO", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._run:
        import refppo

        src = str(args.old_root.resolve())
        assert refppo.__file__ is not None and refppo.__file__.startswith(src), (refppo.__file__, src)
        _run(args._run[0], args.iterations, Path(args._run[1]))
        return 0
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in SCENARIOS:
            outs = []
            for tag, root in (("old", args.old_root), ("new", args.new_root)):
                out = Path(tmp) / scenario / tag
                out.mkdir(parents=True)
                cmd = [sys.executable, __file__, str(root), str(root), "--iterations", str(args.iterations)]
                env = {**os.environ, "PYTHONPATH": str(root.resolve())}
                subprocess.run([*cmd, "--_run", scenario, str(out)], check=True, env=env)
                outs.append(out)
            counts, diffs = _compare(*outs)
            bad += len(diffs)
            print(f"{scenario}: {counts} equal={not diffs}" + "".join(f"\n  {d}" for d in diffs[:10]))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
