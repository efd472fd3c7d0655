"""Tests for survivors of ``tools/mutate.py`` that were not equivalent (issue #9, refresh run).

Each test pins one documented behaviour that a surviving mutant changed; the expected values are
worked out in the comments, not taken from the code under test.
"""

from __future__ import annotations

import torch

from refppo.core.gae import envelope


def test_envelope_accepts_a_row_without_a_valid_token() -> None:
    """``envelope`` is documented for any bool mask (``check_mask(require_nonempty_rows=False)``):
    a row with no valid token has no position up to a last valid one, so its envelope is all False.
    Survivors: ``require_nonempty_rows=False`` flipped to True or dropped (then it raised)."""
    m = torch.tensor([[True, False, True, False], [False, False, False, False], [True, True, False, False]])
    want = torch.tensor([[True, True, True, False], [False, False, False, False], [True, True, False, False]])
    assert torch.equal(envelope(m), want)
