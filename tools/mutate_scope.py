"""The scope of ``tools/mutate.py`` (split out of it): the modules mutated, their source files and
the test subset each mutant runs against."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT = ROOT / "tools" / "mutate_equivalent.json"
CORE = (
    "approx_kl",
    "moments_memo",
    "_group_checks",
    "_group_stats",
    "_ties",
    "aggregate",
    "by_rows",
    "cispo",
    "clipfrac",
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
    "rollout_correction",
    "rollout_losses",
    "score_map",
    "value",
)
PIPELINE = (
    "rollout",
    "update",
    "correction",
    "blocks",
    "stages",
    "step",
    "groups",
    "groups_gate",
    "groups_update",
    "row_subset",
)
"""The modules of refppo/pipeline/ that compose the core (the stage functions, the table, its walks)."""
MODULES = (*CORE, *PIPELINE, "settings")
TOP_LEVEL = (*PIPELINE, "settings")
"""Modules of refppo/pipeline/ (the others are refppo/core/); settings holds ``Convention`` and
``Hyperparams``, groups the Convention's groups (``ScoreMap``, ``PolicyConvention``, ...)."""
PIPELINE_FUNCS = {
    "value_mask",
    "score_map_stage",
    "kl_stage",
    "value_mask_stage",
    "rewards_stage",
    "reward_whitening_stage",
    "advantages_stage",
    "whitening_stage",
    "critic_free_advantages",
    "_group_scores",
    "_gae_advantages",
    "gae_by_rows",
    "Normalisers.kwargs",
    "update_rows",
    "policy_token_loss",
    "cispo_token_loss",
    "policy_term",
    "clip_ratio",
    "rollout_logprobs_of",
    "rollout_correction_stage",
    "weighted",
    "policy_stage",
    "aggregate",
    "policy_agg_stage",
    "approx_kl_stage",
    "value_stage",
    "value_agg_stage",
    "entropy_stage",
    "kl_loss_stage",
    "kl_metric_stage",
    "total_stage",
    "walk",
    "Stage.run",
    "Stage.key",
    "Stage.reads_now",
    "_reward_reads",
    "_reward_whitening_reads",
    "_advantage_reads",
    "_whitening_reads",
    "upstream",
    "reward_quantities",
    "rollout_quantities",
    "_rollout_result",
    "update_inputs",
    "update_quantities",
    "AggConvention.of",
    "Convention.__post_init__",
    "Hyperparams.__post_init__",
    "ScoreMap.__post_init__",
    "KLConvention.__post_init__",
    "AdvantageConvention.__post_init__",
    "PolicyConvention.__post_init__",
    # this batch's (23) new pipeline functions: score_slot_kl, gae_bootstrap, the rejection gate
    "slot_kl_on",
    "gae_last_values",
    "gate_keep",
    "gate_statistic_of",
    "RolloutGate.__post_init__",
    # batch 24's new pipeline functions: the rows kept out of the loss, the rollout_rs drop mask,
    # the counted clip fraction, prompt-mean aggregation
    "rows_in_loss",
    "whole_normalisers",
    "kept_rows",
    "take_rows",
    "put_rows",
    "rollout_gate_stage",
    "gate_masks",
    "_none_left",
    "group_advantages_on_every_row",  # round 2: group estimators read every row under drop_mask
    "recounts",
    "clip_band",
    "counted_clipfrac",
    "Normalisers.prompts",
    "_in_loss",
    "_scattered",
    "AggConvention.__post_init__",
}
NAIVE_HELPERS = {"_log_sum_exp"}
DEFAULT_CLASSES = {
    "Hyperparams",
    "ScoreMap",
    "KLConvention",
    "RewardConvention",
    "NormConvention",
    "AdvantageConvention",
    "WhitenConvention",
    "PolicyConvention",
    "AggConvention",
    "ValueConvention",
}
"""settings.py / groups.py classes whose field defaults (numeric/bool constants) are mutated too."""
# New tests that target gaps across modules (added with this tool); missing files are skipped.
GAP_TESTS = (
    "tests/core/test_core_boundaries.py",
    "tests/core/test_core_gradients.py",
    "tests/core/test_core_defaults.py",
    "tests/core/test_core_mutation_kills.py",
    "tests/core/test_core_mutation_kills_20.py",
    "tests/core/test_core_mutation_kills_23.py",
    "tests/core/test_core_mutation_kills_24.py",
)
PIPELINE_TESTS = (
    "tests/pipeline/test_pipeline.py",
    "tests/pipeline/test_pipeline_normalisers.py",
    "tests/pipeline/test_pipeline_critic_free.py",
    "tests/pipeline/test_pipeline_score_map.py",
    "tests/core/test_gae_by_rows.py",
    "tests/core/test_core_defaults.py",
    "tests/core/test_core_boundaries.py",
    "tests/golden/test_golden_ppo.py",
    "tests/core/test_core_mutation_kills.py",
    "tests/pipeline/test_update_by_rows.py",
    "tests/pipeline/test_pipeline_memory.py",
    "tests/core/test_by_rows_mutation_kills.py",
    "tests/pipeline/test_stages.py",
    "tests/pipeline/test_stage_functions_pinned.py",
    "tests/pipeline/test_pipeline_kl_metric.py",
    "tests/pipeline/test_pipeline_policy_helpers.py",
    "tests/oracle/test_oracle_decoupled_cispo.py",
    "tests/oracle/test_oracle_rollout_correction.py",
    "tests/core/test_gae_bootstrap.py",  # the advantages stage's bootstrap (gae_bootstrap)
    "tests/core/test_score_slot_kl.py",  # the rewards stage's score_slot_kl
    "tests/pipeline/test_pipeline_gates.py",  # the rollout_correction stage, groups_gate
    "tests/pipeline/test_kl_both.py",  # kl_in=both
    "tests/pipeline/test_pipeline_mutation_kills_23.py",
    "tests/pipeline/test_loss_rows.py",  # rows kept out of the loss (row_subset, step._in_loss)
    "tests/pipeline/test_prompt_mean_agg.py",  # loss_agg=prompt_mean (Normalisers.prompts, aggregate)
    "tests/pipeline/test_rollout_rs_drop.py",  # the rollout_gate stage's drop mask
    "tests/pipeline/test_rollout_rs_drop_groups.py",  # group estimators under drop_mask (row_subset)
    "tests/pipeline/test_kl_both_separate.py",  # kl_in=both with its own beta/estimator
    "tests/pipeline/test_pipeline_mutation_kills_24.py",
)
"""The oracle's tests (tests/oracle/test_oracle_*.py) also go through the pipeline but take minutes
per run on a shared 2-core machine; the golden replay covers the whole iteration."""
EXTRA_TESTS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("policy", "gspo", "value"), ("tests/core/test_core_token_losses.py",)),
    "logprobs": ("tests/core/test_logprobs_chunked.py",),
    "group": ("tests/core/test_group_more_estimators.py", "tests/core/test_group_std_level.py"),
    "_group_checks": (  # group.py's input checks: group.py's tests (and the twins' refusals, below)
        "tests/core/test_core_group.py",
        "tests/core/test_group_properties.py",
        "tests/core/test_group_more_estimators.py",
        "tests/pipeline/test_pipeline_singleton_error.py",
    ),
    "_group_stats": (  # group.py's batch statistics: group.py's tests
        "tests/core/test_core_group.py",
        "tests/core/test_group_properties.py",
        "tests/core/test_group_more_estimators.py",
        "tests/core/test_group_std_level.py",
    ),
    "_ties": (  # the tie rules of grad.py's and gspo.py's gradient twins: their tests
        "tests/core/test_core_ties.py",
        "tests/core/test_core_grad.py",
        "tests/core/test_grad_properties.py",
        "tests/core/test_core_gspo.py",
        "tests/core/test_gspo_properties.py",
    ),
    "kl": ("tests/core/test_kl_straight_through.py", "tests/core/test_kl_is_weight.py"),
    **dict.fromkeys(("objective", "grad"), ("tests/core/test_kl_is_weight.py",)),  # grad_is_clip
    "gae": ("tests/core/test_gae_bootstrap.py",),
    "rewards": ("tests/core/test_score_slot_kl.py",),
    # prompt_mean_masked: the pipeline's prompt-mean tests
    "aggregate": ("tests/core/test_prompt_mean.py", "tests/pipeline/test_prompt_mean_agg.py"),
    "clipfrac": ("tests/core/test_clipfrac_row_mean.py",),  # the row mean (its counts: test_core_clipfrac.py)
    "masked": ("tests/core/test_kept_rows.py",),
    "approx_kl": ("tests/core/test_approx_kl_clamped.py",),
    "moments_memo": ("tests/core/test_moments_memo_bounds.py", "tests/core/test_core_normalize.py"),
    "score_map": ("tests/pipeline/test_pipeline_score_map.py",),
    **dict.fromkeys(  # the rollout correction's weights, gates and surrogates (CISPO too): one suite
        ("rollout_correction", "rollout_losses", "cispo"),
        (
            "tests/core/test_rollout_correction_truth.py",
            "tests/core/test_rollout_correction_inputs.py",
            "tests/core/test_rollout_correction_properties.py",
            "tests/core/test_rollout_losses_properties.py",
            "tests/core/test_core_mutation_kills_rollout.py",
            "tests/pipeline/test_pipeline_gates.py",  # gate_statistic through the stage
        ),
    ),
    "by_rows": (
        "tests/pipeline/test_update_by_rows.py",
        "tests/pipeline/test_pipeline_memory.py",
        "tests/core/test_by_rows_mutation_kills.py",
    ),
}
"""A core module's tests beyond ``test_core_<mod>.py`` and ``test_<mod>_properties.py``."""


def module_path(mod: str) -> Path:
    """Source file of a module short name (``kl`` → ``refppo/core/kl.py``, ``update`` →
    ``refppo/pipeline/update.py``)."""
    return ROOT / (f"refppo/pipeline/{mod}.py" if mod in TOP_LEVEL else f"refppo/core/{mod}.py")


def module_name(mod: str) -> str:
    """Dotted import name of a module short name."""
    return f"refppo.pipeline.{mod}" if mod in TOP_LEVEL else f"refppo.core.{mod}"


def subset(mod: str) -> list[str]:
    """The test files run against ``mod``'s mutants (those that exist)."""
    if mod in TOP_LEVEL:
        files: tuple[str, ...] = PIPELINE_TESTS
    else:
        extra = EXTRA_TESTS.get(mod, ())
        own = (f"tests/core/test_core_{mod}.py", f"tests/core/test_{mod}_properties.py", *extra)
        files = (*own, "tests/core/test_core_inputs.py", "tests/core/test_core_twin_refusals.py", *GAP_TESTS)
    return [f for f in dict.fromkeys(files) if (ROOT / f).exists()]  # each once, in order
