"""The typed training config (refppo.train.config) and the `refppo train` flag mapping."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
from pathlib import Path

import pytest

from refppo.conventions import KLEstimator, LossAgg, ValueClipForm
from refppo.train.cli import build_parser, resolve_config
from refppo.train.config import schema as config_schema
from refppo.train.config import sections as config_sections
from refppo.train.config.schema import TrainConfig, load_config
from refppo.train.config.sections import ConfigError


def test_defaults_roundtrip_through_dict_and_json() -> None:
    cfg = TrainConfig()
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    d = cfg.to_dict()
    assert d["ppo"]["loss_agg"] == "token-mean"  # enum as its name, convention flattened into [ppo]
    assert d["ppo"]["cliprange"] == 0.2  # Hyperparams flattened into [ppo]
    assert '"ppo"' in cfg.to_json()


def test_toml_file_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text(
        textwrap.dedent(
            """
            [ppo]
            cliprange = 0.1
            loss_agg = "seq-mean-token-sum"
            epochs = 2
            [rollout]
            batch_size = 32
            [task]
            prompt_words = [1, 3]
            """
        )
    )
    cfg = load_config(
        f, ["ppo.kl_estimator=k3", "ppo.cliprange=0.3", "run.out_dir=runs/x y", "ppo.max_grad_norm=none"]
    )
    assert cfg.ppo.hp.cliprange == 0.3  # --set wins over the file
    assert cfg.ppo.convention.agg.loss is LossAgg.SEQ_MEAN_TOKEN_SUM
    assert cfg.ppo.convention.kl.estimator is KLEstimator.K3
    assert cfg.ppo.epochs == 2 and cfg.rollout.batch_size == 32
    assert cfg.task.prompt_words == (1, 3)
    assert cfg.run.out_dir == "runs/x y"
    assert cfg.ppo.max_grad_norm is None
    assert cfg.rollout.use_cache is True
    assert load_config(f, ["rollout.use_cache=false"]).rollout.use_cache is False


def test_int_accepted_for_float_and_tuple_of_optionals() -> None:
    cfg = TrainConfig().with_overrides(["optimizer.lr=1", "ppo.kl_log_ratio_clamp=[-2, 3.5]"])
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.ppo.convention.kl.log_ratio_clamp == (-2.0, 3.5)


@pytest.mark.parametrize(
    ("override", "wanted"),
    [
        ("ppo.clipange=0.1", "unknown key 'clipange' in [ppo]; did you mean 'cliprange'"),
        ("rollout.kl_coef=0.1", "unknown key 'kl_coef' in [rollout]; did you mean ppo.kl_coef?"),
        ("cliprange=0.1", "--set 'cliprange=0.1': expected SECTION.KEY=VALUE (e.g. ppo.cliprange=0.1); "
         "did you mean ppo.cliprange?"),
        ("ppoo.cliprange=0.1", "unknown config section 'ppoo'; did you mean 'ppo'?"),
    ],
)  # fmt: skip
def test_a_set_typo_gets_a_short_did_you_mean(override: str, wanted: str) -> None:
    """A typo names the closest key (or the section that holds it) in one short line, not every key
    of the section (720 characters for [ppo] before)."""
    with pytest.raises(ConfigError) as err:
        TrainConfig().with_overrides([override])
    text = str(err.value)
    assert wanted in text, text
    assert len(text) < 200 and "\n" not in text, text
    assert "value_clip_form" not in text  # not the list of [ppo]'s keys


def test_unknown_key_without_a_close_one_points_at_the_key_list() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'zzzz' in \[ppo\] \(refppo train --help-config ppo"):
        TrainConfig().with_overrides(["ppo.zzzz=1"])
    with pytest.raises(
        ConfigError, match=r"unknown keys \['lrr'\] in \[optimizer\] \('lrr': did you mean 'lr'\?\)"
    ):
        TrainConfig.from_dict({"optimizer": {"lrr": 1.0}})


def test_unknown_section_lists_sections(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"valid sections are .*'ppo'"):
        TrainConfig().with_overrides(["trainer.lr=1"])
    f = tmp_path / "bad.toml"
    f.write_text("[optim]\nlr = 1.0\n")
    with pytest.raises(ConfigError, match="unknown config sections \\['optim'\\]"):
        load_config(f)


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("ppo.epochs=1.5", "expected an integer"),
        ("run.progress=1", "expected true/false"),
        ("ppo.loss_agg=mean", "valid names are 'token-mean'"),
        ("ppo.gamma=1.5", "gamma: expected a number in"),
        ("ppo.dual_clip=0.5", "dual_clip"),
        ("optimizer.lr=-1", "must be > 0"),
        ("model.device=tpu", "model.device"),
        ("task.reward=nonsense", "module:function"),
        ("ppo.cliprange", "SECTION.KEY=VALUE"),
    ],
)
def test_bad_values_raise_config_error(override: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        TrainConfig().with_overrides([override])


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    f = tmp_path / "broken.toml"
    f.write_text("[ppo\n")
    with pytest.raises(ConfigError, match=r"broken\.toml"):
        load_config(f)


def test_uneven_splits_fail_loudly() -> None:
    with pytest.raises(ConfigError, match=r"ppo\.minibatches=4 equal minibatches"):
        TrainConfig().with_overrides(["rollout.batch_size=30"])
    with pytest.raises(ConfigError, match=r"ppo\.micro_batches=3"):
        TrainConfig().with_overrides(["ppo.micro_batches=3"])  # 64/4 = 16 rows, not divisible by 3
    cfg = TrainConfig().with_overrides(["rollout.batch_size=48", "ppo.minibatches=4"])
    cfg.check_world_size(2)  # 24 per rank, 6 per minibatch: fine
    with pytest.raises(ConfigError, match="does not split evenly over 5 ranks"):
        cfg.check_world_size(5)
    cfg.check_world_size(4)  # 12 per rank, 3 per minibatch: fine
    with pytest.raises(ConfigError, match=r"per-rank batch 6 .* ppo\.minibatches=4"):
        cfg.check_world_size(8)  # 6 per rank does not split into 4 minibatches


def test_derived_sizes() -> None:
    cfg = TrainConfig().with_overrides(["rollout.batch_size=64", "ppo.minibatches=4", "ppo.micro_batches=2"])
    assert cfg.minibatch_size(1) == 16 and cfg.micro_batch_size(1) == 8
    assert cfg.minibatch_size(2) == 8 and cfg.micro_batch_size(2) == 4


def test_every_field_has_a_docstring() -> None:
    """CleanRL style: a string literal right under every field of every section."""
    sections = [
        c
        for mod in (config_sections, config_schema)
        for _, c in inspect.getmembers(mod, inspect.isclass)
        if dataclasses.is_dataclass(c) and c.__module__ == mod.__name__
    ]
    assert len(sections) >= 8
    for cls in sections:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        body = tree.body[0].body  # type: ignore[attr-defined]  # a ClassDef: ast stubs type body loosely
        documented = {
            stmt.target.id
            for stmt, nxt in itertools.pairwise(body)
            if isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        }
        missing = {f.name for f in dataclasses.fields(cls)} - documented
        assert not missing, f"{cls.__name__}: fields without a docstring: {sorted(missing)}"


def test_cli_flags_map_onto_config_and_set_wins() -> None:
    args = build_parser().parse_args(
        [
            "--model", "/some/dir", "--reward", "pkg.mod:fn", "--device", "cpu", "--iterations", "7",
            "--seed", "3", "--out", "/tmp/o", "--no-progress", "--set", "run.seed=5",
        ]
    )  # fmt: skip
    cfg = resolve_config(args)
    assert cfg.model.policy == "/some/dir" and cfg.task.sft_steps == 0
    assert cfg.task.reward == "pkg.mod:fn"
    assert cfg.model.device == "cpu" and cfg.run.iterations == 7 and cfg.run.out_dir == "/tmp/o"
    assert cfg.run.progress is False
    assert cfg.run.seed == 5  # --set is applied after the dedicated flags
    assert resolve_config(build_parser().parse_args(["--prompts", "/p.txt"])).task.prompts_file == "/p.txt"
    rm = resolve_config(build_parser().parse_args(["--reward-model", "/rm"]))
    assert rm.model.reward_model == "/rm" and rm.task.reward == "model"


def test_print_config_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from refppo.train.cli import main

    assert main(["--print-config", "--set", "ppo.cliprange=0.15"]) == 0
    assert '"cliprange": 0.15' in capsys.readouterr().out
    assert main(["--set", "ppo.nope=1"]) == 2
    assert "unknown key 'nope' in [ppo]" in capsys.readouterr().err


def test_value_loss_agg_from_toml_and_set(tmp_path: Path) -> None:
    assert TrainConfig().ppo.convention.agg.value is None  # default: follows ppo.loss_agg
    f = tmp_path / "v.toml"
    f.write_text('[ppo]\nloss_agg = "seq-mean-token-mean"\nvalue_loss_agg = "token-mean"\n')
    cfg = load_config(f)
    assert cfg.ppo.convention.agg.loss is LossAgg.SEQ_MEAN_TOKEN_MEAN
    assert cfg.ppo.convention.agg.value is LossAgg.TOKEN_MEAN
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert load_config(f, ["ppo.value_loss_agg=none"]).ppo.convention.agg.value is None
    over = TrainConfig().with_overrides(["ppo.value_loss_agg=seq-mean-token-sum"])
    assert over.ppo.convention.agg.value is LossAgg.SEQ_MEAN_TOKEN_SUM
    with pytest.raises(ConfigError, match="value_loss_agg"):
        TrainConfig().with_overrides(["ppo.value_loss_agg=mean"])


def test_value_clip_form_from_toml_and_set(tmp_path: Path) -> None:
    # A Convention field is a [ppo] key like the others (the config flattens Convention).
    assert TrainConfig().ppo.convention.value.clip_form is ValueClipForm.AROUND_OLD
    assert TrainConfig().to_dict()["ppo"]["value_clip_form"] == "around_old"
    f = tmp_path / "c.toml"
    f.write_text('[ppo]\nvalue_clip_form = "delta"\n')
    assert load_config(f).ppo.convention.value.clip_form is ValueClipForm.DELTA
    over = TrainConfig().with_overrides(["ppo.value_clip_form=delta"])
    assert over.ppo.convention.value.clip_form is ValueClipForm.DELTA
    with pytest.raises(
        ConfigError, match="value_clip_form: unknown name 'clamp'; valid names are 'around_old', 'delta'"
    ):
        TrainConfig().with_overrides(["ppo.value_clip_form=clamp"])


def test_peer_convention_fields_from_toml_and_set(tmp_path: Path) -> None:
    # The conventions added for the peers (issue #9) are [ppo] keys like the others.
    from refppo.conventions import GaePadding, WhitenEps, Whitening

    f = tmp_path / "c.toml"
    f.write_text(
        '[ppo]\ngae_padding = "through"\nwhiten_eps_at = "std"\nwhiten_rewards = "masked_no_shift"\n'
        'kl_loss_agg = "seq-mean-token-mean"\nwhiten_advantages = "center"\n'
    )
    conv = load_config(f).ppo.convention
    assert conv.adv.gae_padding is GaePadding.THROUGH and conv.norm.eps_at is WhitenEps.STD
    assert conv.reward.whiten is Whitening.MASKED_NO_SHIFT and conv.whiten.advantages is Whitening.CENTER
    assert conv.agg.kl is LossAgg.SEQ_MEAN_TOKEN_MEAN and conv.agg.entropy is None
    over = TrainConfig().with_overrides(["ppo.entropy_agg=token-mean", "ppo.loss_agg=token-sum"])
    assert over.ppo.convention.agg.entropy is LossAgg.TOKEN_MEAN
    assert over.ppo.convention.agg.loss is LossAgg.TOKEN_SUM
    with pytest.raises(ConfigError, match="gae_padding"):
        TrainConfig().with_overrides(["ppo.gae_padding=sometimes"])
