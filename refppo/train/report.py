"""What an iteration reports (its ``metrics.jsonl`` record) and what a run writes besides its
checkpoints (``run.json``, ``config.json``, sample generations, ``plot.png``).

A record, in this key order (``time/*`` are wall-clock; every other value is a deterministic
function of the config and seed, reproduced exactly by a resumed run)::

    iteration, kl_coef, skipped, rollout/<ROLLOUT_KEYS and rule_score>, ppo/<the rest>,
    [rollout/missing_eos_penalty], time/rollout, time/score_update, time/iteration,
    time/response_tokens_per_s, time/peak_rss_mb

A critic-free run (no critic: ``ppo.advantage`` ≠ ``gae``) logs no ``ppo/vf_loss``,
``ppo/vf_clipfrac`` or ``ppo/critic_grad_norm`` (:data:`CRITIC_KEYS`), and its rollout has no
``value_mean``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from refppo.atomic import atomic_write_text, atomic_write_with
from refppo.train import rundir
from refppo.train.config.schema import TrainConfig
from refppo.train.iteration import IterationResult
from refppo.train.runlog import format_samples, plot_metrics, read_metrics
from refppo.train.runtime import TrainingError, finite, params_finite, peak_rss_mb

ROLLOUT_KEYS = (
    "score",
    "raw_score",
    "kl",
    "non_score_reward",
    "response_length",
    "eos_frac",
    "old_entropy",
    "advantage_mean",
    "return_mean",
    "value_mean",
    "seam_staleness",
    "seam_kl",
    "seam_abs_log_ratio",
)
"""Keys of :func:`refppo.train.iteration.rollout_metrics` and, in the seam mode, of
:func:`refppo.train.seam.seam_metrics` (logged as ``rollout/<key>``; the rest as ``ppo/<key>``)."""


CRITIC_KEYS = ("vf_loss", "vf_clipfrac", "critic_grad_norm")
"""The update's scalars of the critic: not logged by a critic-free run (``ppo.advantage`` ≠ ``gae``),
where they would be constant zeros of a model that does not exist."""


def make_record(
    it: int, kl_coef: float, metrics: dict[str, float], eos_penalty: bool, *, critic: bool = True
) -> dict[str, Any]:
    """The record of 0-based iteration ``it`` from its rank-reduced ``metrics`` (``skipped=0``;
    ``eos_penalty``: also the mean missing-EOS penalty per response, ``raw_score − score``;
    ``critic`` False: without :data:`CRITIC_KEYS`)."""
    record: dict[str, Any] = {"iteration": it + 1, "kl_coef": kl_coef, "skipped": 0}
    for k, v in metrics.items():
        if not critic and k in CRITIC_KEYS:
            continue
        record[("rollout/" if k in ROLLOUT_KEYS or k == "rule_score" else "ppo/") + k] = v
    if eos_penalty:  # mean penalty per response (plotted on its own)
        record["rollout/missing_eos_penalty"] = metrics["raw_score"] - metrics["score"]
    return record


def add_timing(record: dict[str, Any], t0: float, t1: float, t2: float, n_tokens: float) -> None:
    """``time/*`` of an iteration that sampled from ``t0`` to ``t1`` and scored + updated until
    ``t2``, with ``n_tokens`` response tokens over every rank."""
    record["time/rollout"] = t1 - t0
    record["time/score_update"] = t2 - t1
    record["time/iteration"] = t2 - t0
    record["time/response_tokens_per_s"] = n_tokens / max(t2 - t0, 1e-9)
    record["time/peak_rss_mb"] = peak_rss_mb()


def non_finite(metrics: dict[str, float], trained: dict[str, nn.Module]) -> list[str]:
    """The losses that are not finite, then the trained models holding a non-finite weight."""
    bad = [k for k in ("loss", "pg_loss", "vf_loss") if not finite(metrics.get(k, 0.0))]
    return bad + [n for n, m in trained.items() if not params_finite(m)]


def non_finite_error(it: int, bad: list[str], metrics: dict[str, float], last: Path | None) -> TrainingError:
    """The error of a non-finite iteration under ``run.on_nan=raise`` (``last``: the newest
    complete checkpoint, which is intact)."""
    kept = f"the last checkpoint, {str(last)!r}, is intact" if last else "no checkpoint exists yet"
    return TrainingError(
        f"iteration {it + 1}: non-finite {', '.join(bad)} (scores: mean {metrics['score']!r}); "
        f"stopping — {kept}. Lower optimizer.lr, check the reward, "
        "or set run.on_nan=skip to drop such updates"
    )


def samples_text(n: int, texts: list[str], result: IterationResult, tokenizer: Any) -> str:
    """Up to three prompts of iteration ``n`` with their decoded responses and scores."""
    b = result.scored.batch
    responses = [tokenizer.decode(b.unpadded(i)[1]) for i in range(min(3, b.batch_size))]
    return format_samples(n, texts, responses, result.scored.scores.tolist())


def prepare_out_dir(
    out_dir: Path,
    cfg: TrainConfig,
    identity: rundir.RunIdentity,
    *,
    resume: bool,
    overwrite: bool,
    echo: Callable[[str], None],
) -> None:
    """Main rank, before the first iteration: a fresh run clears the out dir (``overwrite``,
    refppo's entries only) and writes ``run.json``; every run writes ``config.json`` (atomically)."""
    if not resume:
        if overwrite:
            kept = rundir.clear_run(out_dir)
            if kept:
                echo(f"--overwrite: kept {len(kept)} entries not refppo's: {', '.join(kept)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        rundir.write_identity(out_dir, identity)
    atomic_write_text(out_dir / "config.json", cfg.to_json() + "\n")


def write_plot(out_dir: Path, echo: Callable[[str], None], kl_estimator: str | None = None) -> None:
    """``plot.png`` of every record in ``metrics.jsonl`` (resumed runs included), atomically
    (``kl_estimator``: named in the KL's legend)."""
    all_records = read_metrics(out_dir / "metrics.jsonl")
    if all_records:
        path = out_dir / "plot.png"
        plot = lambda tmp: plot_metrics(all_records, tmp, kl_estimator=kl_estimator)  # noqa: E731
        atomic_write_with(path, plot, suffix=".png")
        echo(f"plot: {path}")


__all__ = [
    "CRITIC_KEYS",
    "ROLLOUT_KEYS",
    "add_timing",
    "make_record",
    "non_finite",
    "non_finite_error",
    "prepare_out_dir",
    "samples_text",
    "write_plot",
]
