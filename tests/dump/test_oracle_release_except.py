"""Issue #23 item 1 (memory): ``Dump.release_except`` unmaps the memory-mapped keys a step does not
read; every value stays the file's (or, for a tensor written in place, the written one)."""

from __future__ import annotations

from pathlib import Path

import torch
from oracle_helpers import make_inputs, refppo_dump, save, setup_for
from safetensors.torch import load_file

from refppo.dump.load import load_dump


def _path(tmp_path: Path) -> Path:
    d = refppo_dump(make_inputs(B=16, T=512), setup_for("trl"), dtype=torch.float32)
    return save(tmp_path, d, setup_for("trl"), name="step.safetensors")


def test_release_except_keeps_the_file_bytes(tmp_path: Path) -> None:
    path = _path(tmp_path)
    want = {k: v.clone() for k, v in load_file(str(path)).items()}
    dump = load_dump(path)
    assert {"kl", "advantages", "old_logprobs"} <= dump.mapped
    for keep in [(), ("advantages",), tuple(dump.mapped)]:
        dump.release_except(keep)
        for k in dump.mapped:
            assert torch.equal(dump.tensors[k], want[k]), (keep, k)


def test_a_mapped_tensor_written_in_place_keeps_the_written_values(tmp_path: Path) -> None:
    """Its written pages are the process's own copies: unmapping them would read the file's bytes
    back (the values before the write), so such a tensor is only paged out."""
    dump = load_dump(_path(tmp_path))
    kl = dump.tensors["kl"]
    written = kl.clone() + 1.0
    kl.add_(1.0)
    dump.release_except(())
    assert torch.equal(dump.tensors["kl"], written)
