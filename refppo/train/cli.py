"""``refppo train``: a PPO training run from a TOML config, ``--set`` overrides and a few flags.

Examples::

    refppo train                                      # embedded task, defaults (CPU or GPU)
    refppo train --config benchmarks/configs/trl-parity.toml --set run.iterations=5
    refppo train --model DIR --reward-model RM_DIR --prompts prompts.txt --device cuda
    refppo train --model DIR --reward mypkg.rewards:score --prompts prompts.txt
                               # score(prompt: str, response: str) -> float; ./mypkg found as python -m
    refppo train --out runs/a --resume                       # continue from the newest checkpoint
    refppo train --out runs/a --overwrite                    # replace the run in runs/a
    torchrun --nproc-per-node 2 -m refppo train --set rollout.batch_size=64
    refppo train --print-config                              # the resolved config as JSON
    refppo train --help-config [SECTION]                     # every --set key: type, default, meaning

Precedence: defaults < --config file < dedicated flags < --set (applied in order).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from refppo.errors import RefPPOError
from refppo.train.config.schema import TrainConfig, load_config
from refppo.train.runlog import kl_label


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``refppo train``."""
    p = argparse.ArgumentParser(
        prog="refppo train",
        description="PPO training (RLHF) on the embedded task or a local model. Every hyperparameter is "
        "in the config (--help-config describes every key, --print-config prints the resolved values); "
        "--set SECTION.KEY=VALUE overrides any.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Examples::", 1)[1] if __doc__ else None,
    )
    p.add_argument("--config", metavar="FILE", help="TOML config file")
    p.add_argument(
        "--set",
        metavar="SECTION.KEY=VALUE",
        action="append",
        default=[],
        dest="overrides",
        help="override one config value (repeatable), e.g. --set ppo.cliprange=0.1",
    )
    _add_model_flags(p)
    _add_run_flags(p)
    return p


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """Where the models, the reward and the prompts come from; device and dtype."""
    p.add_argument("--model", metavar="DIR", help="local causal LM + tokenizer directory (model.policy)")
    p.add_argument(
        "--reward-model", metavar="DIR", help="local sequence-classification reward model directory"
    )
    p.add_argument(
        "--reward", metavar="MODULE:FUNCTION", help="programmatic reward f(prompt, response) -> float"
    )
    p.add_argument(
        "--prompts",
        metavar="FILE",
        help="text file, one prompt per line (task.prompts_file); required with --model DIR",
    )
    p.add_argument(
        "--embedded-prompts",
        action="store_true",
        help="with --model DIR and no --prompts: train on the embedded task's synthetic prompts "
        "anyway (task.embedded_prompts)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="model.device")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float64"], help="model.dtype")


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """Run length, seed and output folder (fresh, --resume or --overwrite); what to print."""
    p.add_argument("--iterations", type=int, help="run.iterations")
    p.add_argument("--seed", type=int, help="run.seed")
    p.add_argument("--out", metavar="DIR", help="run.out_dir")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the out dir")
    p.add_argument(
        "--resume-fallback",
        action="store_true",
        help="with --resume: if the newest checkpoint is damaged, say why and resume from the previous "
        "complete one (default: stop with an error naming the damaged file)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start a fresh run in a non-empty out dir that holds a refppo run (its run.json): deletes "
        "refppo's files there (checkpoints, metrics, plot, config), keeps any other file; "
        "without it a non-empty out dir is refused",
    )
    p.add_argument(
        "--no-progress", action="store_true", help="one plain line per iteration instead of the tqdm bar"
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.add_argument(
        "--help-config",
        nargs="?",
        const="",
        metavar="SECTION",
        help="describe every --set key (type, default, meaning), or those of one SECTION, and exit",
    )


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """Defaults < --config < flags < --set."""
    flags: list[str] = []
    if args.model is not None:
        flags += [f"model.policy={args.model}", "task.sft_steps=0"]
    if args.reward_model is not None:
        flags += [f"model.reward_model={args.reward_model}", "task.reward=model"]
    if args.reward is not None:
        flags.append(f"task.reward={args.reward}")
    if args.prompts is not None:
        flags.append(f"task.prompts_file={args.prompts}")
    for name, key in (
        ("device", "model.device"),
        ("dtype", "model.dtype"),
        ("iterations", "run.iterations"),
        ("seed", "run.seed"),
        ("out", "run.out_dir"),
    ):
        value = getattr(args, name)
        if value is not None:
            flags.append(f"{key}={value}")
    if args.embedded_prompts:
        flags.append("task.embedded_prompts=true")
    if args.no_progress:
        flags.append("run.progress=false")
    return load_config(args.config, [*flags, *args.overrides])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``refppo train``; returns the exit code (2: bad config or input)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.help_config is not None:
        from refppo.train.config.doc import describe_config, sections

        if args.help_config and args.help_config not in sections():
            print(
                f"refppo train: error: --help-config {args.help_config!r}: sections are {sections()}",
                file=sys.stderr,
            )
            return 2
        print(describe_config(args.help_config or None))
        return 0
    try:
        cfg = resolve_config(args)
        if args.print_config:
            print(cfg.to_json())
            return 0
        from refppo.train.loop import run

        records = run(cfg, resume=args.resume, overwrite=args.overwrite, resume_fallback=args.resume_fallback)
    except RefPPOError as e:
        print(f"refppo train: error: {e}", file=sys.stderr)
        return 2
    if records and int(os.environ.get("RANK", "0")) == 0:  # under torchrun: one summary, rank 0's
        last = records[-1]
        print(
            f"done: {len(records)} iterations, final reward {last.get('rollout/score', float('nan')):.4f}, "
            f"{kl_label(cfg.ppo.convention.kl.estimator.value)} {last.get('rollout/kl', float('nan')):.4f}; "
            f"outputs in {cfg.run.out_dir}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
