"""Speed and memory of `refppo train` (a script, not a test).

Reports seconds per PPO iteration (median after warm-up), response tokens/s, peak RSS, and the
split between rollout (generation), scoring (π_old/π_ref/critic/reward passes) and the PPO update.
The iterations are the trainer's own (:meth:`refppo.train.loop.Trainer.step`: ``generate_rollout`` +
``iteration``). ``iteration`` runs scoring and update back to back, so the scoring time is
measured by re-running ``score_rollout`` on each iteration's batch outside the timed iteration,
and update = (scoring + update) − scoring.

``--naive`` also times the naive step-by-step twin (:mod:`refppo.pipeline.naive`: per-prefix forwards,
a snapshot π_old network, Python-loop losses) against the vectorized path on the same rows for ONE
minibatch step (``--naive-rows`` rows, 1 epoch, 1 minibatch): the full config would take hours.

``--trl`` compares with TRL's PPOTrainer (benchmarks/bench_trl_ppo.py, run by ``--trl-python``,
a separate venv with trl 1.12.0) side by side in ONE run: ``--rounds`` rounds, each a fresh refppo
process and a fresh TRL process (order alternating, so drift hits both), each ``--warmup`` +
``--iterations`` iterations; the table shows the median over rounds of each run's median (peak
RSS: the max over rounds, each process's own ``ru_maxrss``). TRL's setup is fixed to trl-parity.

    .venv/bin/python benchmarks/bench_train.py                         # trl-parity config
    .venv/bin/python benchmarks/bench_train.py --config FILE --iterations 10 --warmup 2 --naive
    .venv/bin/python benchmarks/bench_train.py --trl --rounds 3 --naive --json bench.json
    .venv/bin/python benchmarks/bench_train.py --threads 1,2 --rounds 3 --set model.n_embd=256

``--threads N1,N2,...`` times the same config in fresh processes with ``model.threads`` = each
value in turn (``--rounds`` rounds, order rotating), to choose the default thread count
(``model.threads=0``, auto, in refppo/train/runtime.py ``set_threads``); ``--config`` defaults to the
``refppo train`` defaults with the rule reward and no warm start in this mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def bench(config: str, iterations: int, warmup: int, overrides: list[str]) -> tuple[dict[str, Any], Any]:
    from refppo.models.rollout import score_rollout
    from refppo.train.config.schema import load_config
    from refppo.train.loop import Trainer
    from refppo.train.runtime import peak_rss_mb

    out = tempfile.mkdtemp(prefix="refppo-bench-")
    cfg = load_config(
        None if config == "default" else config,
        [
            *overrides,
            f"run.out_dir={out}",
            f"run.iterations={warmup + iterations}",
            "run.progress=false",
            "run.plot=false",
            "run.sample_every=0",
        ],
    )
    rss_before = peak_rss_mb()
    t_setup = time.perf_counter()
    trainer = Trainer(cfg)
    setup_s = time.perf_counter() - t_setup
    rows: list[dict[str, float]] = []
    for it in range(warmup + iterations):
        record, step, _ = trainer.step(it)
        t0 = time.perf_counter()
        score_rollout(
            trainer.actor,
            trainer.reference,
            trainer.critic,
            trainer.reward,
            step.scored.batch,
            temperature=trainer.rollout_cfg.temperature,
            eos_token_id=trainer.rollout_cfg.eos_token_id,
            missing_eos_penalty=trainer.rollout_cfg.missing_eos_penalty,
        )
        scoring = time.perf_counter() - t0
        row = {
            "iteration_s": record["time/iteration"],
            "rollout_s": record["time/rollout"],
            "scoring_s": scoring,
            "update_s": record["time/score_update"] - scoring,
            "response_tokens": float(step.scored.batch.response_mask.sum()),
            "total_tokens": float(step.scored.batch.attention_mask.sum()),
        }
        rows.append(row)
        print(
            f"  iter {it + 1:3d}{' (warm-up)' if it < warmup else '          '}  "
            + "  ".join(f"{k} {v:8.3f}" for k, v in row.items() if k.endswith("_s")),
            flush=True,
        )
    timed = rows[warmup:]
    med = {k: _median([r[k] for r in timed]) for k in timed[0]}
    result = {
        "config": config,
        "overrides": overrides,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "policy_params": sum(p.numel() for p in trainer.actor.parameters()),
        "iterations_timed": len(timed),
        "warmup": warmup,
        "setup_s": setup_s,
        "median_iteration_s": med["iteration_s"],
        "median_rollout_s": med["rollout_s"],
        "median_scoring_s": med["scoring_s"],
        "median_update_s": med["update_s"],
        "response_tokens_per_s": _median([r["response_tokens"] / r["iteration_s"] for r in timed]),
        "total_tokens_per_s": _median([r["total_tokens"] / r["iteration_s"] for r in timed]),
        "peak_rss_mb": peak_rss_mb(),
        "peak_rss_mb_before_setup": rss_before,
    }
    return result, trainer


def bench_naive(trainer: Any, rows: int) -> dict[str, float]:
    """One minibatch step on ``rows`` rows: naive twin vs vectorized, same starting weights."""
    import copy

    from refppo.models.rollout import generate_rollout, score_rollout
    from refppo.models.rollout_naive import score_rollout_naive
    from refppo.pipeline.step import rollout_quantities, rollout_quantities_naive
    from refppo.train.update import ppo_update
    from refppo.train.update_config import PPOUpdateConfig
    from refppo.train.update_naive import ppo_update_naive

    cfg = trainer.cfg
    texts = trainer.task.prompts(rows, trainer.task_rng)
    pid, pmask = trainer.encode_prompts(texts)
    batch = generate_rollout(trainer.actor, pid, pmask, trainer.rollout_cfg, trainer.generator)
    hp, conv = cfg.ppo.hp, cfg.ppo.convention
    upd = PPOUpdateConfig(ppo_epochs=1, num_minibatches=1, max_grad_norm=cfg.ppo.max_grad_norm, shuffle=False)
    kw: dict[str, Any] = {
        "temperature": trainer.rollout_cfg.temperature,
        "eos_token_id": trainer.rollout_cfg.eos_token_id,
        "missing_eos_penalty": trainer.rollout_cfg.missing_eos_penalty,
    }
    out: dict[str, float] = {"rows": float(rows), "response_tokens": float(batch.response_mask.sum())}
    for name in ("vectorized", "naive"):
        actor, critic = copy.deepcopy(trainer.actor), copy.deepcopy(trainer.critic)
        a_opt = torch.optim.AdamW(actor.parameters(), lr=cfg.optimizer.lr)
        c_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.optimizer.lr)
        t0 = time.perf_counter()
        if name == "vectorized":
            scored = score_rollout(actor, trainer.reference, critic, trainer.reward, batch, **kw)
        else:
            scored = score_rollout_naive(actor, trainer.reference, critic, trainer.reward, batch, **kw)
        t1 = time.perf_counter()
        qfn = rollout_quantities if name == "vectorized" else rollout_quantities_naive
        q = qfn(
            scores=scored.scores,
            old_logprobs=scored.old_logprobs,
            ref_logprobs=scored.ref_logprobs,
            old_values=scored.old_values,
            mask=batch.response_mask,
            hp=hp,
            conv=conv,
        )
        if name == "vectorized":
            ppo_update(
                actor, critic, a_opt, c_opt, scored, q, hp=hp, conv=conv, cfg=upd, generator=torch.Generator()
            )
        else:
            ppo_update_naive(
                actor, critic, a_opt, c_opt, scored, q, hp=hp, conv=conv, cfg=upd, perms=[torch.arange(rows)]
            )
        t2 = time.perf_counter()
        out[f"{name}_scoring_s"] = t1 - t0
        out[f"{name}_update_s"] = t2 - t1
    out["naive_over_vectorized_scoring"] = out["naive_scoring_s"] / out["vectorized_scoring_s"]
    out["naive_over_vectorized_update"] = out["naive_update_s"] / out["vectorized_update_s"]
    out["naive_over_vectorized_total"] = (out["naive_scoring_s"] + out["naive_update_s"]) / (
        out["vectorized_scoring_s"] + out["vectorized_update_s"]
    )
    return out


KEYS = (
    ("median_iteration_s", "s/iter", "{:.3f}"),
    ("median_rollout_s", "rollout s", "{:.3f}"),
    ("median_scoring_s", "scoring s", "{:.3f}"),
    ("median_update_s", "update s", "{:.3f}"),
    ("response_tokens_per_s", "resp tok/s", "{:.0f}"),
    ("total_tokens_per_s", "total tok/s", "{:.0f}"),
    ("peak_rss_mb", "peak RSS MB", "{:.0f}"),
)


def _child(cmd: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="refppo-bench-") as d:
        path = Path(d) / "out.json"
        print("$ " + " ".join(cmd), flush=True)
        subprocess.run([*cmd, "--json", str(path)], check=True)
        loaded: dict[str, Any] = json.loads(path.read_text())
        return loaded


def side_by_side(args: argparse.Namespace) -> dict[str, Any]:
    """``args.rounds`` × (fresh refppo process, fresh TRL process), alternating the order."""
    if Path(args.config).resolve() != (HERE / "configs" / "trl-parity.toml").resolve() or args.overrides:
        print("warning: TRL runs the fixed trl-parity setup; --config/--set only change refppo's side")
    common = ["--iterations", str(args.iterations), "--warmup", str(args.warmup)]
    refppo = [sys.executable, str(Path(__file__).resolve()), "--config", args.config, *common]
    refppo += [f"--set={o}" for o in args.overrides]
    trl = [args.trl_python, str(HERE / "bench_trl_ppo.py"), *common]
    runs: dict[str, list[dict[str, Any]]] = {"refppo": [], "trl": []}
    for r in range(args.rounds):
        order = ("refppo", "trl") if r % 2 == 0 else ("trl", "refppo")
        for name in order:
            cmd = refppo if name == "refppo" else trl
            if name == "refppo" and args.naive and r == args.rounds - 1:
                cmd = [*cmd, "--naive", "--naive-rows", str(args.naive_rows)]  # after its RSS is read
            runs[name].append(_child(cmd))
    summary: dict[str, dict[str, float]] = {}
    for name, results in runs.items():
        summary[name] = {
            k: (max if k == "peak_rss_mb" else _median)([float(x[k]) for x in results]) for k, _, _ in KEYS
        }
    summary["refppo/trl"] = {k: summary["refppo"][k] / summary["trl"][k] for k, _, _ in KEYS}
    out: dict[str, Any] = {"rounds": args.rounds, "summary": summary, "runs": runs}
    naive = [x["naive"] for x in runs["refppo"] if "naive" in x]
    if naive:
        out["naive"] = naive[0]
    print(
        f"\nside by side: {args.rounds} rounds x ({args.warmup} warm-up + {args.iterations} timed iterations)"
    )
    print(f"| {'':10s} | " + " | ".join(f"{h:>11s}" for _, h, _ in KEYS) + " |")
    print("|" + "---|" * (len(KEYS) + 1))
    for name in ("refppo", "trl", "refppo/trl"):
        fmt = [("{:.2f}" if name == "refppo/trl" else f) for _, _, f in KEYS]
        cells = [f.format(summary[name][k]) for f, (k, _, _) in zip(fmt, KEYS, strict=True)]
        print(f"| {name:10s} | " + " | ".join(f"{c:>11s}" for c in cells) + " |")
    for name in ("refppo", "trl"):
        per = ", ".join(f"{x['median_iteration_s']:.3f}" for x in runs[name])
        print(f"{name} s/iter per round: {per}")
    if naive:
        print(f"naive / vectorized (one minibatch step, {naive[0]['rows']:.0f} rows): "
              f"scoring {naive[0]['naive_over_vectorized_scoring']:.1f}x, "
              f"update {naive[0]['naive_over_vectorized_update']:.1f}x, "
              f"total {naive[0]['naive_over_vectorized_total']:.1f}x")  # fmt: skip
    return out


def compare_threads(args: argparse.Namespace) -> dict[str, Any]:
    """``args.rounds`` × one fresh process per thread count (order rotating); median s/iteration."""
    counts = [int(n) for n in args.threads.split(",")]
    base = [sys.executable, str(Path(__file__).resolve()), "--iterations", str(args.iterations)]
    base += ["--warmup", str(args.warmup)]
    if args.config_given:
        base += ["--config", args.config]
    else:  # `refppo train` defaults (tiny GPT-2), programmatic reward: nothing to train first
        base += [
            "--config=default",
            "--set=task.reward=rule",
            "--set=task.sft_steps=0",
            "--set=task.rm_steps=0",
        ]
    base += [f"--set={o}" for o in args.overrides]
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    for r in range(args.rounds):
        for n in counts[r % len(counts) :] + counts[: r % len(counts)]:
            runs[n].append(_child([*base, f"--set=model.threads={n}"]))
    params = runs[counts[0]][0].get("policy_params")
    print(f"\nthreads compared: {args.rounds} rounds x ({args.warmup} warm-up + {args.iterations} timed)")
    print(f"policy parameters: {params}; cores: {os.cpu_count()}; load average: {os.getloadavg()}")
    print("| threads | s/iter (median of rounds) | per round |")
    print("|---|---|---|")
    summary = {}
    for n in counts:
        per = [float(x["median_iteration_s"]) for x in runs[n]]
        summary[n] = _median(per)
        print(f"| {n} | {summary[n]:.3f} | {', '.join(f'{v:.3f}' for v in per)} |")
    return {"rounds": args.rounds, "policy_params": params, "summary": summary, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config", default=str(HERE / "configs" / "trl-parity.toml"), help="TOML file, or `default`"
    )
    p.add_argument("--iterations", type=int, default=8, help="timed iterations (after warm-up)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="SECTION.KEY=VALUE")
    p.add_argument("--naive", action="store_true", help="also time the naive twin on one minibatch step")
    p.add_argument("--naive-rows", type=int, default=4)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument(
        "--trl", action="store_true", help="side by side with TRL (bench_trl_ppo.py), fresh processes"
    )
    p.add_argument("--trl-python", default="/tmp/trl-venv/bin/python", help="python of the TRL venv")
    p.add_argument("--rounds", type=int, default=3, help="with --trl: refppo/TRL process pairs")
    p.add_argument("--threads", metavar="N1,N2", help="compare model.threads values, fresh processes")
    args = p.parse_args(argv)
    args.config_given = args.config != p.get_default("config")
    if args.threads:
        out = compare_threads(args)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        return 0
    if args.trl:
        out = side_by_side(args)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        return 0
    print(f"refppo bench_train: {args.config} ({args.warmup} warm-up + {args.iterations} timed iterations)")
    result, trainer = bench(args.config, args.iterations, args.warmup, args.overrides)
    if args.naive:
        result["naive"] = bench_naive(trainer, args.naive_rows)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
