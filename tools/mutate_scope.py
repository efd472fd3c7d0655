"""The scope of ``tools/mutate.py`` (split out of it): the modules mutated, their source files and
the test subset each mutant runs against."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT = ROOT / "tools" / "mutate_equivalent.json"
CORE = (
    "_group_checks",
    "_group_stats",
    "_ties",
    "aggregate",
    "by_rows",
    "gae",
    "grad",
    "group",
    "gspo",
    "kl",
    "logprobs",
    "masked",
    "normalize",
    "objective",
    "policy",
    "rewards",
    "score_map",
    "value",
)
PIPELINE = ("pipeline_rollout", "pipeline_update", "pipeline_blocks")
"""refppo/pipeline.py's code (it re-exports these modules' names; ``refppo.split_module``)."""
MODULES = (*CORE, *PIPELINE, "step_settings")
TOP_LEVEL = (*PIPELINE, "step_settings")
"""Modules directly under refppo/ (the others are refppo/core/); step_settings holds
``Convention`` and ``Hyperparams``, which refppo/pipeline.py re-exports."""
PIPELINE_FUNCS = {
    "value_mask",
    "reward_quantities",
    "rollout_quantities",
    "critic_free_advantages",
    "_group_scores",
    "_gae_advantages",
    "gae_by_rows",
    "Normalisers.kwargs",
    "policy_term",
    "update_quantities",
    "update_rows",
    "clipped_scores",
    "mapped_scores",
    "Convention.__post_init__",
    "Hyperparams.__post_init__",
    "ScoreMap.__post_init__",
}
NAIVE_HELPERS = {"_log_sum_exp"}
DEFAULT_CLASSES = {"Hyperparams", "Convention", "ScoreMap"}
"""step_settings.py classes whose field defaults (numeric/bool constants) are mutated too."""
# New tests that target gaps across modules (added with this tool); missing files are skipped.
GAP_TESTS = (
    "tests/unit/test_core_boundaries.py",
    "tests/unit/test_core_gradients.py",
    "tests/unit/test_core_defaults.py",
    "tests/unit/test_core_mutation_kills.py",
)
PIPELINE_TESTS = (
    "tests/unit/test_pipeline.py",
    "tests/unit/test_pipeline_normalisers.py",
    "tests/unit/test_pipeline_critic_free.py",
    "tests/unit/test_pipeline_score_map.py",
    "tests/property/test_gae_by_rows.py",
    "tests/unit/test_core_defaults.py",
    "tests/unit/test_core_boundaries.py",
    "tests/golden/test_golden_ppo.py",
    "tests/unit/test_core_mutation_kills.py",
    "tests/property/test_update_by_rows.py",
    "tests/unit/test_pipeline_memory.py",
    "tests/unit/test_by_rows_mutation_kills.py",
)
"""The oracle's tests (tests/unit/test_oracle_*.py) also go through the pipeline but take minutes
per run on a shared 2-core machine; the golden replay covers the whole iteration."""
EXTRA_TESTS: dict[str, tuple[str, ...]] = {
    "logprobs": ("tests/property/test_logprobs_chunked.py",),
    "group": ("tests/property/test_group_more_estimators.py", "tests/property/test_group_std_level.py"),
    "_group_checks": (  # group.py's input checks: group.py's tests (and the twins' refusals, below)
        "tests/unit/test_core_group.py",
        "tests/property/test_group_properties.py",
        "tests/property/test_group_more_estimators.py",
        "tests/unit/test_pipeline_singleton_error.py",
    ),
    "_group_stats": (  # group.py's batch statistics: group.py's tests
        "tests/unit/test_core_group.py",
        "tests/property/test_group_properties.py",
        "tests/property/test_group_more_estimators.py",
        "tests/property/test_group_std_level.py",
    ),
    "_ties": (  # the tie rules of grad.py's and gspo.py's gradient twins: their tests
        "tests/unit/test_core_ties.py",
        "tests/unit/test_core_grad.py",
        "tests/property/test_grad_properties.py",
        "tests/unit/test_core_gspo.py",
        "tests/property/test_gspo_properties.py",
    ),
    "kl": ("tests/property/test_kl_straight_through.py",),
    "score_map": ("tests/unit/test_pipeline_score_map.py",),
    "by_rows": (
        "tests/property/test_update_by_rows.py",
        "tests/unit/test_pipeline_memory.py",
        "tests/unit/test_by_rows_mutation_kills.py",
    ),
}
"""A core module's tests beyond ``test_core_<mod>.py`` and ``test_<mod>_properties.py``."""


def module_path(mod: str) -> Path:
    """Source file of a module short name (``kl`` → ``refppo/core/kl.py``)."""
    return ROOT / (f"refppo/{mod}.py" if mod in TOP_LEVEL else f"refppo/core/{mod}.py")


def module_name(mod: str) -> str:
    """Dotted import name of a module short name."""
    return f"refppo.{mod}" if mod in TOP_LEVEL else f"refppo.core.{mod}"


def subset(mod: str) -> list[str]:
    """The test files run against ``mod``'s mutants (those that exist)."""
    if mod in TOP_LEVEL:
        files: tuple[str, ...] = PIPELINE_TESTS
    else:
        extra = EXTRA_TESTS.get(mod, ())
        own = (f"tests/unit/test_core_{mod}.py", f"tests/property/test_{mod}_properties.py", *extra)
        files = (*own, "tests/unit/test_core_inputs.py", "tests/unit/test_core_twin_refusals.py", *GAP_TESTS)
    return [f for f in files if (ROOT / f).exists()]
