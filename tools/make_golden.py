"""Write the golden PPO trajectories under spec/golden/ (see refppo/golden.py and spec/models.md).

Usage: ``python tools/make_golden.py [--out spec/golden] [--case gpt2 --case llama] [--check]``

Deterministic: one CPU thread (``torch.set_num_threads(1)``), ``torch.use_deterministic_algorithms``,
seeded models and a seeded ``torch.Generator`` for sampling and minibatch shuffling. ``--check``
regenerates in memory and compares with the files on disk instead of writing.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from refppo import golden


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join("spec", "golden"))
    ap.add_argument("--case", action="append", choices=sorted(golden.CASES), default=None)
    ap.add_argument("--check", action="store_true", help="compare with the files instead of writing")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    status = 0
    for name in args.case or sorted(golden.CASES):
        case = golden.CASES[name]
        traj = golden.run(case)
        if args.check:
            old, _ = golden.load(args.out, name)
            bad = golden.compare(old, traj, golden.CPU_REPLAY)
            print(f"{name}: {'OK' if not bad else f'{len(bad)} mismatches'}")
            for line in bad[:20]:
                print("  " + line)
            status |= int(bool(bad))
            continue
        os.makedirs(args.out, exist_ok=True)
        golden.save(traj, case, args.out)
        lengths = [traj.tensors[f"it{i}.response_mask"].sum(1).tolist() for i in range(case.iterations)]
        clip = [it["metrics"]["pg_clipfrac"] for it in traj.record["iterations"]]
        print(f"{name}: wrote {golden.paths(args.out, name)}; response lengths {lengths}; pg_clipfrac {clip}")
    return status


if __name__ == "__main__":
    sys.exit(main())
