"""Run logging: metrics JSONL, tqdm progress bar, sample printing, PNG plot, optional TensorBoard.

Every metric of an iteration is one JSON object on one line of ``metrics.jsonl``. Keys under
``time/`` are wall-clock measurements (they differ between runs); every other key is a
deterministic function of the config and seed (a resumed run reproduces them exactly).
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refppo.atomic import PAUSE_ENV, atomic_write_bytes, pause_for_test
from refppo.errors import RefPPOError

PlotPanel = tuple[str, str, tuple[str, ...]]
"""(title, y-axis label with its unit, metric keys) of one panel."""

PLOT_PANELS: tuple[PlotPanel, ...] = (
    (
        "Reward per response",
        "reward (units of the reward model / function)",
        ("rollout/score", "rollout/raw_score", "rollout/missing_eos_penalty", "rollout/rule_score"),
    ),
    ("KL(π_old ‖ π_ref) per response", "nats (sum over response tokens)", ("rollout/kl",)),
    ("Policy loss (clipped surrogate)", "loss (aggregated per ppo.loss_agg)", ("ppo/pg_loss",)),
    ("Value loss (clipped, × 0.5)", "loss (squared reward units)", ("ppo/vf_loss",)),
    ("Clip fractions", "fraction of valid tokens clipped", ("ppo/pg_clipfrac", "ppo/vf_clipfrac")),
    ("Entropy of the sampling policy", "nats per response token", ("rollout/old_entropy",)),
)
"""The panels of ``plot.png``, in reading order (2 rows × 3)."""

SERIES_LABELS: dict[str, str] = {
    "rollout/score": "score: reward that enters PPO (raw − missing-EOS penalty)",
    "rollout/raw_score": "raw_score: reward model / function output",
    "rollout/missing_eos_penalty": "missing-EOS penalty subtracted (mean per response)",
    "rollout/rule_score": "rule_score: hidden rule, the true objective (embedded task; right axis)",
    "rollout/kl": "KL (ppo.kl_estimator)",
    "ppo/pg_loss": "policy loss",
    "ppo/vf_loss": "value loss",
    "ppo/pg_clipfrac": "policy: ratio outside 1 ± ε",
    "ppo/vf_clipfrac": "value: outside V_old ± ε_v",
    "rollout/old_entropy": "entropy (token mean)",
}
"""Legend text of each plotted metric (what it is, not just its key)."""


@dataclass(frozen=True)
class MetricsFile:
    """The records of a metrics JSONL file and what was wrong with its end."""

    records: list[dict[str, Any]]
    torn: int
    """Bytes of a torn last line (no newline: a write interrupted by a crash) that were ignored; 0: none."""


def load_metrics(path: str | Path) -> MetricsFile:
    """All complete records of a metrics JSONL file.

    A record is complete once its newline is written (:meth:`MetricsLog.write` writes line and
    newline in one ``write`` and fsyncs), so a last line without a newline is an interrupted write:
    it is never read as a record, and its size is reported in ``torn``. Any complete line that is
    not a JSON object with an ``iteration`` raises :class:`refppo.errors.RefPPOError` naming the
    file and line (damage, not a crash)."""
    p = Path(path)
    if not p.exists():
        return MetricsFile([], 0)
    data = p.read_bytes()
    body, nl, tail = data.rpartition(b"\n")
    if not nl:
        body, tail = b"", data
    records: list[dict[str, Any]] = []
    for n, line in enumerate(body.split(b"\n") if body else [], start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RefPPOError(f"{p}: line {n} is not a JSON record ({e})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("iteration"), int):
            raise RefPPOError(f"{p}: line {n} is not a metrics record (no integer 'iteration')")
        records.append(rec)
    return MetricsFile(records, len(tail))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a metrics JSONL file (a torn last line is ignored with a warning;
    see :func:`load_metrics`)."""
    m = load_metrics(path)
    if m.torn:
        warnings.warn(
            f"{path}: ignored a torn last line ({m.torn} bytes, a write interrupted by a crash)",
            stacklevel=2,
        )
    return m.records


def deterministic(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` without its wall-clock (``time/``) keys."""
    return {k: v for k, v in record.items() if not k.startswith("time/")}


class MetricsLog:
    """Append-only JSONL metrics (main rank only), truncated to ``resume_from`` iterations on resume.

    Each record is one ``write`` of the line with its newline, flushed and fsync-ed, so a crash
    leaves at most a torn last line, which :func:`load_metrics` never reads as a record. Starting
    (fresh or resumed) rewrites the file atomically (temp file + rename); on resume it keeps the
    records up to the checkpoint's iteration. What was dropped is listed in :attr:`notes`."""

    def __init__(self, path: str | Path, *, resume_from: int | None = None, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self.notes: list[str] = []
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from is None:
            atomic_write_bytes(self.path, b"")
            return
        # drop records written after the checkpoint (a run interrupted after it) and a torn line
        m = load_metrics(self.path)
        kept = [r for r in m.records if r["iteration"] <= resume_from]
        if m.torn:
            self.notes.append(f"dropped a torn last line ({m.torn} bytes, a write interrupted by a crash)")
        if len(kept) < len(m.records):
            self.notes.append(
                f"dropped {len(m.records) - len(kept)} records after iteration {resume_from} (the checkpoint)"
            )
        its = [r["iteration"] for r in kept]
        if its != list(range(1, resume_from + 1)):
            self.notes.append(
                f"WARNING: holds {len(its)} records for the {resume_from} iterations before the checkpoint "
                "(iterations missing or repeated: the metrics of this run are incomplete)"
            )
        atomic_write_bytes(self.path, "".join(_line(r) for r in kept).encode("utf-8"))

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (non-finite floats are written as strings, never silently dropped)."""
        if not self.enabled:
            return
        clean = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in record.items()
        }
        data = _line(clean).encode("utf-8")
        with self.path.open("ab") as f:
            if os.environ.get(PAUSE_ENV) == f"metrics:{record.get('iteration')}":  # test-only: a torn line
                f.write(data[: len(data) // 2])
                f.flush()
                pause_for_test(f"metrics:{record.get('iteration')}")
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def _line(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True) + "\n"


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


def kl_label(estimator: str) -> str:
    """``KL(<estimator>)``: the rollout KL of the log lines names its estimator (``ppo.kl_estimator``:
    a per-response sum of ``k1`` can be negative, ``k2``/``k3``/``abs`` cannot)."""
    return f"KL({estimator})"


class Progress:
    """Per-iteration progress on the main rank: a tqdm bar with live reward / KL / loss
    (``bar=True``), or one plain line per iteration (``bar=False``, ``--no-progress``: logs and
    pipes); nothing at all when ``enabled`` is false (the other ranks)."""

    def __init__(
        self, total: int, initial: int, enabled: bool, *, bar: bool = True, kl_label: str = "KL"
    ) -> None:
        self.bar: Any = None
        self.total = total
        self.kl_label = kl_label
        """How the rollout KL is named: ``KL(k1)`` names the estimator (:func:`kl_label`)."""
        self.lines = enabled and not bar
        if enabled and bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="ppo", unit="it", dynamic_ncols=True)

    def update(self, record: dict[str, Any]) -> None:
        """Advance one iteration and show the headline metrics."""
        nan = float("nan")
        if self.lines:
            print(
                f"iteration {record.get('iteration', '?')}/{self.total}: "
                f"reward {record.get('rollout/score', nan):+.4f}  "
                f"{self.kl_label} {record.get('rollout/kl', nan):.4f}  "
                f"loss {record.get('ppo/loss', nan):+.4f}  {record.get('time/iteration', nan):.2f} s",
                flush=True,
            )
        if self.bar is None:
            return
        self.bar.set_postfix(
            {
                "reward": f"{record.get('rollout/score', nan):.3f}",
                self.kl_label: f"{record.get('rollout/kl', nan):.3f}",
                "loss": f"{record.get('ppo/loss', nan):.3f}",
            },
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


SERIES_STYLE: dict[str, dict[str, Any]] = {
    "rollout/score": {"linestyle": "-", "marker": "o", "markersize": 4, "linewidth": 2.0},
    "rollout/raw_score": {"linestyle": "--", "marker": "x", "markersize": 6, "linewidth": 1.2},
    "rollout/missing_eos_penalty": {"linestyle": ":", "marker": "."},
}
"""Line styles that keep ``score`` and ``raw_score`` apart where they coincide (no missing-EOS
penalty: the dashed ``raw_score`` with crosses lies on the solid ``score`` with dots)."""
RULE_KEY = "rollout/rule_score"
"""Plotted on its own y-axis (right) of the reward panel: a score in [−1, 1], not the reward's units."""
RULE_AXIS_LABEL = "hidden-rule score ((#positive − #negative words) / length)"
CRITIC_PANEL_KEYS = ("ppo/vf_loss",)
"""A panel whose every key is one of these is left out when no record holds any (a critic-free run)."""


def _series(records: Sequence[dict[str, Any]], its: list[int], key: str) -> list[tuple[int, float]]:
    ys = [r.get(key) for r in records]
    return [(x, float(y)) for x, y in zip(its, ys, strict=True) if isinstance(y, (int, float))]


def _plot_panel(
    ax: Any, records: Sequence[dict[str, Any]], its: list[int], panel: PlotPanel, labels: dict[str, str]
) -> None:
    """One panel: its series (the hidden-rule score on a second y-axis), labels, integer x ticks."""
    from matplotlib.ticker import MaxNLocator

    name, ylabel, keys = panel
    handles: list[Any] = []
    for key in keys:
        pts = _series(records, its, key)
        if not pts:
            continue
        target = ax
        if key == RULE_KEY:
            target = ax.twinx()
            target.set_ylabel(RULE_AXIS_LABEL, fontsize=8, color="C3")
            target.tick_params(axis="y", colors="C3")
        style = SERIES_STYLE.get(key, {"linestyle": "-", "marker": "."})
        color = "C3" if key == RULE_KEY else None
        (line,) = target.plot([x for x, _ in pts], [y for _, y in pts], label=labels.get(key, key),
                              color=color, **style)  # fmt: skip
        handles.append(line)
    ax.set_title(name, fontsize=11)
    ax.set_xlabel("PPO iteration (one rollout batch + its update)", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if handles:  # below the panel: never over the curves
        ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_figure(
    records: Sequence[dict[str, Any]], *, title: str | None = None, kl_estimator: str | None = None
) -> Any:
    """A matplotlib figure (Agg) with one panel per :data:`PLOT_PANELS` entry, x = iteration
    (integer ticks).

    Each panel has a title, a y-axis label with its unit, the x axis "PPO iteration" and a legend
    saying what each series is (:data:`SERIES_LABELS`); a series absent from the records (the
    missing-EOS penalty when it is off, ``rule_score`` outside the embedded task) is left out, a
    panel with no series says "not logged", and the value-loss panel is left out of a critic-free
    run's figure (:data:`CRITIC_PANEL_KEYS`). The hidden-rule score has its own y-axis on the
    reward panel (:data:`RULE_KEY`); ``score`` and ``raw_score`` are drawn apart
    (:data:`SERIES_STYLE`); ``kl_estimator`` names the KL's estimator in its legend. The caller
    closes the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 9), constrained_layout=True)
    its = [int(r["iteration"]) for r in records]
    panels = [
        p
        for p in PLOT_PANELS
        if not set(p[2]) <= set(CRITIC_PANEL_KEYS) or any(_series(records, its, k) for k in p[2])
    ]
    labels = dict(SERIES_LABELS)
    if kl_estimator is not None:
        labels["rollout/kl"] = f"KL, estimator {kl_estimator} (ppo.kl_estimator)"
    for ax, panel in zip(axes.flat, panels, strict=False):
        _plot_panel(ax, records, its, panel, labels)
    for ax in list(axes.flat)[len(panels) :]:
        fig.delaxes(ax)
    fig.suptitle(title or f"refppo train: {len(records)} iterations", fontsize=13)
    return fig


def plot_metrics(
    records: Sequence[dict[str, Any]],
    path: str | Path,
    *,
    title: str | None = None,
    kl_estimator: str | None = None,
) -> Path:
    """Write :func:`plot_figure` of ``records`` as a PNG to ``path``."""
    import matplotlib.pyplot as plt

    fig = plot_figure(records, title=title, kl_estimator=kl_estimator)
    out = Path(path)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
