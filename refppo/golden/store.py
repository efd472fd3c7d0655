"""Golden files: ``spec/golden/ppo_<case>.json`` + ``.safetensors`` (schema :data:`SCHEMA_VERSION`).

The format is described in :mod:`refppo.golden` and spec/models.md.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from refppo.cpu_numerics import PINNED_CPU_ENV
from refppo.golden.cases import CPU_REPLAY, CUDA_REPLAY, NAIVE, GoldenCase
from refppo.golden.trajectory import Trajectory

SCHEMA_VERSION = 1


def paths(directory: str | os.PathLike[str], name: str) -> tuple[str, str]:
    """``(json_path, safetensors_path)`` of golden ``name`` in ``directory``."""
    d = os.fspath(directory)
    return os.path.join(d, f"ppo_{name}.json"), os.path.join(d, f"ppo_{name}.safetensors")


def save(traj: Trajectory, case: GoldenCase, directory: str | os.PathLike[str]) -> None:
    """Write the golden files of ``case``."""
    from safetensors.torch import save_file

    jpath, tpath = paths(directory, case.name)
    save_file(traj.tensors, tpath)
    doc = {
        "schema_version": SCHEMA_VERSION,
        "case": case.to_dict(),
        "tolerances": {
            "cpu_replay": CPU_REPLAY.__dict__,
            "naive": NAIVE.__dict__,
            "cuda_replay": CUDA_REPLAY.__dict__,
        },
        "environment": {
            "torch": torch.__version__,
            "transformers": _transformers_version(),
            "num_threads": torch.get_num_threads(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "pinned_env": {k: os.environ.get(k) for k in PINNED_CPU_ENV},
        },
        **traj.record,
    }
    with open(jpath, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1, sort_keys=True)
        fh.write("\n")


def load(directory: str | os.PathLike[str], name: str) -> tuple[Trajectory, dict[str, Any]]:
    """``(trajectory, json document)`` of golden ``name``; checks the schema version."""
    from safetensors.torch import load_file

    jpath, tpath = paths(directory, name)
    with open(jpath, encoding="utf-8") as fh:
        doc: dict[str, Any] = json.load(fh)
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{jpath}: schema_version {doc.get('schema_version')!r} != {SCHEMA_VERSION}")
    record = {"init_checksums": doc["init_checksums"], "iterations": doc["iterations"]}
    return Trajectory(load_file(tpath), record), doc


def _transformers_version() -> str:
    import transformers

    v: str = transformers.__version__
    return v
