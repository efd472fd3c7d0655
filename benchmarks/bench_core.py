"""Benchmark: every vectorized core step vs its naive twin at B=64, T=512 (logits: V=64).

Run by hand (``make bench`` or ``.venv/bin/python benchmarks/bench_core.py``); not a test.
Batch: float32, right-padded, row lengths uniform in 1..512 (seeded), junk (NaN) on padding.
Timing: wall-clock median of ``--naive-runs`` runs of the naive twin and ``--vec-runs`` runs of
the vectorized function, each call including its input validation, torch limited to
``--threads`` intra-op threads (default 1, so both sides use one core). The bar is ≥100× per step.
``total_loss`` is left out: it combines five 0-dim scalars, there is nothing to vectorize.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from refppo.core.aggregate import aggregate_loss, aggregate_loss_naive
from refppo.core.gae import gae, gae_naive
from refppo.core.kl import token_kl, token_kl_naive
from refppo.core.logprobs import (
    entropy_from_logits,
    entropy_from_logits_naive,
    logprobs_from_logits,
    logprobs_from_logits_naive,
)
from refppo.core.masked import (
    masked_mean,
    masked_mean_naive,
    masked_sum,
    masked_sum_naive,
    masked_var,
    masked_var_naive,
    masked_whiten,
    masked_whiten_naive,
)
from refppo.core.objective import entropy_bonus, entropy_bonus_naive, kl_loss, kl_loss_naive
from refppo.core.policy import clipped_policy_loss, clipped_policy_loss_naive
from refppo.core.rewards import token_rewards, token_rewards_naive
from refppo.core.value import value_loss, value_loss_naive

BAR = 100.0


def _median_time(fn: Callable[[], Any], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build_steps(B: int, T: int, V: int, seed: int) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """Step name -> (vectorized call, naive call) on one seeded batch."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    nan = torch.tensor(float("nan"))

    def floats(lo: float, hi: float) -> torch.Tensor:
        x = torch.rand(B, T, generator=g) * (hi - lo) + lo
        return torch.where(mask, x, nan)

    logits = torch.randn(B, T, V, generator=g) * 2.0
    tokens = torch.randint(0, V, (B, T), generator=g)
    lp_old, lp_ref = floats(-5.0, -0.01), floats(-5.0, -0.01)
    lp = lp_old + floats(-0.3, 0.3)
    adv, kl = floats(-2.0, 2.0), floats(-0.5, 0.5)
    v_old, ret = floats(-2.0, 2.0), floats(-2.0, 2.0)
    v = v_old + floats(-0.5, 0.5)
    rewards, scores = floats(-1.0, 1.0), torch.rand(B, generator=g)
    ent = floats(0.0, 4.0)
    return {
        "masked_sum": (lambda: masked_sum(adv, mask), lambda: masked_sum_naive(adv, mask)),
        "masked_mean": (lambda: masked_mean(adv, mask), lambda: masked_mean_naive(adv, mask)),
        "masked_var": (lambda: masked_var(adv, mask), lambda: masked_var_naive(adv, mask)),
        "masked_whiten": (lambda: masked_whiten(adv, mask), lambda: masked_whiten_naive(adv, mask)),
        "logprobs_from_logits": (
            lambda: logprobs_from_logits(logits, tokens, mask, temperature=0.7),
            lambda: logprobs_from_logits_naive(logits, tokens, mask, temperature=0.7),
        ),
        "entropy_from_logits": (
            lambda: entropy_from_logits(logits, mask, temperature=0.7),
            lambda: entropy_from_logits_naive(logits, mask, temperature=0.7),
        ),
        "token_kl (k3)": (
            lambda: token_kl(lp, lp_ref, mask, "k3"),
            lambda: token_kl_naive(lp, lp_ref, mask, "k3"),
        ),
        "token_rewards": (
            lambda: token_rewards(scores, kl, mask, 0.05),
            lambda: token_rewards_naive(scores, kl, mask, 0.05),
        ),
        "gae": (
            lambda: gae(rewards, v_old, mask, gamma=1.0, lam=0.95),
            lambda: gae_naive(rewards, v_old, mask, gamma=1.0, lam=0.95),
        ),
        "clipped_policy_loss": (
            lambda: clipped_policy_loss(lp, lp_old, adv, mask, dual_clip=3.0),
            lambda: clipped_policy_loss_naive(lp, lp_old, adv, mask, dual_clip=3.0),
        ),
        "value_loss": (
            lambda: value_loss(v, v_old, ret, mask),
            lambda: value_loss_naive(v, v_old, ret, mask),
        ),
        "aggregate_loss (seq-mean-token-mean)": (
            lambda: aggregate_loss(adv, mask, "seq-mean-token-mean"),
            lambda: aggregate_loss_naive(adv, mask, "seq-mean-token-mean"),
        ),
        "entropy_bonus": (lambda: entropy_bonus(ent, mask), lambda: entropy_bonus_naive(ent, mask)),
        "kl_loss (k3)": (lambda: kl_loss(lp, lp_ref, mask), lambda: kl_loss_naive(lp, lp_ref, mask)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--B", type=int, default=64)
    parser.add_argument("--T", type=int, default=512)
    parser.add_argument("--V", type=int, default=64)
    parser.add_argument("--naive-runs", type=int, default=3)
    parser.add_argument("--vec-runs", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="run only steps whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps = build_steps(args.B, args.T, args.V, args.seed)
    print(
        f"B={args.B} T={args.T} V={args.V} float32, torch {torch.__version__}, {args.threads} thread(s); "
        f"median of {args.naive_runs} naive / {args.vec_runs} vectorized runs"
    )
    header = (
        f"| {'step':<38} | {'naive (ms)':>11} | {'vectorized (ms)':>15} | {'speed-up':>9} | {'≥100×':<5} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    failed = []
    for name, (vec, naive) in steps.items():
        if args.only and args.only not in name:
            continue
        vec()  # warm-up
        t_naive = _median_time(naive, args.naive_runs)
        t_vec = _median_time(vec, args.vec_runs)
        speedup = t_naive / t_vec
        ok = speedup >= BAR
        if not ok:
            failed.append(name)
        cells = f"| {name:<38} | {t_naive * 1e3:>11.2f} | {t_vec * 1e3:>15.3f} | {speedup:>8.0f}× |"
        print(f"{cells} {'yes' if ok else 'NO':<5} |")
    if failed:
        print(f"\nbelow the {BAR:.0f}× bar: {', '.join(failed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
