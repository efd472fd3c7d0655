"""``ppo.group_std`` where no estimator reads a group std: refused for a new run, a warning on --resume.

Only ``grpo`` and ``grpo-passk`` divide by a σ (:data:`refppo.train.config.schema.STD_LEVEL_ESTIMATORS`),
so ``ppo.group_std=population`` under any other ``ppo.advantage`` would be silently ignored. A new
run refuses it in one line (exit 2 from the CLI, nothing written). refppo up to 61be225 accepted it,
so a run started then resumes: the run is made with the check switched off (what the older
refppo did), then resumed with it on, and must warn once and continue exactly like the
uninterrupted run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from refppo.train.cli import main as train_main
from refppo.train.config.schema import TrainConfig
from refppo.train.config.sections import ConfigError
from refppo.train.loop import Trainer
from refppo.train.runlog import deterministic, read_metrics
from refppo.train.tasks.presets import preset

pytestmark = pytest.mark.e2e

GROUPED = ("rollout.group_size=4", "task.reward=rule")  # TEST: 8 rows = 2 prompts x 4
UNREAD = ("ppo.advantage=rloo", *GROUPED, "ppo.group_std=population")


@pytest.mark.parametrize(
    "adv", ["gae", "dr-grpo", "rloo", "reinforce++-baseline", "opo", "gpg", "reinforce++", "flash-reinforce"]
)
def test_population_group_std_without_a_group_std_is_refused_for_a_new_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], adv: str
) -> None:
    sets = [f"ppo.advantage={adv}", *GROUPED, "ppo.group_std=population"]
    needle = f"ppo.group_std=population is set but ppo.advantage={adv} takes no group std"
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=re.escape(needle)):
        Trainer(preset("test", *sets, f"run.out_dir={out}"))
    argv = ["--out", str(out)]
    for s in sets:
        argv += ["--set", s]
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not out.exists()  # refused before anything is written


@pytest.mark.parametrize("adv", ["grpo", "grpo-passk"])
def test_population_group_std_is_kept_where_a_group_std_is_read(adv: str) -> None:
    cfg = preset("test", f"ppo.advantage={adv}", *GROUPED, "ppo.group_std=population")
    assert cfg.unread_options() is None
    assert preset("test", "ppo.advantage=rloo", *GROUPED).unread_options() is None  # the default


def test_a_run_an_older_refppo_started_with_it_resumes_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    with monkeypatch.context() as older:  # refppo <= 61be225: no such check
        older.setattr(TrainConfig, "unread_options", lambda self: None)
        Trainer(preset("test", *UNREAD, "run.iterations=2", f"run.out_dir={straight}")).train()
        Trainer(preset("test", *UNREAD, "run.iterations=1", f"run.out_dir={split}")).train()

    lines: list[str] = []
    resumed = Trainer(
        preset("test", *UNREAD, "run.iterations=2", f"run.out_dir={split}"), resume=True, echo=lines.append
    )
    assert resumed.start_iteration == 1
    warned = [ln for ln in lines if "ppo.group_std=population" in ln]
    assert warned == [
        "warning: ppo.group_std=population is set but ppo.advantage=rloo takes no group std (only grpo, "
        "grpo-passk read it); resuming as the run began (it has no effect)"
    ]
    resumed.train()
    a = [deterministic(r) for r in read_metrics(straight / "metrics.jsonl")]
    b = [deterministic(r) for r in read_metrics(split / "metrics.jsonl")]
    assert [r["iteration"] for r in b] == [1, 2] and a == b
    wa = load_file(straight / "checkpoints" / "iter_000002" / "policy.safetensors")
    wb = load_file(split / "checkpoints" / "iter_000002" / "policy.safetensors")
    assert wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)
