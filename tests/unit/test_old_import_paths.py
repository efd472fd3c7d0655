"""The old single-file modules split into packages (refppo.train, refppo.config, refppo.models,
refppo.golden, refppo.verify) keep their import paths: every public name of release 648bff8's modules
(listed here from that release's source, ``__all__`` or its public top-level defs) still imports.
Before the shims ``refppo.train_cli``, ``refppo.train_dump`` and ``refppo.config_doc`` raised
ModuleNotFoundError."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

OLD_API: dict[str, tuple[str, ...]] = {
    "refppo.config": (
        "ConfigError",
        "KLConfig",
        "ModelConfig",
        "OptimizerConfig",
        "PPOConfig",
        "RolloutConfig",
        "RunConfig",
        "TaskConfig",
        "TrainConfig",
        "load_config",
    ),
    "refppo.config_doc": ("config_keys", "describe_config", "field_docs", "plain", "sections"),
    "refppo.golden": (
        "CASES",
        "CPU_REPLAY",
        "CUDA_REPLAY",
        "GoldenCase",
        "NAIVE",
        "SCHEMA_VERSION",
        "Tolerances",
        "Trajectory",
        "build",
        "compare",
        "load",
        "max_deviations",
        "run",
        "save",
        "variant",
    ),
    "refppo.models": (
        "Critic",
        "RewardModel",
        "RewardModelError",
        "SequenceBatch",
        "eval_mode",
        "last_valid_index",
        "left_pad",
        "load_actor",
        "load_critic",
        "load_reference",
        "load_reward_model",
        "make_reference",
        "position_ids_from_mask",
        "response_logits",
        "response_logprobs",
        "response_slice",
        "response_values",
        "reward_scores",
        "right_pad",
        "sequence_logits",
        "tiny_actor",
        "tiny_config",
        "tiny_critic",
        "tiny_gpt2",
        "tiny_llama",
        "tiny_reward_model",
        "value_positions",
    ),
    "refppo.models_naive": (
        "prefix_logits",
        "prefix_value",
        "response_logprobs_naive",
        "response_values_naive",
        "reward_scores_naive",
    ),
    "refppo.train_cli": ("build_parser", "main", "resolve_config"),
    "refppo.train_dump": ("dump_path", "request"),
    "refppo.trainer": (
        "DistContext",
        "Trainer",
        "TrainingError",
        "init_distributed",
        "load_reward_function",
        "run",
        "shutdown_distributed",
        "text_reward",
    ),
    "refppo.verify": (
        "CASES",
        "Comparison",
        "Row",
        "TOLERANCES",
        "Tolerance",
        "compare",
        "main",
        "tolerance_for",
    ),
}


@pytest.mark.parametrize("module", sorted(OLD_API))
def test_old_module_path_keeps_its_public_names(module: str) -> None:
    mod = importlib.import_module(module)
    missing = [name for name in OLD_API[module] if not hasattr(mod, name)]
    assert missing == [], f"{module} lost {missing}"


def test_python_m_refppo_train_cli_still_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "refppo.train_cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--set" in out.stdout
