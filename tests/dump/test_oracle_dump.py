"""refppo.dump.write: a trainer writes a dump in a few lines and the oracle reads it back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from oracle_helpers import make_inputs

from refppo.dump.load import load_dump
from refppo.dump.write import pipeline_tensors, sidecar_for, write_dump
from refppo.oracle.check.diagnose import check
from refppo.oracle.check.settings import Setup, build_setup, parse_value
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import rollout_quantities, update_quantities


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".npz"])
def test_trainer_side_dump_of_a_pipeline_step_matches(tmp_path: Path, suffix: str) -> None:
    inp = make_inputs(seed=9)
    conv = Convention().with_updates({"score_at": "after_last_valid", "loss_agg": "seq-mean-token-mean"})
    hp = Hyperparams(gamma=0.97, lam=0.9, kl_coef=0.02, vf_coef=0.5)
    m = inp["response_mask"].bool()
    rq = rollout_quantities(
        scores=inp["scores"],
        old_logprobs=inp["old_logprobs"],
        ref_logprobs=inp["ref_logprobs"],
        old_values=inp["old_values"],
        mask=m,
        hp=hp,
        conv=conv,
    )
    uq = update_quantities(
        logprobs=inp["logprobs"],
        values=inp["values"],
        old_logprobs=inp["old_logprobs"],
        old_values=inp["old_values"],
        advantages=rq.advantages,
        returns=rq.returns,
        mask=m,
        value_mask_=rq.value_mask,
        hp=hp,
        conv=conv,
    )
    tensors = pipeline_tensors(
        response_mask=m,
        old_logprobs=inp["old_logprobs"],
        ref_logprobs=inp["ref_logprobs"],
        old_values=inp["old_values"],
        scores=inp["scores"],
        logprobs=inp["logprobs"],
        values=inp["values"],
        rollout=rq,
        update=uq,
    )
    path = tmp_path / f"step{suffix}"
    sc = write_dump(path, tensors, hparams=hp, convention=conv)
    assert sc == sidecar_for(path)
    side = json.loads(sc.read_text())
    assert side["score_at"] == "after_last_valid" and side["gamma"] == 0.97
    dump = load_dump(path)
    setup = build_setup(
        preset_conv=None,
        preset_hp=None,
        sidecar={k: parse_value(k, v) for k, v in dump.hparams.items()},
        overrides={},
    )
    assert isinstance(setup, Setup) and setup.conv == conv and setup.hp == hp
    res = check(dump, setup)
    assert res.match, res.diagnosis
    assert (
        len(res.quantities) == 10
    )  # 4 rollout + pg_loss, pg_clipfrac, approx_kl, vf_loss, vf_clipfrac, loss


def test_write_dump_rejects_unknown_suffix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown dump type"):
        write_dump(tmp_path / "x.bin", {"scores": torch.zeros(2)})
