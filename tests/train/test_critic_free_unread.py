"""Options no step reads: refused for a new run, a warning on ``--resume`` (as ``ppo.group_std``).

A critic-free ``ppo.advantage`` has no critic, no value loss and no GAE, so the keys of
:data:`refppo.train.config.schema.CRITIC_ONLY_KEYS` (``vf_coef``, ``cliprange_value``, ``value_loss``,
``value_clip_form``, ``value_loss_agg``, ``lam``) off their default would be silently ignored; so
would ``ppo.group_eps`` where no σ is taken (anything but ``grpo``/``grpo-passk``), and
``group_singleton=score`` is wrong for ``grpo-passk``. The "unread" claim itself is checked by
running: with the check switched off, one iteration with and without the keys gives bit-identical
actor weights under every critic-free estimator (and ``group_eps`` does change ``grpo``'s, so the
comparison can fail). The oracle's ``--set``/``--preset`` refuse ``group_std_level`` and
``grpo-passk`` + ``group_singleton=score`` in :func:`refppo.oracle.check.settings.build_setup`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from oracle_helpers import make_inputs, refppo_dump, save, setup_for
from safetensors.torch import load_file

from refppo.errors import ConventionError
from refppo.oracle.check.settings import parse_value
from refppo.pipeline.settings import Convention
from refppo.train.cli import main as train_main
from refppo.train.config.schema import TrainConfig
from refppo.train.config.sections import ConfigError
from refppo.train.loop import Trainer
from refppo.train.runlog import deterministic, read_metrics
from refppo.train.tasks.presets import preset

pytestmark = pytest.mark.e2e

GROUPED = ("rollout.group_size=4", "task.reward=rule")  # TEST: 8 rows = 2 prompts x 4
CRITIC_FREE = ["grpo", "dr-grpo", "rloo", "reinforce++-baseline", "opo", "gpg", "grpo-passk", "reinforce++"]
CRITIC_FREE += ["flash-reinforce"]
CRITIC_SETS = {  # each off its default (Hyperparams(): vf_coef 0.1, cliprange_value 0.2, lam 0.95)
    "vf_coef": "100.0",
    "cliprange_value": "0.01",
    "value_loss": "unclipped",
    "value_clip_form": "delta",
    "value_loss_agg": "seq-mean-token-sum",
    "lam": "0.1",
}


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], sets: list[str], needle: str) -> None:
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


@pytest.mark.parametrize("key", sorted(CRITIC_SETS))
def test_a_critic_option_without_a_critic_is_refused_for_a_new_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    sets = ["ppo.advantage=grpo", *GROUPED, f"ppo.{key}={CRITIC_SETS[key]}"]
    needle = (
        f"ppo.{key}={CRITIC_SETS[key]} is set but ppo.advantage=grpo has no critic and no GAE "
        "(only gae reads it)"
    )
    _refused(tmp_path, capsys, sets, needle)


@pytest.mark.parametrize("adv", CRITIC_FREE)
def test_lam_is_refused_under_every_critic_free_estimator(adv: str) -> None:
    cfg = preset("test", f"ppo.advantage={adv}", *GROUPED, "ppo.lam=0.5", "ppo.vf_coef=0.5")
    assert cfg.unread_options() == (
        f"ppo.vf_coef=0.5, ppo.lam=0.5 are set but ppo.advantage={adv} has no critic and no GAE "
        "(only gae reads them)"
    )


def test_critic_options_are_kept_under_gae() -> None:
    sets = [f"ppo.{k}={v}" for k, v in CRITIC_SETS.items()]
    assert preset("test", "ppo.advantage=gae", *sets).unread_options() is None
    assert preset("test", "ppo.advantage=rloo", *GROUPED).unread_options() is None  # all defaults


@pytest.mark.parametrize(
    "adv", ["gae", "dr-grpo", "rloo", "reinforce++-baseline", "opo", "gpg", "reinforce++"]
)
def test_group_eps_without_a_group_std_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], adv: str
) -> None:
    sets = [f"ppo.advantage={adv}", *GROUPED, "ppo.group_eps=0.0001"]
    needle = (
        f"ppo.group_eps=0.0001 is set but ppo.advantage={adv} takes no group std "
        "(only grpo, grpo-passk read it)"
    )
    _refused(tmp_path, capsys, sets, needle)


@pytest.mark.parametrize("adv", ["grpo", "grpo-passk"])
def test_group_eps_is_kept_where_a_group_std_is_read(adv: str) -> None:
    assert preset("test", f"ppo.advantage={adv}", *GROUPED, "ppo.group_eps=0.0001").unread_options() is None


def test_grpo_passk_with_singleton_score_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sets = ["ppo.advantage=grpo-passk", *GROUPED, "ppo.group_singleton=score"]
    needle = "ppo.group_singleton=score is set but ppo.advantage=grpo-passk has no second-best score"
    _refused(tmp_path, capsys, sets, needle)
    assert (
        preset("test", "ppo.advantage=grpo-passk", *GROUPED, "ppo.group_singleton=zero").unread_options()
        is None
    )


def _actor_after_one_step(tmp_path: Path, name: str, sets: list[str]) -> dict[str, object]:
    out = tmp_path / name
    Trainer(preset("test", *sets, "run.iterations=1", f"run.out_dir={out}")).train()
    return dict(load_file(out / "checkpoints" / "iter_000001" / "policy.safetensors"))


@pytest.mark.parametrize("adv", CRITIC_FREE)
def test_the_refused_options_really_are_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, adv: str
) -> None:
    """With the check off (what refppo <= 61be225 did), the keys change no bit of the actor."""
    monkeypatch.setattr(TrainConfig, "unread_options", lambda self: None)
    base = [f"ppo.advantage={adv}", *GROUPED]
    extra = [f"ppo.{k}={v}" for k, v in CRITIC_SETS.items()]
    if adv not in ("grpo", "grpo-passk"):
        extra.append("ppo.group_eps=0.5")
    a = _actor_after_one_step(tmp_path, "without", base)
    b = _actor_after_one_step(tmp_path, "with", base + extra)
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)  # type: ignore[attr-defined]


def test_group_eps_is_read_by_grpo(tmp_path: Path) -> None:
    """The comparison above can fail: under grpo a large ε does change the actor."""
    base = ["ppo.advantage=grpo", *GROUPED]
    a = _actor_after_one_step(tmp_path, "without", base)
    b = _actor_after_one_step(tmp_path, "with", [*base, "ppo.group_eps=0.5"])
    assert any(not bool((a[k] == b[k]).all()) for k in a)  # type: ignore[attr-defined]


def test_a_run_an_older_refppo_started_with_vf_coef_resumes_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unread = ("ppo.advantage=rloo", *GROUPED, "ppo.vf_coef=0.5")
    straight, split = tmp_path / "straight", tmp_path / "split"
    with monkeypatch.context() as older:  # refppo <= 61be225: no such check
        older.setattr(TrainConfig, "unread_options", lambda self: None)
        Trainer(preset("test", *unread, "run.iterations=2", f"run.out_dir={straight}")).train()
        Trainer(preset("test", *unread, "run.iterations=1", f"run.out_dir={split}")).train()
    lines: list[str] = []
    resumed = Trainer(
        preset("test", *unread, "run.iterations=2", f"run.out_dir={split}"), resume=True, echo=lines.append
    )
    assert resumed.start_iteration == 1
    assert [ln for ln in lines if "vf_coef" in ln] == [
        "warning: ppo.vf_coef=0.5 is set but ppo.advantage=rloo has no critic and no GAE "
        "(only gae reads it); "
        "resuming as the run began (it has no effect)"
    ]
    resumed.train()
    a = [deterministic(r) for r in read_metrics(straight / "metrics.jsonl")]
    b = [deterministic(r) for r in read_metrics(split / "metrics.jsonl")]
    assert [r["iteration"] for r in b] == [1, 2] and a == b


# ---- the oracle: --set / --preset / sidecar go through build_setup --------------------------------


@pytest.mark.parametrize(
    ("conv", "needle"),
    [
        (
            {"advantage": "dr-grpo", "group_std_level": "batch"},
            "group_std_level=batch is set but advantage=dr-grpo takes no group std "
            "(only grpo, grpo-passk read it)",
        ),
        (
            {"advantage": "grpo-passk", "group_singleton": "score"},
            "group_singleton=score is set but advantage=grpo-passk has no second-best score "
            "in a group of one",
        ),
    ],
)
def test_oracle_settings_refuse_what_the_estimator_ignores(conv: dict[str, str], needle: str) -> None:
    with pytest.raises(ConventionError, match=re.escape(needle)):
        setup_for(conv=conv)
    # Convention itself still builds them: --detect's walk tries such settings and discards them
    Convention.of(**{k: parse_value(k, v) for k, v in conv.items()})
    assert setup_for(conv={**conv, "advantage": "grpo"}).conv.adv.estimator.value == "grpo"


def test_refppo_diff_set_refuses_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from refppo.oracle.cli import main as diff_main

    s = setup_for()
    dump = save(tmp_path, refppo_dump(make_inputs(seed=3), s), s)
    argv = [str(dump), "--set", "advantage=rloo", "--set", "group_std_level=batch"]
    assert diff_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "group_std_level=batch is set but advantage=rloo takes no group std" in err[0], (
        err
    )
