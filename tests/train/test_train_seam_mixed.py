"""Mixed staleness within one batch (issue #22 item 5; ``seam.staleness_min``): the rows of one
rollout sampled by policies of different ages, as an asynchronous trainer with partial rollouts has;
each row's ``policy_version`` is recorded, and ``refppo diff`` matches the dump of a corrected step."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from refppo.models.rollout import RolloutConfig, generate_rollout
from refppo.models.tiny import tiny_gpt2
from refppo.oracle.cli import main as refppo_diff
from refppo.train.config.seam import SeamConfig
from refppo.train.config.sections import ConfigError
from refppo.train.loop import Trainer
from refppo.train.seam import RolloutEngine
from refppo.train.tasks.presets import preset

MIXED = ("seam.enabled=true", "seam.staleness=2", "seam.staleness_min=0")


def test_staleness_min_is_checked() -> None:
    assert preset("test", *MIXED).seam.row_staleness(8) == [0, 1, 2, 0, 1, 2, 0, 1]
    assert preset("test", "seam.enabled=true", "seam.staleness=3", "seam.staleness_min=2").seam.row_staleness(
        5
    ) == [2, 3, 2, 3, 2]
    assert SeamConfig(enabled=True, staleness=2).row_staleness(3) == [2, 2, 2]  # None: uniform
    bad = {
        r"seam.staleness_min: expected none or an integer in \[0, seam.staleness=2\], got 3": (
            "seam.enabled=true", "seam.staleness=2", "seam.staleness_min=3",
        ),
        r"seam.staleness_min: expected none or an integer in \[0, seam.staleness=0\], got -1": (
            "seam.enabled=true", "seam.staleness_min=-1",
        ),
        r"seam.staleness_min=0 is set but seam.enabled=false": ("seam.staleness_min=0",),
    }  # fmt: skip
    for pattern, sets in bad.items():
        with pytest.raises(ConfigError, match=pattern):
            preset("test", *sets)


def test_each_row_is_sampled_by_its_own_policy_version() -> None:
    """k = 2, j = 0 over 6 rows (staleness 0, 1, 2, 0, 1, 2): at iteration it, row b is sampled by
    the weights of version ``max(0, it − s_b)``; the rows of one staleness are the tokens a float32
    copy of that version samples for them, the staleness groups drawn oldest first from the one
    generator; ``policy_version`` per row."""
    torch.manual_seed(0)
    model = tiny_gpt2(vocab_size=40, hidden=32, layers=2, heads=2, max_positions=32).eval()
    ids = torch.randint(3, 40, (6, 5))
    mask = torch.ones_like(ids)
    mask[:2, :2] = 0  # left padding
    cfg = RolloutConfig(max_new_tokens=4, eos_token_id=2)
    eng = RolloutEngine(SeamConfig(enabled=True, dtype="float32", staleness=2, staleness_min=0), model)
    kept: list[dict[str, torch.Tensor]] = []
    for it in range(4):
        kept.append({k: v.clone() for k, v in model.state_dict().items()})  # version it
        batch, b = eng.rollout(model, ids, mask, cfg, torch.Generator().manual_seed(it), it)
        want_v = [max(0, it - s) for s in (0, 1, 2, 0, 1, 2)]
        assert b.policy_version.tolist() == want_v and b.version == it
        gen = torch.Generator().manual_seed(it)
        for s in (2, 1, 0):
            rows = torch.tensor([s, s + 3])
            ref = tiny_gpt2(vocab_size=40, hidden=32, layers=2, heads=2, max_positions=32).eval()
            ref.load_state_dict(kept[max(0, it - s)])
            want = generate_rollout(ref, ids[rows], mask[rows], cfg, gen)
            assert torch.equal(batch.response_ids[rows], want.response_ids), (it, s)
            assert torch.equal(batch.response_mask[rows], want.response_mask), (it, s)
            assert bool((b.rollout_logprobs[rows][~want.response_mask] == 0).all())
        with torch.no_grad():  # an "update": every version differs
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    assert eng.versions == [2, 3]


def _diff(path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = refppo_diff([str(path), "--json", *extra])
    return code, json.loads(buf.getvalue())


@pytest.mark.e2e
def test_a_mixed_staleness_dump_records_each_rows_version_and_matches(tmp_path: Path) -> None:
    """The trainer (TEST preset, one minibatch, bfloat16 engine, k = 2, j = 0, token TIS [0.98, 1.02])
    dumps iteration 3: its 8 rows (in rollout order) carry versions 2, 1, 0, 2, 1, 0, 2, 1 and
    ``refppo diff`` matches the corrected step under its sidecar; the correction off mismatches at
    ``pg_loss``. The seam metric logs the mean staleness ``it − mean(max(0, it − s_b))``: 0; 5/8
    (versions 1, 0, 0, 1, 0, 0, 1, 0: version 0 stands in for the older); 7/8 (3·0 + 3·1 + 2·2
    over 8)."""
    sets = (
        "task.reward=rule", "task.sft_steps=3", "ppo.minibatches=1", "run.iterations=3",
        "run.dump_iteration=3", "ppo.rollout_is=token", "ppo.rollout_is_low=0.98",
        "ppo.rollout_is_high=1.02", *MIXED, f"run.out_dir={tmp_path / 'run'}",
    )  # fmt: skip
    Trainer(preset("test", *sets)).train()
    path = tmp_path / "run" / "dumps" / "iter_000003.safetensors"
    d = load_file(str(path))
    # the dump's rows are in the update's order; group_index (group size 1) is the rollout row
    assert d["policy_version"][d["group_index"].argsort()].tolist() == [2, 1, 0, 2, 1, 0, 2, 1]
    m = d["response_mask"].bool()
    gap = (d["old_logprobs"] - d["rollout_logprobs"]).abs()
    fresh, stale = d["policy_version"] == 2, d["policy_version"] < 2
    assert float(gap[stale.unsqueeze(1) & m].max()) > 10 * float(gap[fresh.unsqueeze(1) & m].max())
    code, rep = _diff(path)
    assert code == 0, rep["diagnosis"]
    code, rep = _diff(path, "--set", "rollout_is=none")
    assert code == 1 and not rep["quantities"]["pg_loss"]["ok"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/seam_staleness"] for r in records] == [0.0, 5 / 8, 7 / 8]
