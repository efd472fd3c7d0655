"""Pin the CPU kernels that decide rounding, so golden trajectories replay bitwise on any x86 CPU.

torch picks its vectorized kernels (``exp``, ``tanh``, softmax, reductions …) by the CPU's
instruction set (AVX2 or AVX-512), and MKL picks its GEMM code path the same way; each choice
rounds differently. One PPO iteration with Adam turns those last-bit differences into ~5e-5 on
whitened advantages (measured 2026-11-30: golden gpt2 generated on one Xeon, replayed on an
AVX-512/AMX Xeon: it1.advantages 3.1e-5, it1.old_values 1.3e-5 over a 1e-5 tolerance). Pinning
both to their AVX2 paths makes the arithmetic the same on every x86-64 CPU with AVX2:

- ``ATEN_CPU_CAPABILITY=avx2``: torch's kernel dispatch (read once, at the first dispatched op);
- ``MKL_CBWR=AVX2``: MKL's Conditional Numerical Reproducibility mode (read when MKL initialises).

The pin makes the arithmetic the same only where MKL honours ``MKL_CBWR`` the same way: MKL's
conditional reproducibility is stated for Intel processors, and on an AMD EPYC (2026-12-01) the
pinned run of an older release's fixture differed from the one written elsewhere in the 9th digit
(``tests/train/test_resume_old_release.py``). :func:`kernel_path` names what decides the kernels,
so a fixture can record where it was written and a test be exact only where that is the same.

This module imports nothing heavy at import time: call :func:`pin` before the first tensor
operation of the process (``tests/conftest.py`` and ``tools/make_golden.py`` do, before importing
torch).
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


def _cpuinfo(field: str) -> str:
    """The first ``field`` line of ``/proc/cpuinfo`` (Linux), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == field:
                    return value.strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def kernel_path() -> dict[str, str]:
    """What decides the CPU kernels, hence the rounding, of a torch computation in this process:
    the CPU (vendor, model), the kernel set torch dispatches, the pinned environment, and the
    versions of torch, MKL and oneDNN. Two runs with equal ``kernel_path()`` (and one thread, the
    same inputs and code) run the same instructions: their results are bit-identical."""
    import re

    import torch

    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version (\S+)", config)
    onednn = re.search(r"MKL-DNN v([\d.]+)", config)
    return {
        "cpu_vendor": _cpuinfo("vendor_id"),
        "cpu_model": _cpuinfo("model name"),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        **{key: os.environ.get(key, "") for key in PINNED_CPU_ENV},
        "torch": str(torch.__version__),
        "mkl": mkl.group(1) if mkl else "none",
        "onednn": onednn.group(1) if onednn else "none",
    }


__all__ = ["PINNED_CPU_ENV", "kernel_path", "pin", "pinned_problem"]
