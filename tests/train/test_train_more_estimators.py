"""`refppo train` with verl's ``opo``, ``gpg``, ``grpo-passk`` and OpenRLHF's ``flash-reinforce``
(issue #13 follow-up): the trainer's own dump of an iteration (``run.dump_iteration``) is matched
by `refppo diff` under that estimator, so the trainer's step is the pipeline's; controls: the same
dump checked as ``grpo`` mismatches the advantages, and so does the dump with one score moved.

Nothing is learnt in particular (2 iterations of the test preset): the run only has to run and
agree with the oracle. The advantages themselves are compared with the naive twin by
``test_train_grpo.py::test_critic_free_step_has_no_critic_and_the_core_advantages``.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from refppo.oracle.cli import main as refppo_diff
from refppo.train.loop import Trainer
from refppo.train.tasks.presets import preset

pytestmark = pytest.mark.e2e

GROUPED = ("rollout.group_size=4", "task.reward=rule")  # TEST: 8 rows = 2 prompts x 4


def _diff(p: Path, *sets: str) -> tuple[int, dict[str, Any]]:
    argv = [str(p), "--json"]
    for s in sets:
        argv += ["--set", s]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = refppo_diff(argv)
    rep: dict[str, Any] = json.loads(buf.getvalue())
    return code, rep


@pytest.mark.parametrize("adv", ["opo", "gpg", "grpo-passk", "flash-reinforce"])
def test_new_estimator_dump_iteration_matches_the_oracle(tmp_path: Path, adv: str) -> None:
    extra = (*GROUPED, f"ppo.advantage={adv}", "ppo.whiten_advantages=none", "ppo.minibatches=1")
    Trainer(preset("test", *extra, "run.dump_iteration=2", f"run.out_dir={tmp_path}")).train()
    path = tmp_path / "dumps" / "iter_000002.safetensors"
    d = load_file(str(path))
    assert not {"old_values", "values", "grad_values", "vf_loss"} & set(d)
    assert float(d["advantages"].abs().max()) > 1e-3  # a real signal: the check is not 0 == 0
    code, rep = _diff(path)
    assert code == 0, rep["diagnosis"]
    assert {"advantages", "grad_logprobs", "loss"} <= set(rep["quantities"])
    # control 1: another estimator on the same dump
    code, rep = _diff(path, "advantage=grpo")
    assert code == 1 and not rep["quantities"]["advantages"]["ok"]
    # control 2: the best-scored row's score raised by 1 (moves every estimator's baseline or margin)
    s = d["scores"].clone()
    s[int(s.argmax())] += 1.0
    bad = tmp_path / "bad.safetensors"
    save_file(dict(d, scores=s), str(bad))
    Path(f"{bad}.json").write_text(Path(f"{path}.json").read_text())
    code, rep = _diff(bad)
    assert code == 1 and not rep["quantities"]["advantages"]["ok"]
