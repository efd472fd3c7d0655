"""``refppo diff --detect`` of this checkout against another one, byte for byte, on many small dumps.

Run by hand (not a test): ``python benchmarks/compare_detect.py OTHER_CHECKOUT [--jobs N]``. Makes
dumps with :func:`bench_oracle.make_dump` for every preset's maker at a few small sizes, full and
losses-only (no ``kl``, ``token_rewards``, ``advantages``, ``returns``), plus variants: only
``returns`` dropped, and losses-only with one loss scaled by 1.05 (nothing reproduces it, so the
search's nearest-group paths run). Each dump is diffed with ``--detect`` under no preset (as text and as
``--json``) and under its maker's preset (text), by both checkouts (``python -m refppo`` run in each), and
stdout and exit code are compared. Prints one line per case and the count that differ; exit 1 if any.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_oracle import make_dump  # noqa: E402

MAKERS = ("refppo", "verl", "openrlhf", "trl", "deepspeed-chat", "skyrl", "areal")
SIZES = ((8, 16), (12, 32))
INTERMEDIATES = ("kl", "token_rewards", "advantages", "returns")


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
            out.append((full, maker))
            for name, drop, scale in (
                ("lossesonly", INTERMEDIATES, None),
                ("noreturns", ("returns",), None),
                ("lo_vf105", INTERMEDIATES, "vf_loss"),
                ("lo_pg105", INTERMEDIATES, "pg_loss"),
            ):
                p = d / f"{maker}_{B}x{T}_{name}.safetensors"
                _variant(full, p, drop, scale)
                out.append((p, maker))
    return out


def run(cwd: Path, args: list[str]) -> tuple[int, bytes, float]:
    t0 = time.process_time()
    p = subprocess.run(
        ["nice", "-n", "5", sys.executable, "-m", "refppo", "diff", *args], cwd=cwd, capture_output=True
    )
    return p.returncode, p.stdout, time.process_time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other", type=Path, help="the other checkout (its refppo is run from there)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="only the first size")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        dumps = make_dumps(Path(tmp), SIZES[:1] if a.small else SIZES)
        cases = []
        for path, maker in dumps:
            for preset, js in ((None, False), (None, True), (maker, False)):
                args = [str(path), "--detect", *(["--preset", preset] if preset else [])]
                cases.append(args + (["--json"] if js else []))

        def one(args: list[str]) -> tuple[list[str], bool, int, int]:
            rc_a, out_a, _ = run(REPO, args)
            rc_b, out_b, _ = run(a.other.resolve(), args)
            return args, (rc_a, out_a) == (rc_b, out_b), rc_a, rc_b

        differ = 0
        with ThreadPoolExecutor(a.jobs) as ex:
            for args, same, rc_a, rc_b in ex.map(one, cases):
                differ += not same
                print(("same  " if same else "DIFFER"), rc_a, rc_b, Path(args[0]).name, *args[1:], flush=True)
        print(f"{len(cases)} reports compared, {differ} differ")
        return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
