"""``refppo diff --detect`` of this checkout against another one, byte for byte, on many small dumps.

Run by hand (not a test): ``python benchmarks/compare_detect.py OTHER_CHECKOUT [--small] [--both]``.
Makes dumps with :func:`bench_oracle.make_dump` for every preset's maker: at the first size full,
losses-only (no ``kl``, ``token_rewards``, ``advantages``, ``returns``) and with only ``returns``
dropped; for the makers in :data:`SCALED` also losses-only with ``vf_loss`` or ``pg_loss`` scaled by
1.05 (nothing reproduces it: the search's nearest-group paths run); at the other sizes losses-only.
Each dump is diffed with ``--detect`` by both checkouts, alternately as text under no preset and as
``--json`` under its maker's preset (``--both``: each dump both ways): one process per checkout runs
``refppo.cli.main`` on every case in turn, with that checkout's ``refppo`` first on ``sys.path``.
Stdout and exit code are compared; prints one line per case and the count that differ, exit 1 if any.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_oracle import make_dump  # noqa: E402

MAKERS = ("refppo", "verl", "openrlhf", "trl", "deepspeed-chat", "skyrl", "areal")
SIZES = ((8, 16), (12, 32), (10, 24))
INTERMEDIATES = ("kl", "token_rewards", "advantages", "returns")
SCALED = ("trl", "verl")
"""Makers whose losses-only dumps are also compared with a loss scaled (both searches walk everything)."""


def _variant(src: Path, dst: Path, drop: tuple[str, ...], scale: str | None) -> None:
    t = load_file(str(src))
    t = {k: v for k, v in t.items() if k not in drop}
    if scale is not None:
        t[scale] = t[scale] * 1.05
    save_file(t, str(dst))
    dst.with_name(dst.name + ".json").write_text(src.with_name(src.name + ".json").read_text())


def make_dumps(d: Path, sizes: tuple[tuple[int, int], ...]) -> list[tuple[Path, str]]:
    out: list[tuple[Path, str]] = []
    for maker in MAKERS:
        for B, T in sizes:
            full = d / f"{maker}_{B}x{T}_full.safetensors"
            make_dump(full, B, T, maker)
            if sizes[0] == (B, T):
                out.append((full, maker))
            variants = [("lossesonly", INTERMEDIATES, None)]
            if sizes[0] == (B, T):
                variants.append(("noreturns", ("returns",), None))
            if sizes[0] == (B, T) and maker in SCALED:
                variants += [("lo_vf105", INTERMEDIATES, "vf_loss"), ("lo_pg105", INTERMEDIATES, "pg_loss")]
            for name, drop, scale in variants:
                p = d / f"{maker}_{B}x{T}_{name}.safetensors"
                _variant(full, p, drop, scale)
                out.append((p, maker))
    return out


WORKER = """
import contextlib, io, json, os, sys
sys.path.insert(0, os.getcwd())  # this checkout's refppo, not the installed one
from refppo.cli import main
cases, out = json.load(open(sys.argv[1])), sys.argv[2]
for i, args in enumerate(cases):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        try:
            rc = main(["diff", *args])
        except SystemExit as e:
            rc = e.code
    with open(os.path.join(out, f"{i}.txt"), "w") as f:
        f.write(f"{rc}\\n{buf.getvalue()}")
    print(i, flush=True)
"""


def run_all(cwd: Path, cases: list[list[str]], tmp: Path, tag: str) -> subprocess.Popen[bytes]:
    """One process per checkout runs every case in turn (one torch import, not one per case)."""
    (tmp / tag).mkdir()
    (tmp / "cases.json").write_text(json.dumps(cases))
    (tmp / "worker.py").write_text(WORKER)
    cmd = ["nice", "-n", "5", sys.executable, str(tmp / "worker.py"), str(tmp / "cases.json"), str(tmp / tag)]
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other", type=Path, help="the other checkout (its refppo is run from there)")
    ap.add_argument("--small", action="store_true", help="only the first size")
    ap.add_argument("--both", action="store_true", help="each dump as text and as --json (else alternately)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        torch.manual_seed(0)
        dumps = make_dumps(tmp, SIZES[:1] if a.small else SIZES)
        cases = []
        for i, (path, maker) in enumerate(dumps):  # text under no preset, --json under the maker's
            preset, js = (None, False) if i % 2 == 0 or a.both else (maker, True)
            args = [str(path), "--detect", *(["--preset", preset] if preset else [])]
            cases.append(args + (["--json"] if js else []))
            if a.both:
                cases.append([str(path), "--detect", "--preset", maker, "--json"])
        t0 = time.perf_counter()
        procs = [run_all(REPO, cases, tmp, "this"), run_all(a.other.resolve(), cases, tmp, "other")]
        codes = [p.wait() for p in procs]
        differ = 0
        for i, args in enumerate(cases):
            same = (tmp / "this" / f"{i}.txt").read_bytes() == (tmp / "other" / f"{i}.txt").read_bytes()
            rc = (tmp / "this" / f"{i}.txt").read_text().split("\n", 1)[0]
            differ += not same
            print("same  " if same else "DIFFER", rc, Path(args[0]).name, *args[1:], flush=True)
        print(
            f"{len(cases)} reports compared ({len(dumps)} dumps), {differ} differ; workers {codes}, "
            f"{time.perf_counter() - t0:.0f} s"
        )
        return 1 if differ or any(codes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
