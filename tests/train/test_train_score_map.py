"""`refppo train` with a score map: ``ppo.score_bias``, ``ppo.score_scale``, ``ppo.score_clip``.

The trainer's step 0 maps the score as ``clip((s + b)·k, ±C)`` (spec/ppo.md, "map_scores"): the
token rewards and advantages of a trainer step are the naive twin's on the scores mapped here by
hand, and differ from the unmapped ones; a dump of such a run is matched by `refppo diff` with no
``--set`` (the sidecar carries the map) and mismatched once the sidecar's map is dropped; the keys
take part in the config hash (a resume with another map is refused); bad values are one line.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from refppo.oracle.cli import main as refppo_diff
from refppo.pipeline.groups import ScoreMap
from refppo.pipeline.step import RolloutQuantities, rollout_quantities_naive
from refppo.train.cli import main as train_main
from refppo.train.config.doc import describe_config
from refppo.train.config.schema import TrainConfig
from refppo.train.config.sections import ConfigError
from refppo.train.loop import Trainer
from refppo.train.runtime import TrainingError
from refppo.train.tasks.presets import preset

pytestmark = pytest.mark.e2e

RULE = "task.reward=rule"  # TEST: scores in {0, 0.5, 1}, minus 1 without EOS: several values per batch


def _sets(bias: float, scale: float, clip: float) -> tuple[str, ...]:
    return (f"ppo.score_bias={bias}", f"ppo.score_scale={scale}", f"ppo.score_clip={clip}")


@pytest.mark.parametrize(
    ("bias", "scale", "clip", "more"),
    [
        (0.0, 1.0, 0.3, ()),
        (-0.25, 2.0, 0.6, ()),
        (0.5, 1.5, 0.4, ("rollout.group_size=4", "ppo.advantage=grpo", "ppo.whiten_advantages=none")),
    ],
    ids=["clip", "affine+clip", "grpo"],
)
def test_trainer_step_maps_the_scores_as_the_naive_twin(
    tmp_path: Path, bias: float, scale: float, clip: float, more: tuple[str, ...]
) -> None:
    t = Trainer(preset("test", RULE, *more, *_sets(bias, scale, clip), f"run.out_dir={tmp_path}"))
    _, result, _ = t.step(0)
    sc, q = result.scored, result.quantities
    s = sc.scores.double()
    affine = (s + bias) * scale
    assert bool((affine.abs() > clip).any()), s  # the clip binds on this batch
    mapped = affine.clamp(-clip, clip)  # the definition, written here
    grouped = t.cfg.critic_free

    def naive(scores: torch.Tensor) -> RolloutQuantities:
        return rollout_quantities_naive(
            scores=scores,
            old_logprobs=sc.old_logprobs.double(),
            ref_logprobs=sc.ref_logprobs.double(),
            old_values=sc.old_values.double(),
            mask=sc.batch.response_mask,
            hp=t.cfg.ppo.hp,
            conv=replace(t.cfg.ppo.convention, score=ScoreMap()),  # the scores fed already mapped
            group_index=torch.arange(2).repeat_interleave(4) if grouped else None,
        )

    want, unmapped = naive(mapped), naive(s)
    adv = q.advantages_raw if grouped else q.advantages
    want_adv = want.advantages_raw if grouped else want.advantages
    m = sc.batch.response_mask.bool()
    assert float((q.token_rewards.double() - want.token_rewards).abs().max()) <= 1e-5
    assert float((adv.double() - want_adv)[m].abs().max()) <= 1e-5
    assert float((q.token_rewards.double() - unmapped.token_rewards).abs().max()) > 1e-2
    unmapped_adv = unmapped.advantages_raw if grouped else unmapped.advantages
    assert float((adv.double() - unmapped_adv)[m].abs().max()) > 1e-3


def _diff(path: Path) -> tuple[int, dict[str, Any]]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = refppo_diff([str(path), "--json"])
    return code, json.loads(buf.getvalue())


def test_dump_with_a_score_map_is_matched_by_its_sidecar_alone(tmp_path: Path) -> None:
    """A trainer dump made with a binding score map: its sidecar carries the map (no ``--set``
    needed); the same dump with the map dropped from the sidecar mismatches at the advantages and
    returns (the trainer's dump holds no token rewards)."""
    bias, scale, clip = -0.25, 2.0, 0.6
    cfg = preset(
        "test", RULE, "ppo.minibatches=1", "run.iterations=1", "run.dump_iteration=1",
        *_sets(bias, scale, clip), f"run.out_dir={tmp_path / 'run'}",
    )  # fmt: skip
    Trainer(cfg).train()
    path = tmp_path / "run" / "dumps" / "iter_000001.safetensors"
    side = json.loads(Path(f"{path}.json").read_text())
    assert (side["score_bias"], side["score_scale"], side["score_clip"]) == (bias, scale, clip)
    from safetensors.torch import load_file

    s = load_file(str(path))["scores"].double()
    assert bool((((s + bias) * scale).abs() > clip).any())  # the map matters on the dump's rows
    code, rep = _diff(path)
    assert code == 0, rep
    assert {"advantages", "returns", "grad_logprobs", "grad_values"} <= set(rep["quantities"])

    dropped = tmp_path / "dropped.safetensors"
    dropped.write_bytes(path.read_bytes())
    Path(f"{dropped}.json").write_text(
        json.dumps({k: v for k, v in side.items() if k not in ("score_bias", "score_scale", "score_clip")})
    )
    code, rep = _diff(dropped)
    assert code == 1
    quantities = rep["quantities"]
    assert not quantities["advantages"]["ok"] and not quantities["returns"]["ok"]


def test_identity_map_sidecar_and_default_run_unchanged() -> None:
    """The default config's score map is the identity (the pipeline's step 0 leaves the scores bit
    for bit), and the sidecar still names it so a reader sees it. That a default run is unchanged by the
    score map is proven by the goldens (tests/golden/: the default conventions' trajectories, compared
    with the stored tensors), not here."""
    from refppo.train.dump import sidecar_conventions

    cfg = TrainConfig()
    assert cfg.ppo.convention.score.identity
    side = sidecar_conventions(cfg)
    assert (side["score_bias"], side["score_scale"], side["score_clip"]) == (0.0, 1.0, None)
    m = preset("test", "ppo.score_scale=0.5").ppo.convention.score
    assert not m.identity and (m.bias, m.scale, m.clip) == (0.0, 0.5, None)


def test_resume_with_another_score_map_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    base = ("test", RULE, f"run.out_dir={out}", "run.iterations=1")
    Trainer(preset(*base, "ppo.score_clip=0.3")).train()
    with pytest.raises(TrainingError, match=r"different config .*ppo.score_clip: 0.3 -> 0.5"):
        Trainer(preset(*base, "ppo.score_clip=0.5", "run.iterations=2"), resume=True)
    with pytest.raises(TrainingError, match=r"different config .*ppo.score_clip: 0.3 -> None"):
        Trainer(preset(*base, "run.iterations=2"), resume=True)
    t = Trainer(preset(*base, "ppo.score_clip=0.3", "run.iterations=2"), resume=True)
    assert t.start_iteration == 1 and t.cfg.ppo.convention.score.clip == 0.3


@pytest.mark.parametrize(
    ("item", "needle"),
    [
        ("ppo.score_clip=0", "ppo.score_clip: expected a finite number > 0 or none, got 0.0"),
        ("ppo.score_clip=-1.5", "ppo.score_clip: expected a finite number > 0 or none, got -1.5"),
        ("ppo.score_clip=inf", "ppo.score_clip: expected a finite number > 0 or none, got inf"),
        ("ppo.score_clip=nan", "ppo.score_clip: expected a finite number > 0 or none, got nan"),
        ("ppo.score_bias=-inf", "ppo.score_bias: expected a finite number, got -inf"),
        ("ppo.score_scale=nan", "ppo.score_scale: expected a finite number, got nan"),
        ("ppo.score_scale=big", "ppo.score_scale: expected a number, got 'big'"),
    ],
)
def test_bad_score_map_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], item: str, needle: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        preset("test", item)
    assert train_main(["--out", str(tmp_path), "--set", item]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_bad_score_clip_in_a_toml_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("[ppo]\nscore_clip = nan\n")
    assert train_main(["--config", str(toml), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ppo.score_clip: expected a finite number > 0 or none, got nan" in err[0], err


def test_help_config_documents_the_score_map() -> None:
    text = describe_config("ppo")
    for key, head in (
        ("ppo.score_bias", "(float, default 0.0)"),
        ("ppo.score_scale", "(float, default 1.0)"),
        ("ppo.score_clip", "(float | none, default none)"),
    ):
        assert f"  {key}  {head}" in text, key
    assert "clip((s + score_bias)·score_scale, ±score_clip)" in " ".join(text.split())
