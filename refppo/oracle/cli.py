"""``refppo diff`` / ``tools/diff_against.py``: compare a dumped PPO step with the reference.

Exit codes: 0 the dump matches the checked convention (defaults < sidecar < ``--preset`` <
``--set``), 1 it does not — with or without ``--detect``, whose findings are in the report — or an
output named by ``--require`` was not compared, 2 bad input (one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from refppo.errors import RefPPOError

USAGE_EXAMPLE = """examples:
  refppo diff step.safetensors                       # hyperparameters from step.safetensors.json
  refppo diff step.pt --preset trl --hparams hp.json
  refppo diff step.npz --preset verl --set kl_estimator=k3 --detect --json
  refppo diff step.safetensors --actor ckpt/actor --ref ckpt/ref --critic ckpt/critic
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"refppo diff: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="refppo diff",
        description="Recompute one dumped PPO step with the refppo reference and report where it diverges.",
        epilog=USAGE_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dump", help="the dump: .safetensors, .pt (weights_only) or .npz (spec/dump-format.md)")
    p.add_argument(
        "--hparams", metavar="FILE", help="hyperparameter JSON (default: <dump>.json beside the dump)"
    )
    from refppo.oracle.presets.registry import PRESETS

    p.add_argument("--preset", metavar="NAME", help=f"a peer's conventions: {', '.join(PRESETS)}")
    p.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="sets",
        help="override one convention key or hyperparameter (repeatable)",
    )
    p.add_argument("--detect", action="store_true", help="search every convention that reproduces the dump")
    p.add_argument(
        "--require",
        metavar="KEYS",
        help="outputs that must be compared, else exit 1: 'all' (every output the dump's inputs allow, "
        "but the logged metrics pg_clipfrac, approx_kl, vf_clipfrac) or KEY,KEY,...",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="the convention line lists every key, not only those that differ",
    )
    _model_arguments(p)
    return p


def _model_arguments(p: argparse.ArgumentParser) -> None:
    """The re-scoring flags: a local checkpoint per role and how the re-score runs."""
    m = p.add_argument_group(
        "re-scoring with the trainer's models (needs input_ids and attention_mask in the dump)",
        "Each DIR is a local Hugging Face checkpoint; refppo re-scores the dump's rows with its own "
        "read-outs (one teacher-forced pass, temperature from the sidecar) and compares.",
    )
    m.add_argument(
        "--actor",
        metavar="DIR",
        help="causal LM holding the weights that PRODUCED the compared log-probs (old_logprobs: the "
        "policy at rollout; with --actor-key logprobs, the policy at the update step)",
    )
    m.add_argument(
        "--actor-key",
        choices=("old_logprobs", "logprobs"),
        default="old_logprobs",
        help="the dump key the actor's re-score is compared with (old_logprobs)",
    )
    m.add_argument(
        "--ref", metavar="DIR", help="causal LM of the reference policy (compared with ref_logprobs)"
    )
    m.add_argument(
        "--critic",
        metavar="DIR",
        help="refppo's critic, or a token-/sequence-classification model with one label read per position",
    )
    m.add_argument(
        "--critic-key",
        choices=("old_values", "values"),
        default="old_values",
        help="the dump key the critic's re-score is compared with (old_values)",
    )
    m.add_argument(
        "--reward-model", metavar="DIR", help="sequence classifier, one label (compared with scores)"
    )
    m.add_argument(
        "--ratio-eps",
        type=float,
        default=0.01,
        metavar="EPS",
        help="precision statistics: share of tokens whose exp(Δ log-prob) leaves [1-EPS, 1+EPS] (0.01)",
    )
    m.add_argument("--device", default="cpu", help="torch device for the re-scoring (cpu)")
    m.add_argument(
        "--dtype",
        choices=("float32", "float64", "bfloat16", "float16", "checkpoint"),
        default="float32",
        help="precision of the re-scoring (float32; checkpoint: as the weights are stored)",
    )


def _fail(message: str) -> int:
    print(f"refppo diff: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return _run(args)
    except RefPPOError as exc:
        return _fail(" ".join(str(exc).split()))
    except (ValueError, TypeError, RuntimeError, OSError) as exc:  # torch/numpy on malformed data
        return _fail(f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")


def _threads() -> None:
    """One intra-op thread unless ``REFPPO_DIFF_THREADS`` says otherwise: the oracle's work is
    elementwise and memory-bound, and on a shared CPU extra threads only contend (3x slower here)."""
    import os

    import torch

    n = os.environ.get("REFPPO_DIFF_THREADS", "1")
    if n.isdigit() and int(n) > 0:
        torch.set_num_threads(int(n))


def _run(args: argparse.Namespace) -> int:
    _threads()
    from refppo.oracle.check.settings import parse_value
    from refppo.oracle.run import as_dump, canonical_key, check_step

    overrides: dict[str, Any] = {}
    for item in args.sets:
        if "=" not in item:
            return _fail(f"--set: expected KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        key = canonical_key(k)
        try:
            overrides[key] = parse_value(key, v)
        except RefPPOError as exc:
            return _fail(f"--set {item}: {exc}")
    raw: str | None = args.require
    require: str | list[str] | None = raw
    if raw is not None and raw != "all":
        require = [x.strip() for x in raw.split(",") if x.strip()]
    dump = as_dump(Path(args.dump), hparams_file=args.hparams)
    rescored = None
    if any((args.actor, args.ref, args.critic, args.reward_model)):
        from refppo.oracle.rescore.cli import print_rescore_only, rescore_from_args
        from refppo.pipeline.stages import OUTPUTS

        rescored = rescore_from_args(args, dump)
        if not any(dump.has(k) for k in OUTPUTS):  # inputs only: the re-score is the check
            return print_rescore_only(args, dump, rescored)
    outcome = check_step(
        dump, preset=args.preset, overrides=overrides, detect_conventions=args.detect, require=require
    )
    if args.json:
        rep = outcome.json()
        if rescored is not None:
            from refppo.oracle.rescore.report import rescore_json

            rep["rescore"] = rescore_json(*rescored)
        print(json.dumps(rep, indent=2))
    else:
        print(outcome.text(verbose=args.verbose))
        if rescored is not None:
            from refppo.oracle.rescore.report import rescore_text

            print("\n" + rescore_text(*rescored))
    # The exit code is the checked convention's verdict, with or without --detect: a CI gate that
    # names a convention must not pass because some other convention reproduces the dump. With
    # model flags, every re-scored key must match as well.
    rescore_ok = rescored is None or all(i.ok for i in rescored[0])
    return 0 if outcome.passed and rescore_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
