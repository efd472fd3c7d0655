#!/usr/bin/env python3
"""The scale case of ``tests/oracle/detect/test_oracle_detect_stream.py``: ``--detect`` on a losses-only
dump (no ``kl``, ``token_rewards``, ``advantages``, ``returns``) with the value-loss pruning OFF, so
thousands of rollout candidates reach the policy stage (run by hand; not a test).

Each walk runs in its own process; prints its wall-clock, peak RSS (``ru_maxrss``), the number of
groups at the policy stage and the detection's digest, and whether the walks' detections are
identical:

* ``stream``: refppo's walk (:mod:`refppo.oracle.detect.groups`: states replayed, not held);
* ``hold-all`` (``--hold-all``): the walk that held every option's state and scored after merging
  (the test's ``_walk_holding_all``, the ``Search.expand`` of 932018a). Measured at 12.2 GB peak
  and 105 s on the test's B=8, T=16 dump, which is why the unit test compares the two walks on the
  pruned search only (both log their walks for the pruning) and this unpruned comparison lives here.

    .venv/bin/python benchmarks/bench_detect_stream.py              # the streaming walk alone
    .venv/bin/python benchmarks/bench_detect_stream.py --hold-all   # both (needs ~13 GB free)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests" / "unit"


def _child(walk: str) -> None:
    """One detection under ``walk``; prints one JSON line."""
    sys.path[:0] = [str(REPO), str(TESTS)]
    import test_oracle_detect_stream as stream  # the dump maker and the restated hold-all walk
    from oracle_helpers import setup_for

    import refppo.oracle.detect.detection as detect_mod
    import refppo.oracle.detect.policy as search_policy
    from refppo.oracle.detect.search import Search

    detect_mod.value_prune_for = lambda _s: None  # type: ignore[assignment]  # the unpruned search
    if walk == "hold-all":
        Search.expand = stream._walk_holding_all  # type: ignore[method-assign]  # the old walk
    seen: list[int] = []
    real = search_policy.policy_stage

    def spy(search, groups):  # type: ignore[no-untyped-def]
        seen.append(len(groups))
        return real(search, groups)

    search_policy.policy_stage = spy  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        dump = stream._dump(Path(tmp), setup_for("trl"), losses_only=True)
        t0 = time.perf_counter()
        found = detect_mod.detect(dump, setup_for("verl"))
        dt = time.perf_counter() - t0
    digest = hashlib.sha1(stream._fields(found).encode()).hexdigest()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"walk": walk, "s": dt, "peak_mb": peak, "policy_groups": seen, "digest": digest}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hold-all", action="store_true", help="also run the walk that holds every state")
    ap.add_argument("--child", choices=["stream", "hold-all"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child)
        return 0
    rows = []
    for walk in ["stream", *(["hold-all"] if args.hold_all else [])]:
        out = subprocess.run(
            [sys.executable, __file__, "--child", walk], capture_output=True, text=True, check=True
        )
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{walk:<9} {row['s']:7.1f} s  peak RSS {row['peak_mb']:8.0f} MB  "
            f"groups at the policy stage {row['policy_groups']}  detection {row['digest'][:12]}"
        )
    if len(rows) == 2:
        same = rows[0]["digest"] == rows[1]["digest"]
        print(f"identical detections: {same}")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
