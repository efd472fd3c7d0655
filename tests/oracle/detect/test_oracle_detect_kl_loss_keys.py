"""``--detect`` and the KL loss's keys only a gradient shows (issue #23 item 5): ``kl_grad_is_clip``
(OpenRLHF 0.11.2 ``unbiased_gradient``) changes no dumped value, only ``grad_logprobs``. On a v1
dump with the scalars (made by the naive twins under ``kl_grad_is_clip=10``) the walk cannot tell
its values apart: both are listed, in one class, and the key is reported as not pinned down with
``grad_logprobs`` as what to dump — not one value picked. (The v2 case, where the gradient pins it:
tests/peers/test_peer_openrlhf_kl_unbiased.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from oracle_helpers import HP, make_inputs, naive_dump, setup_for

from refppo.dump.write import write_dump
from refppo.oracle.cli import main

CONV = {"kl_in": "loss", "kl_estimator": "k3", "kl_grad_is_clip": 10.0}


def test_v1_dump_leaves_kl_grad_is_clip_open(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = naive_dump(make_inputs(B=6, T=12, seed=3), setup_for(conv=CONV))
    assert "grad_logprobs" not in d and "kl_loss" in d
    path = tmp_path / "s.safetensors"
    write_dump(path, d, hparams=dict(HP))
    argv = [str(path), "--detect", "--json"]
    for k, v in CONV.items():
        argv += ["--set", f"{k}={v}"]
    main(argv)
    out = json.loads(capsys.readouterr().out)
    assert out["detected_count"] > 0
    assert {c["kl_grad_is_clip"] for c in out["detected"]} == {None, 10.0}
    assert "kl_grad_is_clip" in out["undetermined_keys"]
    assert out["evidence"]["kl_grad_is_clip"]["determined"] is False
    classes = [c for c in out["classes"] if "kl_grad_is_clip" in c["differing"]]
    assert classes, out["classes"]
    for c in classes:  # one class holds both values: the dump cannot tell them apart
        assert sorted(c["differing"]["kl_grad_is_clip"], key=str) == [10.0, None]
        assert c["to_separate_dump"]["kl_grad_is_clip"] == "grad_logprobs"
