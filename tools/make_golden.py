"""Write the golden PPO trajectories under spec/golden/ (see refppo/golden/ and spec/models.md).

Usage: ``python tools/make_golden.py [--out spec/golden] [--case gpt2 --case llama] [--check]``
(cases: :data:`refppo.golden.cases.CASES`; ``seam_gpt2`` is sampled by the trainer's seam-mode engine)
(``--check --device cuda`` replays on a GPU).

Deterministic: torch's and MKL's AVX2 kernels on any x86 CPU (``refppo.cpu_numerics``), one CPU
thread (``torch.set_num_threads(1)``), ``torch.use_deterministic_algorithms``,
seeded models and a seeded ``torch.Generator`` for sampling and minibatch shuffling. ``--check``
regenerates in memory and compares with the files on disk instead of writing; with
``--device cuda`` it replays on the GPU, compares with the CUDA tolerances and prints the largest
deviation of each quantity from the CPU golden (for CHANGELOG.md); a case whose seam engine is not
float32 is printed but not gated (its bfloat16 rounding differs per device; no tolerance yet).
"""

from __future__ import annotations

import argparse
import os
import sys

from refppo import cpu_numerics

cpu_numerics.pin()  # before torch runs any kernel (refppo/cpu_numerics.py)

import torch  # noqa: E402

from refppo.golden.cases import CASES, CPU_REPLAY, CUDA_REPLAY  # noqa: E402
from refppo.golden.check import compare, max_deviations  # noqa: E402
from refppo.golden.store import load, paths, save  # noqa: E402
from refppo.golden.trajectory import run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join("spec", "golden"))
    ap.add_argument("--case", action="append", choices=sorted(CASES), default=None)
    ap.add_argument("--check", action="store_true", help="compare with the files instead of writing")
    ap.add_argument("--device", default="cpu", help="with --check: replay on this device (cpu, cuda)")
    args = ap.parse_args(argv)
    if args.device != "cpu" and not args.check:
        ap.error("--device is only for --check: goldens are always written from the CPU")
    problem = cpu_numerics.pinned_problem()
    if problem is not None:
        print(f"make_golden: CPU kernels not pinned: {problem}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    if args.device == "cpu":
        # (on CUDA this would also need CUBLAS_WORKSPACE_CONFIG; the CUDA replay has looser tolerances)
        torch.use_deterministic_algorithms(True)
    status = 0
    for name in args.case or sorted(CASES):
        case = CASES[name]
        traj = run(case, device=args.device)
        if args.check:
            old, _ = load(args.out, name)
            tol = CPU_REPLAY if args.device == "cpu" else CUDA_REPLAY
            bad = compare(old, traj, tol)
            print(f"{name} on {args.device}: {'OK' if not bad else f'{len(bad)} mismatches'}")
            if args.device != "cpu":
                for key, dev in sorted(max_deviations(old, traj).items()):
                    print(f"  max deviation {key}: {dev:.3g}")
            for line in bad[:20]:
                print("  " + line)
            if args.device != "cpu" and case.seam is not None and case.seam.dtype != "float32":
                print(f"  {name}: not gated (bfloat16 engine: no {args.device} tolerance measured yet)")
                continue
            status |= int(bool(bad))
            continue
        os.makedirs(args.out, exist_ok=True)
        save(traj, case, args.out)
        lengths = [traj.tensors[f"it{i}.response_mask"].sum(1).tolist() for i in range(case.iterations)]
        clip = [it["metrics"]["pg_clipfrac"] for it in traj.record["iterations"]]
        print(f"{name}: wrote {paths(args.out, name)}; response lengths {lengths}; pg_clipfrac {clip}")
    return status


if __name__ == "__main__":
    sys.exit(main())
