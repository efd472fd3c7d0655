"""The ``refppo diff`` model flags: load the checkpoints, re-score, print (imported only with a flag)."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from typing import Any

from refppo.dump.load import Dump
from refppo.dump.sequences import RescoreError
from refppo.oracle.rescore.readouts import RescoreItem, temperature_of
from refppo.oracle.rescore.run import check_device, load_models, rescore_dump


def rescore_from_args(args: argparse.Namespace, dump: Dump) -> tuple[list[RescoreItem], float]:
    """``(items, τ)``: each given model's re-score compared with its dump key."""
    if not (0.0 < args.ratio_eps < 1.0):
        raise RescoreError(f"--ratio-eps: expected a number in (0, 1), got {args.ratio_eps}")
    check_device(args.device)  # before any checkpoint loads
    with quiet_transformers():  # no loading bars or warnings mixed into the report
        models = load_models(args.actor, args.ref, args.critic, args.reward_model, args.dtype)
    keys = {
        "actor": args.actor_key,
        "ref": "ref_logprobs",
        "critic": args.critic_key,
        "reward-model": "scores",
    }
    items = rescore_dump(dump, models, keys, device=args.device, ratio_eps=args.ratio_eps)
    return items, temperature_of(dump)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' (and the hub's) progress bars off and its logging at ``error`` while loading;
    both restored afterwards."""
    from transformers.utils import logging as hf_logging_module

    hf: Any = hf_logging_module
    level, bars = hf.get_verbosity(), hf.is_progress_bar_enabled()
    hf.set_verbosity_error()
    hf.disable_progress_bar()
    try:
        yield
    finally:
        hf.set_verbosity(level)
        if bars:
            hf.enable_progress_bar()


def print_rescore_only(
    args: argparse.Namespace, dump: Dump, rescored: tuple[list[RescoreItem], float]
) -> int:
    """Report a dump of inputs only (no trainer outputs): the re-score is the whole check."""
    from refppo.oracle.rescore.report import rescore_json, rescore_text

    items, tau = rescored
    if args.json:
        print(
            json.dumps(
                {
                    "dump": {"path": str(dump.path), "B": dump.B, "T": dump.T},
                    "rescore": rescore_json(items, tau),
                },
                indent=2,
            )
        )
    else:
        print(f"refppo diff: {dump.path}  (B={dump.B}, T={dump.T}; inputs only: re-score check)")
        print(rescore_text(items, tau))
    return 0 if all(i.ok for i in items) else 1
