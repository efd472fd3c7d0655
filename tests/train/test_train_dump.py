"""``refppo train --set run.dump_iteration=N``: the trainer's own step as a v2 dump (through
``refppo.capture``), and ``refppo diff`` on it matches — on one process and under ``torchrun``
(2 gloo processes). Issue 10 item 6: the trainer checked by its own oracle."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torchrun_helpers import torchrun_train

from refppo.oracle.cli import main as refppo_diff
from refppo.train.config.sections import ConfigError
from refppo.train.loop import Trainer
from refppo.train.tasks.presets import TEST, preset

pytestmark = pytest.mark.e2e

BASE = ("task.reward=rule", "task.sft_steps=3", "ppo.minibatches=1", "run.dump_iteration=2")
"""TEST preset (8 rollouts, 2 epochs, 2 micro-batches, 2 iterations) with one minibatch, dump the last."""


def _diff(path: Path, *extra: str) -> tuple[int, dict[str, object]]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = refppo_diff([str(path), "--json", *extra])
    return code, json.loads(buf.getvalue())


def _check_dump(path: Path, world: int) -> None:
    d = load_file(str(path))
    side = json.loads(Path(f"{path}.json").read_text())
    assert d["response_mask"].shape[0] == 8  # every row of the step (batch 8, one minibatch), all ranks
    assert sorted(set(d["rank"].tolist())) == list(range(world))
    assert (side["world_size"], side["micro_batches"]) == (world, 2)  # ppo.micro_batches is per rank
    assert float(d["grad_logprobs"].abs().max()) > 1e-4 and float(d["grad_values"].abs().max()) > 1e-4
    code, rep = _diff(path)
    assert code == 0, rep["diagnosis"]
    assert {"grad_logprobs", "grad_values", "loss"} <= set(rep["quantities"])  # type: ignore[arg-type]
    # control: the same dump with grad_logprobs off by the factor W·K of a normaliser bug mismatches
    bad = dict(d, grad_logprobs=d["grad_logprobs"] * 2)
    save_file(bad, str(path.with_name("bad.safetensors")))
    Path(path.with_name("bad.safetensors.json")).write_text(json.dumps(side))
    code, rep = _diff(path.with_name("bad.safetensors"))
    assert code == 1 and not rep["quantities"]["grad_logprobs"]["ok"]  # type: ignore[index]


@pytest.mark.parametrize(
    "extra",
    [(), ("ppo.loss_agg=seq-mean-token-sum", "ppo.kl_in=loss", "ppo.kl_estimator=k3", "ppo.ent_coef=0.01")],
    ids=["defaults", "seq-sum-kl-loss"],
)
def test_trainer_dump_iteration_matches_its_oracle(tmp_path: Path, extra: tuple[str, ...]) -> None:
    cfg = preset("test", *BASE, *extra, f"run.out_dir={tmp_path / 'run'}")
    Trainer(cfg).train()
    dumps = sorted((tmp_path / "run" / "dumps").glob("*.safetensors"))
    assert [p.name for p in dumps] == ["iter_000002.safetensors"]  # only the chosen iteration
    _check_dump(dumps[0], world=1)


def test_dump_iteration_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"run\.dump_iteration: expected an iteration in 1\.\.2"):
        preset("test", "run.dump_iteration=3")
    with pytest.raises(ConfigError, match=r"run\.dump_iteration needs ppo\.minibatches=1"):
        preset("test", "run.dump_iteration=1")  # TEST has 2 minibatches and whitened advantages
    cfg = preset("test", "run.dump_iteration=1", "ppo.whiten_advantages=none")  # per-row: allowed
    assert cfg.run.dump_iteration == 1
    # a group estimator: the dump must hold whole groups, so one minibatch (groups of 2 here)
    grouped = ("ppo.advantage=grpo", "rollout.group_size=2", "ppo.whiten_advantages=none")
    with pytest.raises(ConfigError, match=r"needs ppo\.minibatches=1 \(got 2\) with ppo\.advantage=grpo"):
        preset("test", "run.dump_iteration=1", *grouped)
    assert preset("test", "run.dump_iteration=1", "ppo.minibatches=1", *grouped).run.dump_iteration == 1


def test_dump_iteration_with_the_defaults_says_exactly_what_to_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's ``refppo train --set run.dump_iteration=2`` on the defaults (4 minibatches,
    whitened advantages) exits 2 with one line naming the key in effect and the ``--set`` to add;
    the defaults with that ``--set`` added are accepted."""
    import re

    from refppo.train.cli import main as train_main
    from refppo.train.config.schema import TrainConfig

    rc = train_main(["--set", "run.dump_iteration=2", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "(got 4) with ppo.whiten_advantages=masked" in err, err
    fixes = re.findall(r"add --set (\S+)", err)
    assert fixes == ["ppo.minibatches=1"], err
    assert not (tmp_path / "run").exists()  # refused before anything is written
    cfg = TrainConfig().with_overrides(["run.dump_iteration=2", *fixes])
    assert cfg.ppo.minibatches == 1 and cfg.run.dump_iteration == 2


def test_torchrun_trainer_dump_matches_its_oracle(tmp_path: Path) -> None:
    """``torchrun --standalone --nproc-per-node 2 -m refppo train --set run.dump_iteration=2``:
    rank 0 writes one dump holding both ranks' rows, and the oracle matches it."""
    out = tmp_path / "run"
    args = ["--out", str(out)]
    for s in (*TEST, *BASE):
        args += ["--set", s]
    torchrun_train(tmp_path / "torchrun.log", *args)
    path = out / "dumps" / "iter_000002.safetensors"
    _check_dump(path, world=2)
    d = load_file(str(path))
    assert torch.equal(d["rank"], torch.tensor([0] * 4 + [1] * 4))  # gathered in rank order
