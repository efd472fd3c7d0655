"""``refppo verify`` covers every public vectorized function of refppo/core, and each case can fail.

The public vectorized functions are enumerated from the modules themselves (every function a
non-private ``refppo.core`` module defines, minus the naive twins ``*_naive`` and the modules that
hold only twins), so a function added to the core without a verify case fails
:func:`test_every_public_vectorized_core_function_has_a_verify_case`. Which case covers which
function is observed, not declared: each function is wrapped in a recorder that notes the calls
coming straight from ``refppo.verify`` code, and every case is run once.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import pkgutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor

import refppo.core
from refppo.verify.batches import make_batch
from refppo.verify.cases import CASES
from refppo.verify.cli import run_step

EXCEPTIONS: dict[str, str] = {
    "refppo.core.kl.check_kl_clamps": "argument validator: returns None or raises, no numeric output "
    "to compare (its messages are unit-tested with token_kl)",
    "refppo.core.score_map.check_score_map": "argument validator: returns None or raises, no numeric "
    "output to compare (its messages are unit-tested with map_scores)",
    "refppo.core.policy.check_policy_clips": "argument validator: returns None or raises",
    "refppo.core.value.check_value_clip": "argument validator: returns None or raises",
    "refppo.core.kl.check_grad_is": "argument validator: returns None or the checked old log-probs "
    "(its messages are unit-tested in tests/core/test_kl_is_weight.py)",
    "refppo.core.moments_memo.memoized": "a memo, not a step: its value is the memoized function's own "
    "(tests/core/test_core_moments_memo.py, tests/core/test_moments_memo_bounds.py)",
    "refppo.core.moments_memo.remembered_moments": "the memo's context manager: no value of its own",
}
"""Public core functions deliberately without a verify case, with the reason."""

NOT_YET_COVERED: dict[str, str] = {}
"""Known gaps (NOT deliberate): public core functions that still lack a verify case. The test fails
if one gains a case without being removed here, or if a new uncovered function appears."""


def _core_modules() -> list[str]:
    names = []
    for info in pkgutil.iter_modules(refppo.core.__path__):
        if info.name.startswith("_") or info.name.endswith("_naive") or info.name == "checks":
            continue  # private helpers (_pyfloat, _ties), twin-only modules and the input checks
        names.append(f"refppo.core.{info.name}")
    return sorted(names)


def public_vectorized() -> list[str]:
    """``module.function`` of every public function defined in a core module, twins excluded."""
    out = []
    for mod_name in _core_modules():
        mod = importlib.import_module(mod_name)
        for name, obj in vars(mod).items():
            if (
                inspect.isfunction(obj)
                and obj.__module__ == mod_name
                and not name.startswith("_")
                and not name.endswith("_naive")
            ):
                out.append(f"{mod_name}.{name}")
    return sorted(out)


TARGETS = [f for f in public_vectorized() if f not in EXCEPTIONS and f not in NOT_YET_COVERED]


def _split(qualname: str) -> tuple[Any, str]:
    mod_name, _, fn = qualname.rpartition(".")
    return importlib.import_module(mod_name), fn


@contextmanager
def _patched(qualname: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Replace ``qualname`` on its module by ``make(original)`` for the block (restored after)."""
    mod, fn = _split(qualname)
    original = getattr(mod, fn)
    setattr(mod, fn, make(original))
    try:
        yield
    finally:
        setattr(mod, fn, original)


@functools.cache
def calls_by_case() -> dict[str, frozenset[str]]:
    """Case -> the public core functions it calls directly (from ``refppo.verify`` code)."""
    seen: dict[str, set[str]] = {}
    current = [""]

    def recorder(qualname: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                caller = sys._getframe(1).f_globals.get("__name__", "")
                if caller.startswith("refppo.verify"):
                    seen.setdefault(current[0], set()).add(qualname)
                return fn(*args, **kwargs)

            return wrapped

        return make

    patches = [_patched(q, recorder(q)) for q in public_vectorized()]
    for p in patches:
        p.__enter__()
    try:
        for case_name, case in CASES.items():
            current[0] = case_name
            case(make_batch(0, torch.float64), torch.device("cpu"))
    finally:
        for p in reversed(patches):
            p.__exit__(None, None, None)
    return {name: frozenset(seen.get(name, set())) for name in CASES}


def test_the_enumeration_finds_the_known_steps() -> None:
    found = set(public_vectorized())
    for q in ("refppo.core.gae.gae", "refppo.core.group.group_advantages", "refppo.core.score_map.map_scores",
              "refppo.core.policy.policy_ratio", "refppo.core.rewards.score_positions"):  # fmt: skip
        assert q in found
    assert not any(q.endswith("_naive") for q in found)


def test_every_public_vectorized_core_function_has_a_verify_case() -> None:
    covered = set().union(*calls_by_case().values())
    missing = [q for q in TARGETS if q not in covered]
    assert not missing, f"public vectorized core functions without a `refppo verify` case: {missing}"


def test_the_exceptions_are_real_and_uncovered() -> None:
    covered = set().union(*calls_by_case().values())
    for q in (*EXCEPTIONS, *NOT_YET_COVERED):
        mod, fn = _split(q)
        assert inspect.isfunction(getattr(mod, fn, None)), f"stale exception {q}"
        assert q not in covered, f"{q} has a case now: drop it from EXCEPTIONS / NOT_YET_COVERED"


def test_every_case_calls_a_core_function() -> None:
    empty = [name for name, calls in calls_by_case().items() if not calls]
    assert not empty, f"cases that call no public core function: {empty}"


def _perturb(x: Any) -> Any:
    """A wrong but well-formed result: floats moved by 1e-3·(1+|x|), ints +1, bools negated, a slice
    one row short at its start (each item of an iterator)."""
    if isinstance(x, Tensor):
        if x.dtype == torch.bool:
            return ~x
        if not x.dtype.is_floating_point:
            return x + 1
        return torch.where(torch.isfinite(x), x + 1e-3 * (1 + x.abs()), x)
    if isinstance(x, bool):
        return not x
    if x is None:  # an absent optional field (PolicyTerms.lower_active without dual-clip) stays absent
        return None
    if isinstance(x, slice):  # a block that loses its first row
        return slice(x.start + 1, x.stop, x.step)
    if isinstance(x, Iterator):
        return iter([_perturb(v) for v in x])
    if isinstance(x, tuple):
        return tuple(_perturb(v) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _perturb(getattr(x, f.name)) for f in dataclasses.fields(x)})
    raise TypeError(f"cannot perturb a {type(x).__name__}")


def _broken(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrong(*args: Any, **kwargs: Any) -> Any:
        return _perturb(fn(*args, **kwargs))

    return wrong


@pytest.mark.parametrize("qualname", TARGETS)
def test_each_case_fails_on_a_broken_function(qualname: str) -> None:
    """Every case that calls ``qualname`` reports FAIL (not a crash) once ``qualname`` is perturbed."""
    cases = [name for name, calls in calls_by_case().items() if qualname in calls]
    assert cases, f"{qualname} has no verify case"
    with _patched(qualname, _broken):
        for case in cases:
            for dtype in (torch.float64, torch.float32):
                row = run_step(case, torch.device("cpu"), dtype, [0, 1, 2])
                assert not row.ok, f"case {case} ({dtype}) did not notice a broken {qualname}"
                assert math.isfinite(row.max_abs), f"case {case} crashed instead of comparing: {row.worst}"
    for case in cases:  # restored: the same rows pass again
        assert run_step(case, torch.device("cpu"), torch.float64, [0, 1, 2]).ok
