#!/usr/bin/env python3
"""Wall-clock and peak RSS of ``tools/diff_against.py`` on float32 dumps (run by hand; not a test).

Targets: issue #5 (B=256, T=2048): without ``--detect`` at most 1.5x
``python -c "import torch, safetensors"``, with ``--detect`` under 30 s. Issue #9 (B=1024, T=8192,
a 296 MiB dump): a mismatch with its diagnosis at most 10 s beyond the import baseline, ``--detect``
at most 60 s, peak RSS at most 2.5x the dump's size. Prints the median of ``--repeat`` runs of
each command, its ratio to the import baseline measured in the same run, and the peak RSS of the
child process (``ru_maxrss`` of a one-child wrapper). The ``mismatching`` rows run ``--detect`` on a
dump whose advantages and returns no convention makes (perturbed by N(0, 0.01²); issue #23 item 1),
with the rollout intermediates and without kl and token_rewards (``no kl``: every rollout candidate
then reaches the returns step).
The last row runs ``--detect`` on a dump
without the rollout intermediates (inputs and losses only), at the full B, T by default
(``--losses-only-size B T`` for a smaller one): no rollout stage can be checked against the dump
(only the value loss prunes the GAE options, when ``vf_loss`` is dumped), so its time grows with the
hundreds of rollout candidates times B·T (memory stays bounded). The mismatching and losses-only rows
are issue #23's; neither meets its 60 s at B=1024, T=8192 yet (benchmarks/RESULTS.md).
``--only WORD ...`` runs the rows whose label holds one of the words (and the import baseline).

    .venv/bin/python benchmarks/bench_oracle.py [--B 256] [--T 2048] [--repeat 3]
    .venv/bin/python benchmarks/bench_oracle.py --B 1024 --T 8192 --repeat 3   # issue #9
    .venv/bin/python benchmarks/bench_oracle.py --B 1024 --T 8192 --repeat 2 --against /work/main

``--against DIR``: another checkout (with its own ``.venv``) run on the same dumps, the two
alternating within each repeat (this one first on even repeats); prints both, the ratio of their
times (the figure to read on a shared machine, where absolute times move with the load) and
whether their reports (stdout and exit code) are byte-identical.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from refppo.dump.write import write_dump  # noqa: E402
from refppo.oracle.check.recompute import reference_outputs  # noqa: E402
from refppo.oracle.check.settings import build_setup, parse_value  # noqa: E402
from refppo.oracle.presets.registry import resolve_preset  # noqa: E402

HP = {"gamma": 1.0, "lam": 0.95, "kl_coef": 0.05, "cliprange": 0.2, "cliprange_value": 0.2, "vf_coef": 0.1}


def make_dump(
    path: Path,
    B: int,
    T: int,
    preset: str,
    keep_intermediates: bool = True,
    mismatch: bool = False,
    keep_kl: bool = True,
) -> None:
    """A float32 dump made under ``preset``; ``keep_intermediates=False``: inputs and losses only;
    ``mismatch``: the advantages and returns perturbed by N(0, 0.01²) on the valid tokens (a trainer
    whose rollout no convention reproduces); ``keep_kl=False``: the kl and token_rewards left out
    (every rollout candidate then reaches the returns step)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(1)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    inputs = {
        "response_mask": mask.to(torch.uint8),
        "old_logprobs": old,
        "ref_logprobs": old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64),
        "logprobs": old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64),
        "old_values": torch.randn(B, T, generator=g, dtype=torch.float64),
        "values": torch.randn(B, T, generator=g, dtype=torch.float64),
        "scores": torch.randn(B, generator=g, dtype=torch.float64),
    }
    # a float32 trainer: its inputs are float32 numbers; the reference is computed from those
    inputs = {
        k: (v.to(torch.float32).to(torch.float64) if v.is_floating_point() else v) for k, v in inputs.items()
    }
    pc, ph = resolve_preset(preset)
    setup = build_setup(
        preset_conv=pc, preset_hp=ph, sidecar={k: parse_value(k, v) for k, v in HP.items()}, overrides={}
    )
    outs = reference_outputs(inputs, setup, dtype=torch.float32)
    if not keep_intermediates:
        outs = {k: v for k, v in outs.items() if k not in ("kl", "token_rewards", "advantages", "returns")}
    if mismatch:
        gm = torch.Generator().manual_seed(1)
        for k in ("advantages", "returns"):
            outs[k] = outs[k] + 0.01 * torch.randn(outs[k].shape, generator=gm, dtype=outs[k].dtype) * mask
    if not keep_kl:
        outs = {k: v for k, v in outs.items() if k not in ("kl", "token_rewards")}
    tensors = {k: (v.to(torch.float32) if v.is_floating_point() else v) for k, v in inputs.items()}
    write_dump(path, {**tensors, **outs}, hparams=HP)


_WRAP = (
    "import hashlib, resource, subprocess, sys, time; t0 = time.perf_counter(); "
    "p = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL); "
    "dt = time.perf_counter() - t0; "
    "ru = resource.getrusage(resource.RUSAGE_CHILDREN); "
    "print(dt, ru.ru_maxrss, p.returncode, hashlib.sha1(p.stdout).hexdigest(), ru.ru_utime)"
)


def run_once(cmd: list[str], cwd: Path) -> tuple[float, float, int, str, float]:
    """Wall-clock (s), peak RSS (MB, ``ru_maxrss`` of a one-child wrapper), exit code, the sha1
    of the stdout and the user CPU (s) of one run of ``cmd``."""
    out = subprocess.run([sys.executable, "-c", _WRAP, *cmd], capture_output=True, text=True, cwd=cwd)
    dt, kb, code, digest, user = out.stdout.split()
    return float(dt), int(kb) / 1024.0, int(code), digest, float(user)


def timed(cmd: list[str], repeat: int) -> tuple[float, float, int]:
    """Median wall-clock (s), largest peak RSS (MB) and the exit code of ``repeat`` runs of ``cmd``."""
    runs = [run_once(cmd, REPO) for _ in range(repeat)]
    return statistics.median(r[0] for r in runs), max(r[1] for r in runs), runs[-1][2]


def against(rows: list[tuple[str, list[str]]], other: Path, repeat: int, size: float) -> None:
    """Each row's command (``tools/diff_against.py`` and its arguments) by this checkout and by
    ``other``'s, alternating; medians, the time ratio, peak RSS (× the dump) and report identity."""
    py_other = str(other / ".venv" / "bin" / "python")
    for label, cmd in rows:
        mine_cmd = [sys.executable, *cmd]
        theirs_cmd = [py_other, str(other / "tools" / "diff_against.py"), *cmd[1:]]
        mine, theirs = [], []
        for r in range(repeat):
            order = [(mine, mine_cmd, REPO), (theirs, theirs_cmd, other)]
            for acc, c, cwd in order if r % 2 == 0 else order[::-1]:
                acc.append(run_once(c, cwd))
        tm, to = statistics.median(x[0] for x in mine), statistics.median(x[0] for x in theirs)
        um, uo = statistics.median(x[4] for x in mine), statistics.median(x[4] for x in theirs)
        same = {(x[2], x[3]) for x in mine} == {(x[2], x[3]) for x in theirs} and len(
            {x[3] for x in mine}
        ) == 1
        print(
            f"{label:<44} this {tm:7.2f} s, other {to:7.2f} s (this/other {tm / to:4.2f}); user CPU this "
            f"{um:7.2f} s, other {uo:7.2f} s ({um / uo:4.2f}); peak RSS this "
            f"{max(x[1] for x in mine):5.0f} MB ({max(x[1] for x in mine) / size:4.2f}x), other "
            f"{max(x[1] for x in theirs):5.0f} MB ({max(x[1] for x in theirs) / size:4.2f}x); "
            f"reports {'identical' if same else 'DIFFER'}; load {os.getloadavg()[0]:.1f}"
        )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=256)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--preset", default="trl")
    ap.add_argument("--against", type=Path, default=None, help="another checkout to alternate with")
    ap.add_argument(
        "--losses-only-size",
        type=int,
        nargs=2,
        metavar=("B", "T"),
        default=None,
        help="size of the dump without rollout intermediates (default: B, T; its --detect walks "
        "thousands of rollout candidates, each over B*T tokens)",
    )
    ap.add_argument(
        "--only", nargs="+", default=None, help="run only the rows whose label holds one of these"
    )
    a = ap.parse_args()
    py = sys.executable
    tool = str(REPO / "tools" / "diff_against.py")
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "full.safetensors"
        lo_B, lo_T = a.losses_only_size or (a.B, a.T)
        dumps: dict[str, tuple[Path, dict[str, Any]]] = {
            "full": (full, {}),
            "mism": (Path(tmp) / "mismatch.safetensors", {"mismatch": True}),
            "nokl": (Path(tmp) / "mismatch_nokl.safetensors", {"mismatch": True, "keep_kl": False}),
            "losses": (Path(tmp) / "losses_only.safetensors", {"keep_intermediates": False}),
        }
        d = {k: str(v[0]) for k, v in dumps.items()}
        detect = ["--preset", a.preset, "--detect"]
        rows = [
            ("import torch, safetensors (baseline)", [py, "-c", "import torch, safetensors"]),
            (f"diff --preset {a.preset} (match)", [py, tool, d["full"], "--preset", a.preset]),
            ("diff --preset verl (mismatch + explain)", [py, tool, d["full"], "--preset", "verl"]),
            (f"diff --preset {a.preset} --detect", [py, tool, d["full"], *detect]),
            (f"diff --preset {a.preset} --detect, mismatching", [py, tool, d["mism"], *detect]),
            (f"diff --preset {a.preset} --detect, no kl, mismatching", [py, tool, d["nokl"], *detect]),
            (f"diff --detect, losses-only B={lo_B} T={lo_T}", [py, tool, d["losses"], "--detect"]),
        ]
        rows = [r for r in rows if a.only is None or r is rows[0] or any(w in r[0] for w in a.only)]
        for key, (path, kw) in dumps.items():  # only the dumps the rows read (and the full one: its size)
            if key == "full" or any(str(path) in cmd for _, cmd in rows):
                make_dump(
                    path, lo_B if key == "losses" else a.B, lo_T if key == "losses" else a.T, a.preset, **kw
                )
        base = None
        size = full.stat().st_size / 2**20
        print(f"B={a.B} T={a.T} float32 ({size:.0f} MB), median of {a.repeat} runs")
        if a.against is not None:
            t, rss, _ = timed(rows[0][1], a.repeat)
            print(f"{rows[0][0]:<44} {t:7.2f} s  peak RSS {rss:6.0f} MB ({rss / size:4.2f}x dump)")
            against([(label, cmd[1:]) for label, cmd in rows[1:]], a.against.resolve(), a.repeat, size)
            return 0
        for label, cmd in rows:
            t, rss, rc = timed(cmd, a.repeat)
            base = t if base is None else base
            print(
                f"{label:<44} {t:7.2f} s  ({t / base:4.2f}x baseline, +{t - base:5.2f} s)  "
                f"peak RSS {rss:6.0f} MB ({rss / size:4.2f}x dump)  exit {rc}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
