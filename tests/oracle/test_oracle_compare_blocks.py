"""``compare`` by row blocks (issue #9, memory): the same result as the one-pass definition, and no
full-size temporary.

The expected values are computed here from the definition in refppo/oracle/check/compare.py's docstring
(``max |dump − ref|`` and ``max |ref|`` over the compared positions, padded positions beyond the
tolerance counted), in one pass over the whole tensors, not by the code under test.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import test_oracle_bugs  # the hand-worked diagnosis scenarios
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import refppo.oracle.check.compare as cmp_mod
from refppo.dump.tolerances import TOLERANCES
from refppo.oracle.check.compare import compare

pytestmark = pytest.mark.property


def _one_pass(
    dump: torch.Tensor, ref: torch.Tensor, cm: torch.Tensor, dtype: torch.dtype
) -> tuple[float, float, int]:
    """``(max_abs, scale, padding_diff)`` over the whole tensors at once (NaN propagates)."""
    r_in = ref.double()[cm]
    scale = math.nan if bool(r_in.isnan().any()) else (float(r_in.abs().max()) if r_in.numel() else 0.0)
    err = (dump - ref).abs()  # in the compute dtype, as the oracle computes it
    e_in = err[cm]
    max_abs = math.nan if bool(e_in.isnan().any()) else (float(e_in.max()) if e_in.numel() else 0.0)
    tol = TOLERANCES[dtype].of(scale)
    e_out = err[~cm]
    pad = int(((e_out > tol) | e_out.isnan()).sum())
    return max_abs, scale, pad


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 9),
    T=st.integers(1, 13),
    block=st.sampled_from([1, 5, 16, 1 << 20]),
    nan=st.sampled_from(["none", "dump_in", "dump_out", "ref_in"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_blocked_compare_equals_the_one_pass_definition(
    seed: int, B: int, T: int, block: int, nan: str, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype)
    dump = (
        ref
        + (torch.rand(B, T, generator=g, dtype=torch.float64) < 0.3).to(dtype)
        * torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype)
        * 1e-3
    )
    cm = torch.rand(B, T, generator=g) < 0.6
    pos = (int(torch.randint(B, (1,), generator=g)), int(torch.randint(T, (1,), generator=g)))
    if nan != "none":
        cm[pos] = nan != "dump_out"
        (ref if nan == "ref_in" else dump)[pos] = math.nan
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cmp_mod, "_CHUNK_ELEMENTS", block)
        res = compare("x", dump, ref, cm, TOLERANCES[dtype])
    max_abs, scale, pad = _one_pass(dump, ref, cm, dtype)
    assert res.padding_diff == pad
    assert res.tol == TOLERANCES[dtype].of(scale)
    if math.isnan(max_abs):
        assert res.max_abs_err == math.inf and not res.ok
    else:
        assert res.max_abs_err == max_abs
        assert res.ok == (max_abs <= TOLERANCES[dtype].of(scale))


class _Largest(TorchDispatchMode):
    """The largest tensor any torch op returns while active (in elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_compare_allocates_no_full_size_temporary(monkeypatch: pytest.MonkeyPatch) -> None:
    """A [B, T] comparison works in row blocks: no op result has B·T elements (the one-pass code
    made |dump − ref| and two bool masks of the full size; at B=1024, T=8192 each float32 one is
    33.5 MB). Blocks of 64 elements over a [32, 16] tensor: at most 4 rows at a time."""
    monkeypatch.setattr(cmp_mod, "_CHUNK_ELEMENTS", 64)
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(32, 16, generator=g)
    dump = ref.clone()
    dump[3, 4] += 1.0
    dump[7, 15] += 1.0  # outside the mask below: padding
    cm = torch.ones(32, 16, dtype=torch.bool)
    cm[7, 8:] = False
    with _Largest() as seen:
        res = compare("x", dump, ref, cm, TOLERANCES[torch.float32])
    assert (res.max_abs_err, res.padding_diff, res.ok) == (pytest.approx(1.0), 1, False)
    assert seen.largest <= 64


@pytest.mark.parametrize(
    "scenario",
    [
        "test_gae_bootstrap_error_peaks_at_the_end",
        "test_sign_flip_and_offset_are_described",
        "test_padding_only_difference_is_a_note_not_a_failure",
    ],
)
@pytest.mark.parametrize("block", [1, 24, 40])
def test_describe_by_row_blocks_keeps_the_hand_worked_diagnoses(
    scenario: str, block: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The diagnosis scenarios of tests/oracle/test_oracle_bugs.py (expected notes worked out there by
    hand: the error peaking at the end of GAE rows, a sign flip, an offset by one, padding-only
    differences), run with blocks of one, two and three rows (their dumps are [6, 12])."""
    monkeypatch.setattr(cmp_mod, "_CHUNK_ELEMENTS", block)
    getattr(test_oracle_bugs, scenario)(tmp_path)
