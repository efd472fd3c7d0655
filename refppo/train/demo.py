"""``refppo demo`` (what ``make demo`` runs): PPO on the embedded task, end to end (~30 s on 2 CPU cores).

1. warm start a tiny GPT-2 on the synthetic review language (supervised steps);
2. train a tiny reward model (``AutoModelForSequenceClassification``, score at the last token) on
   preference pairs labelled by a hidden rule (positive minus negative words, per word);
3. PPO against the reward model with ``refppo train``'s trainer (preset
:data:`refppo.train.tasks.presets.DEMO`);
4. report the reward and the hidden rule's score before → after, the KL to the reference, wall time.

The exact numbers are the preset's; ``refppo demo --help`` prints them (:func:`help_text`).
The exit code is 1 if the hidden-rule score did not rise clearly (a demo that cannot fail proves nothing).
``refppo demo --set run.iterations=10 --out DIR`` adjusts it like ``refppo train``.
``refppo demo --grpo``: the same run without a critic (preset :data:`refppo.train.tasks.presets.DEMO_GRPO`:
GRPO over groups of 8 responses per prompt, against the verifiable reward
:func:`refppo.train.tasks.words.verify_reward`, no reward model); same bar on the hidden rule.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from statistics import mean
from typing import TYPE_CHECKING, Any

from refppo.errors import RefPPOError

if TYPE_CHECKING:
    from refppo.train.config.schema import TrainConfig

MIN_RULE_GAIN = 0.15
"""Least rise of the hidden-rule score (∈ [−1, 1] per response), first → last 3 iterations."""


def summarize(records: list[dict[str, Any]], k: int = 3) -> dict[str, float]:
    """Means of the first and last ``k`` iterations of reward, rule score and KL."""
    first, last = records[:k], records[-k:]

    def m(rs: list[dict[str, Any]], key: str) -> float:
        return mean(float(r[key]) for r in rs if key in r)

    return {
        "reward_first": m(first, "rollout/score"),
        "reward_last": m(last, "rollout/score"),
        "rule_first": m(first, "rollout/rule_score"),
        "rule_last": m(last, "rollout/rule_score"),
        "kl_last": m(last, "rollout/kl"),
        "kl_max": max(float(r["rollout/kl"]) for r in records),
    }


def help_text() -> str:
    """The description of ``refppo demo --help``: plain text, every number read from the DEMO preset."""
    from refppo.train.tasks.presets import preset

    c = preset("demo")
    m, t, r, p = c.model, c.task, c.rollout, c.ppo
    return (
        "PPO on the embedded task, end to end (what `make demo` runs; about 30 s on 2 CPU cores).\n\n"
        f"1. warm-start a tiny GPT-2 (hidden size {m.n_embd}, {m.n_layer} layers, {m.n_head} heads, "
        f"{m.n_positions} positions)\n   on the synthetic review language: {t.sft_steps} supervised steps "
        f"of {t.sft_batch_size} samples;\n"
        f"2. train a tiny reward model (a sequence classifier, score at the last token) for {t.rm_steps} "
        f"steps\n   on {t.rm_pairs} preference pairs labelled by a hidden rule (positive minus negative "
        "words, per word);\n"
        f"3. run {c.run.iterations} PPO iterations of {r.batch_size} prompts (at most {r.max_new_tokens} new "
        f"tokens each,\n   {p.epochs} epochs x {p.minibatches} minibatches, KL coefficient {p.hp.kl_coef}, "
        f"learning rate {c.optimizer.lr:g}) against it;\n"
        "4. print the learned reward and the hidden-rule score (mean of the first / last 3 iterations),\n"
        "   the KL to the reference and the wall time; write metrics.jsonl, plot.png and a checkpoint.\n\n"
        f"Exit code 1 if the hidden-rule score rose by less than {MIN_RULE_GAIN} (a demo that cannot fail "
        "proves nothing),\n2 on bad input. --set SECTION.KEY=VALUE changes any of these "
        "(refppo train --help-config lists the keys)."
    )


def _reward_kind(cfg: TrainConfig) -> str:
    """The reward's label in the summary: keyed on ``task.reward``, not on the estimator (a
    critic-free estimator can train on the learned reward model too)."""
    if cfg.task.reward == "model":
        return "learned RM, unit std on warm-start samples"
    penalty = " minus EOS penalty" if cfg.rollout.missing_eos_penalty is not None else ""
    return f"verifiable, [0, 1]{penalty}"


def _print_summary(cfg: TrainConfig, records: list[dict[str, Any]], wall: float, out: str) -> float:
    """Print the demo's summary of ``records``; returns the hidden-rule gain (first → last 3)."""
    s = summarize(records)
    n = len(records)
    gain = s["rule_last"] - s["rule_first"]
    parts = ", reward model" if cfg.task.reward == "model" else ""
    print(
        f"\nreward ({_reward_kind(cfg)}): "
        f"{s['reward_first']:+.3f} -> {s['reward_last']:+.3f}"
        f"  (mean of first / last 3 of {n} iterations)\n"
        f"hidden-rule score (true objective, in [-1, 1]):      "
        f"{s['rule_first']:+.3f} -> {s['rule_last']:+.3f}"
        f"  (gain {gain:+.3f})\n"
        f"KL(policy || reference) per response: last {s['kl_last']:.3f} nats, max {s['kl_max']:.3f}"
        f"  (β = {cfg.ppo.hp.kl_coef})\n"
        f"wall time {wall:.0f} s (warm start{parts} and training); metrics: {out}/metrics.jsonl, "
        f"plot: {out}/plot.png"
    )
    return gain


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the process exit code."""
    p = argparse.ArgumentParser(
        prog="refppo demo", description=help_text(), formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument(
        "--grpo",
        action="store_true",
        help="critic-free: GRPO, 8 responses per prompt, verifiable reward (preset demo-grpo)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="SECTION.KEY=VALUE",
        help="override one config value of the demo preset (repeatable), as in refppo train",
    )
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    from refppo.train.loop import run
    from refppo.train.tasks.presets import preset

    t0 = time.perf_counter()
    try:
        cfg = preset("demo-grpo" if args.grpo else "demo", f"run.out_dir={args.out}", *args.overrides)
        algo = f"{cfg.ppo.convention.adv.estimator.value.upper()} (no critic)" if cfg.critic_free else "PPO"
        print(
            f"refppo demo: {cfg.run.iterations} {algo} iterations × {cfg.rollout.batch_size} responses "
            f"({cfg.rollout.group_size} per prompt); outputs in {args.out}"
        )
        records = run(cfg, overwrite=True)  # the demo replaces its previous run (refppo's files only)
    except RefPPOError as e:
        print(f"refppo demo: error: {e}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - t0
    if not records:
        print("refppo demo: no iterations run")
        return 1
    gain = _print_summary(cfg, records, wall, args.out)
    if gain < MIN_RULE_GAIN:
        print(
            f"refppo demo: FAILED — the hidden-rule score rose by {gain:+.3f} < {MIN_RULE_GAIN}",
            file=sys.stderr,
        )
        return 1
    print("refppo demo: OK — the policy learned the hidden preference while staying near the reference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
