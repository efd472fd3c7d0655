"""Run logging: metrics JSONL, tqdm progress bar, sample printing, PNG plot, optional TensorBoard.

Every metric of an iteration is one JSON object on one line of ``metrics.jsonl``. Keys under
``time/`` are wall-clock measurements (they differ between runs); every other key is a
deterministic function of the config and seed (a resumed run reproduces them exactly).
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

PLOT_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward (score)", ("rollout/score", "rollout/raw_score", "rollout/rule_score")),
    ("KL(π‖π_ref) per sequence", ("rollout/kl",)),
    ("policy loss", ("ppo/pg_loss",)),
    ("value loss", ("ppo/vf_loss",)),
    ("clip fractions", ("ppo/pg_clipfrac", "ppo/vf_clipfrac")),
    ("entropy per token", ("rollout/old_entropy",)),
)
"""(title, metric keys) of each panel of ``plot.png``."""


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics JSONL file."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def deterministic(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` without its wall-clock (``time/``) keys."""
    return {k: v for k, v in record.items() if not k.startswith("time/")}


class MetricsLog:
    """Append-only JSONL metrics (main rank only), truncated to ``resume_from`` iterations on resume."""

    def __init__(self, path: str | Path, *, resume_from: int | None = None, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from is None:
            self.path.write_text("")
        else:  # drop records written after the checkpoint (a run interrupted after it)
            kept = [r for r in read_metrics(self.path) if int(r["iteration"]) <= resume_from]
            self.path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (non-finite floats are written as null... never silently: as strings)."""
        if not self.enabled:
            return
        clean = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in record.items()
        }
        with self.path.open("a") as f:
            f.write(json.dumps(clean, sort_keys=True) + "\n")


class TensorBoard:
    """``torch.utils.tensorboard.SummaryWriter`` when tensorboard is installed, else a no-op (warned)."""

    def __init__(self, log_dir: str | Path, enabled: bool) -> None:
        self.writer: Any = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard not installed: skip cleanly
            warnings.warn("run.tensorboard=true but tensorboard is not installed; skipping", stacklevel=2)
            return
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any], step: int) -> None:
        """Log the numeric scalars of ``record``."""
        if self.writer is None:
            return
        for k, v in record.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        """Flush and close."""
        if self.writer is not None:
            self.writer.close()


class Progress:
    """A tqdm bar over iterations with live reward / KL / loss (a no-op when disabled)."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self.bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="ppo", unit="it", dynamic_ncols=True)

    def update(self, record: dict[str, Any]) -> None:
        """Advance one iteration and show the headline metrics."""
        if self.bar is None:
            return
        self.bar.set_postfix(
            reward=f"{record.get('rollout/score', float('nan')):.3f}",
            kl=f"{record.get('rollout/kl', float('nan')):.3f}",
            loss=f"{record.get('ppo/loss', float('nan')):.3f}",
            refresh=False,
        )
        self.bar.update(1)

    def write(self, text: str) -> None:
        """Print without breaking the bar."""
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=sys.stdout, flush=True)

    def close(self) -> None:
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()


def format_samples(
    iteration: int, prompts: Sequence[str], responses: Sequence[str], scores: Iterable[float], n: int = 3
) -> str:
    """A few generations as text."""
    lines = [f"--- samples at iteration {iteration} ---"]
    for p, r, s in list(zip(prompts, responses, scores, strict=False))[:n]:
        lines.append(f"[{s:+.3f}] {p!r} -> {r!r}")
    return "\n".join(lines)


def plot_metrics(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write a PNG grid of the :data:`PLOT_PANELS` metrics per iteration (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7), constrained_layout=True)
    its = [int(r["iteration"]) for r in records]
    for ax, (title, keys) in zip(axes.flat, PLOT_PANELS, strict=True):
        for key in keys:
            ys = [r.get(key) for r in records]
            pts = [(x, float(y)) for x, y in zip(its, ys, strict=True) if isinstance(y, (int, float))]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], label=key, marker=".")
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    out = Path(path)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
