#!/usr/bin/env python3
"""The re-scoring check on a device: ``refppo diff --actor ... --device DEV`` (tools/gpu_check.sh).

Builds tiny GPT-2 and Llama checkpoints (from configs, ``save_pretrained`` in a temporary folder),
scores the rows of ``tests/helpers/rescore_helpers.py`` with a trainer's pass ON THE DEVICE — float32
correct, float32 without the temperature, bfloat16 correct — and runs ``refppo diff --device DEV
--json`` on each dump. Prints, per architecture: the float32 re-score's max abs error and
tolerance, the name given to the injected bug, and the precision statistics of the bf16 pass.

Exit 0 when every float32 correct pass matches and every injected bug is named; 1 otherwise; 0 with
``SKIPPED`` when the device is ``cuda`` and none is available. ``--device cpu`` runs the same on the
CPU (tests/oracle/rescore/test_rescore_cli.py runs it that way, so the script cannot rot without a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _diff(dump: Path, actor: Path, device: str) -> tuple[int, dict[str, Any]]:
    from refppo.oracle.cli import main as diff_main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = diff_main([str(dump), "--actor", str(actor), "--device", device, "--json"])
    (item,) = json.loads(buf.getvalue())["rescore"]["items"]
    return rc, item


def check(arch: Any, tmp: Path, device: str) -> bool:
    import torch
    from rescore_helpers import (  # type: ignore[import-not-found]  # tests/helpers, put on sys.path by main()
        make_rows,
        save_actor,
        trainer_logprobs,
        write_rows,
    )

    rows = make_rows()
    actor = save_actor(tmp, arch, name=f"actor_{arch}")
    ok = True
    cases = (("fp32", None, torch.float32), ("no_temperature", "no_temperature", torch.float32))
    for name, bug, dtype in (*cases, ("bf16", None, torch.bfloat16)):
        lp = trainer_logprobs(actor, rows, bug, dtype=dtype, device=device)
        dump = write_rows(tmp, rows, name=f"{arch}_{name}.safetensors", old_logprobs=lp)
        rc, item = _diff(dump, actor, device)
        named = [e["name"] for e in item["explained_by"]]
        if name == "fp32":
            good = rc == 0 and item["ok"]
            err, tol = item["max_abs_err"], item["tol"]
            print(f"{arch:<6} fp32 correct pass: exit {rc}, max abs err {err:.3e} (tol {tol:.2e})")
        elif name == "no_temperature":
            good = rc == 1 and named == ["temperature_not_applied"]
            print(f"{arch:<6} no temperature: exit {rc}, named {named}")
        else:
            good = True  # statistics, not a verdict
            for what, s in item["precision"].items():
                print(
                    f"{arch:<6} bf16 pass, {what}: max|Δ|={s['max_abs']:.3e} mean|Δ|={s['mean_abs']:.3e} "
                    f"share outside [1±{s['eps']}]={s['share_outside']:.3f}"
                )
        ok = ok and good
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("SKIPPED: no CUDA device")
        return 0
    sys.path[:0] = [str(REPO), str(REPO / "tests" / "helpers")]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("gpt2", "llama"):
            ok = check(arch, Path(tmp), args.device) and ok
    print(f"rescore check on {args.device}: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
