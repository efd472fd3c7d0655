"""``refppo train`` with ``ppo.rollout_rs_effect=drop_mask`` (issue #22, verl 0.9.1 rollout rejection
sampling) and ``loss_agg=prompt-mean`` (issue #23, SkyRL 0.4.0 ``prompt_mean``), one process: the dump
of iteration 3 (one minibatch of 8 rows in 2 micro-batches) is matched by ``refppo diff`` under the
run's own sidecar, and a control setting mismatches; 3 iterations straight == 2, ``--resume``, 1 —
every metric, the dump, the policy and the critic bit for bit. Under torchrun:
``test_train_split_torchrun.py``; the split step against the core: ``test_train_split_modes.py``."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from refppo.oracle.cli import main as refppo_diff
from refppo.train.loop import Trainer
from refppo.train.runlog import deterministic, read_metrics
from refppo.train.tasks.presets import preset

pytestmark = pytest.mark.e2e

BASE = ("task.reward=rule", "task.sft_steps=3", "ppo.minibatches=1", "run.checkpoint_every=1")
"""TEST preset (8 rollouts, 2 epochs, 2 micro-batches), one minibatch (a dump needs it), checkpoints."""
DROP = (
    "seam.enabled=true",
    "seam.staleness=1",
    "ppo.rollout_rs=token",
    "ppo.rollout_rs_effect=drop_mask",
    "ppo.rollout_rs_low=0.98",
    "ppo.rollout_rs_high=1.02",
)
"""A bfloat16 engine one iteration stale; verl's token gate on π^prox/π^beh in [0.98, 1.02], its kept
tokens the mask of every stage after the reward."""
PROMPT_MEAN = {
    "gae": ("rollout.group_size=2", "ppo.loss_agg=prompt-mean", "ppo.value_loss_agg=token-mean"),
    "grpo": ("rollout.group_size=2", "ppo.advantage=grpo", "ppo.loss_agg=prompt-mean"),
}
"""4 prompts × 2 responses; prompt-mean of the policy and entropy terms (the value loss token-mean)."""


def _diff(path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = refppo_diff([str(path), "--json", *extra])
    return code, json.loads(buf.getvalue())


def _same_tensors(a: Path, b: Path) -> bool:
    ta, tb = load_file(str(a)), load_file(str(b))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def _straight_and_resumed(tmp_path: Path, *sets: str) -> Path:
    """3 iterations straight and 2 + ``--resume`` + 1 (iteration 3 dumped in both): the two runs'
    metrics, dumps and final weights are equal bit for bit. Returns the straight run's dump."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    dump3 = ("run.iterations=3", "run.dump_iteration=3")
    Trainer(preset("test", *BASE, *sets, *dump3, f"run.out_dir={straight}")).train()
    Trainer(preset("test", *BASE, *sets, "run.iterations=2", f"run.out_dir={split}")).train()
    resumed = Trainer(preset("test", *BASE, *sets, *dump3, f"run.out_dir={split}"), resume=True)
    assert resumed.start_iteration == 2
    resumed.train()
    a = [deterministic(r) for r in read_metrics(straight / "metrics.jsonl")]
    b = [deterministic(r) for r in read_metrics(split / "metrics.jsonl")]
    assert [r["iteration"] for r in b] == [1, 2, 3] and a == b
    path = straight / "dumps" / "iter_000003.safetensors"
    assert _same_tensors(path, split / "dumps" / "iter_000003.safetensors")
    ca, cb = straight / "checkpoints" / "iter_000003", split / "checkpoints" / "iter_000003"
    names = [p.name for p in sorted(ca.glob("*.safetensors"))]
    assert "policy.safetensors" in names  # and critic.safetensors under gae, the seam's snapshots
    for name in names:
        assert _same_tensors(ca / name, cb / name), name
    return path


def test_a_drop_mask_run_matches_its_oracle_and_resumes_exactly(tmp_path: Path) -> None:
    """The dump's gate, counted by hand from its tensors (``e^{l^prox − l^beh}`` outside [0.98, 1.02]),
    rejects tokens and empties a row (the row-subset path and a count below the rows); ``refppo diff``
    matches; ``rollout_rs_effect=weight`` (rejected tokens counted) and the gate off mismatch."""
    path = _straight_and_resumed(tmp_path, *DROP)
    d = load_file(str(path))
    m = d["response_mask"].bool()
    ratio = (d["old_logprobs"].double() - d["rollout_logprobs"].double()).exp()
    kept = m & (ratio >= 0.98) & (ratio <= 1.02)
    assert 0 < int(kept.sum()) < int(m.sum())
    assert int((~kept.any(dim=1)).sum()) >= 1  # a row the gate empties
    assert sorted(set(d["micro_batch"].tolist())) == [0, 1]
    code, rep = _diff(path)
    assert code == 0, rep["diagnosis"]
    for control in ("rollout_rs_effect=weight", "rollout_rs=none"):
        code, rep = _diff(path, "--set", control)
        assert code == 1 and not rep["quantities"]["pg_loss"]["ok"], control


@pytest.mark.parametrize("case", sorted(PROMPT_MEAN))
def test_a_prompt_mean_run_matches_its_oracle_and_resumes_exactly(tmp_path: Path, case: str) -> None:
    """The dump holds 4 prompts of 2 rows (``group_index``) of unequal lengths; ``refppo diff``
    matches under the sidecar's ``loss_agg=prompt-mean``; ``seq-mean-token-mean`` and ``token-mean``
    (the control modes of the SkyRL validation) mismatch at ``pg_loss``."""
    path = _straight_and_resumed(tmp_path, *PROMPT_MEAN[case])
    d = load_file(str(path))
    groups = d["group_index"].tolist()
    assert sorted(groups.count(g) for g in set(groups)) == [2, 2, 2, 2]
    assert len(set(d["response_mask"].sum(dim=1).tolist())) > 1
    side = json.loads(Path(f"{path}.json").read_text())
    assert side["loss_agg"] == "prompt-mean"
    # critic-free (grpo): no value aggregation is named; the gradient reference's zero stand-in value
    # term (oracle/check/recompute.py::_without_critic) must not refuse prompt-mean
    code, rep = _diff(path)
    assert code == 0, rep["diagnosis"]
    for control in ("seq-mean-token-mean", "token-mean"):
        code, rep = _diff(path, "--set", f"loss_agg={control}")
        assert code == 1 and not rep["quantities"]["pg_loss"]["ok"], control
