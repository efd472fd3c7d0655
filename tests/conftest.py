"""Test-suite wide configuration: Hypothesis profiles and the ``gpu`` marker.

Hypothesis profiles, selected by the environment variable ``HYPOTHESIS_PROFILE`` (default ``ci``):

=========== ============ =============================================================
profile     max_examples  purpose
=========== ============ =============================================================
``ci``      40           default; derandomized (same examples on every run), no example
                          database, no deadline: the whole property suite runs in well
                          under 2 minutes on 2 shared cores
``dev``     100          local work: random seeds, example database kept
``thorough`` 1000        before a release / after touching refppo/core: 1000 examples
=========== ============ =============================================================

Before torch runs anything, :func:`refppo.cpu_numerics.pin` selects torch's and MKL's AVX2 kernels
(the golden trajectories replay bitwise on any AVX2 CPU; environment inherited by subprocesses), and
``OMP_NUM_THREADS=1`` (unless set) gives the test process and its subprocesses one intra-op thread.

Tests marked ``@pytest.mark.gpu`` (marker declared in pyproject.toml) are skipped cleanly when
``torch.cuda.is_available()`` is False.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from refppo import cpu_numerics

# Every test folder on sys.path: shared helpers (tests/helpers/) and the few test modules that others
# import by name (e.g. train/test_ddp.py's spawn and teardown helpers) resolve wherever they sit.
_TESTS = Path(__file__).resolve().parent
for _d in sorted({p.parent for p in _TESTS.rglob("*.py")}, key=str):
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

# Before torch runs any kernel: the AVX2 code paths of torch and MKL on every x86 CPU, so the golden
# trajectories replay bitwise across machines (refppo/cpu_numerics.py says why).
cpu_numerics.pin()

# One intra-op thread for the test process and (inherited) every process it starts: torchrun workers,
# the peer validators and the side venvs' makers. The models and batches here are tiny; on a shared
# 2-core CI machine extra OpenMP threads only spin against each other. A value already set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# deadline=None: shared, loaded CI machines; timing is not what these tests check.
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci",
    max_examples=40,
    derandomize=True,
    database=None,
    print_blob=True,
    deadline=None,
    suppress_health_check=_SUPPRESS,
)
settings.register_profile(
    "dev", max_examples=100, print_blob=True, deadline=None, suppress_health_check=_SUPPRESS
)
settings.register_profile(
    "thorough", max_examples=1000, print_blob=True, deadline=None, suppress_health_check=_SUPPRESS
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests when no CUDA device is available."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
