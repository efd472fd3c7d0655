"""The peer's half of the two-interpreter protocol (run by a side venv's python; no refppo import).

``VENV/bin/python tools/peers --peer-side OUT`` reads ``OUT/request.json``::

    {"kind": "files" | "batch",
     "setup": "module:function" | null,          # run once first (import stand-ins, env)
     "units": {UNIT: [DISTRIBUTION, "module:function"], ...},
     "options": {...}}                            # keyword arguments of every unit's function

and runs each unit's function, catching what it raises:

- ``files``: ``function(OUT, **options)`` writes its files under ``OUT`` (dumps, sidecars) and
  returns what it made (JSON: the case names, or the records of ``peers.makers.adapters``);
- ``batch``: ``function(batch, **options)`` gets the tensors of ``OUT/batch.pt``
  (``torch.load(weights_only=True)``) and returns ``{key: tensor}``, saved to
  ``OUT/result-UNIT.pt``.

``OUT/status.json`` (written last, atomically) is ``{UNIT: {"version": V, "result": R}}`` or
``{UNIT: {"error": WHY, "tb": [last traceback lines]}}``. The exit status is 0 whenever the status
file was written: a unit that raised is reported there, and refppo's side counts it as FAILED.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def resolve(target: str) -> Callable[..., Any]:
    """``"package.module:function"`` → the function."""
    module, _, name = target.partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn


def _run_unit(out: Path, unit: str, target: str, kind: str, options: dict[str, Any]) -> Any:
    fn = resolve(target)
    if kind == "files":
        return fn(out, **options)
    import torch

    batch = torch.load(out / "batch.pt", weights_only=True)
    res = fn(batch, **options)
    torch.save({k: torch.as_tensor(v).detach() for k, v in res.items()}, out / f"result-{unit}.pt")
    return sorted(res)


def main(out: Path) -> int:
    """Run the request in ``out``; write ``out/status.json``."""
    req = json.loads((out / "request.json").read_text())
    if req.get("setup"):
        resolve(req["setup"])()
    status: dict[str, Any] = {}
    for unit, (dist, target) in req["units"].items():
        try:
            version = importlib.metadata.version(dist)
            result = _run_unit(out, unit, target, req["kind"], req.get("options", {}))
            status[unit] = {"version": version, "result": result}
        except Exception as exc:  # the unit could not run: say why, then go on with the others
            why = " ".join(str(exc).split())[:400]
            tb = traceback.format_exc().strip().splitlines()[-6:]
            status[unit] = {"error": f"{type(exc).__name__}: {why}", "tb": tb}
    tmp = out / "status.json.tmp"
    tmp.write_text(json.dumps(status, indent=2))
    os.replace(tmp, out / "status.json")
    return 0
