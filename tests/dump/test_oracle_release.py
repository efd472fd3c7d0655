"""Issue #9 (memory): a safetensors dump's trainer outputs are handed back to the OS after they are
compared (``Dump.release``), and nothing about their values changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle_helpers import make_inputs, refppo_dump, save, setup_for

from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import check

OUTPUTS = ("kl", "token_rewards", "advantages", "returns")


def _dump(tmp_path: Path, name: str, dtype: torch.dtype) -> Path:
    d = refppo_dump(make_inputs(B=16, T=512), setup_for("trl"), dtype=dtype)
    return save(tmp_path, d, setup_for("trl"), name=name)


def test_mapped_keys_are_the_safetensors_ones_in_the_compute_dtype(tmp_path: Path) -> None:
    dump = load_dump(_dump(tmp_path, "step.safetensors", torch.float32))
    assert set(OUTPUTS) <= dump.mapped
    assert "response_mask" not in dump.mapped  # a bool mask made by the loader, not the file's bytes
    # a .pt file is read into memory (not mapped); a float16 dump is converted to float32 (new memory)
    assert load_dump(_dump(tmp_path, "step.pt", torch.float32)).mapped == frozenset()
    assert load_dump(_dump(tmp_path, "half.safetensors", torch.float16)).mapped == frozenset()


def test_release_keeps_every_value_and_the_check_unchanged(tmp_path: Path) -> None:
    path = _dump(tmp_path, "step.safetensors", torch.float32)
    dump = load_dump(path)
    before = {k: dump.tensors[k].clone() for k in dump.mapped}
    first = check(dump, setup_for("verl"))  # a mismatch: compare_all and the diagnosis release keys
    for k in dump.mapped:
        dump.release(k)
        assert torch.equal(dump.tensors[k], before[k]), k
    again = check(load_dump(path), setup_for("verl"))
    assert first.quantities == again.quantities and first.diagnosis == again.diagnosis
    assert not first.match


@pytest.mark.parametrize("key", ["old_logprobs", "kl"])
def test_release_of_a_key_read_again_gives_the_file_bytes(tmp_path: Path, key: str) -> None:
    path = _dump(tmp_path, "step.safetensors", torch.float32)
    from safetensors.torch import load_file

    want = load_file(str(path))[key].clone()
    dump = load_dump(path)
    for _ in range(3):
        dump.release(key)
        assert torch.equal(dump.tensors[key], want)


@pytest.mark.parametrize("bug", [None, "gae_through_padding", "whiten_over_padding"])
def test_update_stage_from_a_slim_rollout_equals_the_whole_recompute(tmp_path: Path, bug: str | None) -> None:
    """``check`` continues a slim copy of the rollout (advantages, returns, masks): every update
    quantity equals one full ``recompute`` bit for bit, and the comparison with the rollout's
    results taken as known equals the direct comparison of the full reference."""
    from refppo.oracle.check.diagnose import compare_all
    from refppo.oracle.check.recompute import recompute

    made, checked = setup_for("openrlhf", {"kl_estimator": "k3"}), setup_for("verl")
    dump = load_dump(save(tmp_path, refppo_dump(make_inputs(B=5, T=10, seed=6), made), made))
    whole = recompute(dump, checked, bug=bug)
    ro = recompute(dump, checked, bug=bug, rollout_only=True)
    known = compare_all(dump, ro)
    slim = ro.slim(("token_rewards",))
    assert set(slim.values) == {"advantages", "returns", "token_rewards"} and slim.advantages_raw is None
    cont = recompute(dump, checked, bug=bug, rollout=slim)
    assert set(cont.values) == set(whole.values) - {"kl"}  # kl: compared already, not kept
    for name, v in cont.values.items():
        assert torch.equal(v, whole.values[name]), name
    direct = compare_all(dump, whole)
    assert not all(r.ok for r in direct.values())
    assert compare_all(dump, cont, known=known) == direct
