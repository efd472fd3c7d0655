"""The truncated-row keys of the dump (issue #23 item 5): ``bootstrap_values`` [B] float and
``truncated`` [B] bool or 0/1, validated by the loader in one line each, read under
``gae_bootstrap=truncated`` only (spec/dump-format.md, "Truncated rows")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle_helpers import make_inputs, naive_dump, save, setup_for

from refppo.dump.load import load_dump
from refppo.errors import DumpError
from refppo.oracle.run import check_step


def _write(tmp_path: Path, **extra: torch.Tensor) -> Path:
    x = make_inputs(B=4, T=6, seed=2)
    s = setup_for(None, {})
    return save(tmp_path, {**naive_dump(x, s), **extra}, s)


def test_bad_shapes_and_values_are_one_line(tmp_path: Path) -> None:
    cases = {
        "bootstrap_values: expected shape \\[B\\] = \\[4\\]": {
            "bootstrap_values": torch.zeros(4, 6, dtype=torch.float64)
        },
        "bootstrap_values: non-finite": {"bootstrap_values": torch.tensor([0.0, float("nan"), 0.0, 0.0])},
        "truncated: expected 0/1": {"truncated": torch.tensor([0, 2, 0, 1])},
        "truncated: expected an integer tensor": {"truncated": torch.zeros(4)},
    }
    for i, (line, extra) in enumerate(cases.items()):
        sub = tmp_path / str(i)
        sub.mkdir()
        with pytest.raises(DumpError, match=line):
            load_dump(_write(sub, **extra))


def test_bool_flags_load_and_the_keys_are_read_only_when_bootstrapping(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        bootstrap_values=torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64),
        truncated=torch.tensor([True, False, False, False]),
    )
    d = load_dump(path)
    assert d.tensors["truncated"].tolist() == [1, 0, 0, 0]
    assert check_step(path).match  # gae_bootstrap=none: the keys are not read
    assert not check_step(path, overrides={"gae_bootstrap": "truncated"}).match  # row 0 reads 1.0


def test_bootstrapping_without_the_values_is_one_line(tmp_path: Path) -> None:
    path = _write(tmp_path)
    with pytest.raises(DumpError, match="missing required key 'bootstrap_values' \\[B\\]"):
        check_step(path, overrides={"gae_bootstrap": "truncated"})
