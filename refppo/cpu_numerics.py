"""Pin the CPU kernels that decide rounding, so golden trajectories replay bitwise on any x86 CPU.

torch picks its vectorized kernels (``exp``, ``tanh``, softmax, reductions …) by the CPU's
instruction set (AVX2 or AVX-512), and MKL picks its GEMM code path the same way; each choice
rounds differently. One PPO iteration with Adam turns those last-bit differences into ~5e-5 on
whitened advantages (measured 2026-11-30: golden gpt2 generated on one Xeon, replayed on an
AVX-512/AMX Xeon: it1.advantages 3.1e-5, it1.old_values 1.3e-5 over a 1e-5 tolerance). Pinning
both to their AVX2 paths makes the arithmetic the same on every x86-64 CPU with AVX2:

- ``ATEN_CPU_CAPABILITY=avx2``: torch's kernel dispatch (read once, at the first dispatched op);
- ``MKL_CBWR=AVX2``: MKL's Conditional Numerical Reproducibility mode (read when MKL initialises).

This module imports nothing heavy: call :func:`pin` before the first tensor operation of the
process (``tests/conftest.py`` and ``tools/make_golden.py`` do, before importing torch).
"""

from __future__ import annotations

import os

PINNED_CPU_ENV: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}
"""The environment under which the golden trajectories are written and replayed."""


def pin() -> None:
    """Set :data:`PINNED_CPU_ENV` in ``os.environ`` (inherited by subprocesses too).

    A value the user already set is kept; :func:`pinned_problem` then reports it."""
    for key, value in PINNED_CPU_ENV.items():
        os.environ.setdefault(key, value)


def pinned_problem() -> str | None:
    """``None`` if this process runs the pinned kernels, else one line saying what differs."""
    import torch

    for key, value in PINNED_CPU_ENV.items():
        if os.environ.get(key) != value:
            return f"{key}={os.environ.get(key)!r}, expected {value!r} (see refppo/cpu_numerics.py)"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        return (
            f"torch dispatches {capability} kernels although ATEN_CPU_CAPABILITY=avx2: a tensor "
            "operation ran before refppo.cpu_numerics.pin() (call it before importing torch)"
        )
    return None


__all__ = ["PINNED_CPU_ENV", "pin", "pinned_problem"]
