"""The stage table: ONE typed description of the PPO step that every consumer walks.

Each :class:`Stage` names the flat convention keys (and so the :class:`Convention` groups) and the
:class:`Hyperparams` fields it reads, the quantities it reads and makes, its vectorized function, its
naive twin (plain loops on the core's naive twins) and how it may be evaluated (by row blocks
without autograd, with the global normalisers of a split step, as a collective under an
all-reduce). :data:`STAGES` is the pipeline order; :func:`walk` runs a sequence of stages on a dict
of quantities. The trainer's iteration and update, the oracle's recompute, the diagnosis, the
naive whole-step twin and the goldens run the step through it (:mod:`refppo.pipeline.step`).

==================  ===================================  ====================================
stage               reads                                makes
==================  ===================================  ====================================
score_map           scores                               mapped_scores
kl                  old_logprobs, ref_logprobs, mask     kl
value_mask          mask                                 value_mask
rewards             mapped_scores, kl, mask              token_rewards_raw
reward_whitening    token_rewards_raw, value_mask        token_rewards
rollout_gate        old_logprobs, rollout_logprobs, …    mask, value_mask
advantages          token_rewards, old_values, …         advantages_raw, returns
whitening           advantages_raw, mask                 advantages
rollout_correction  old_logprobs, rollout_logprobs, …    is_weights, is_keep, mask, value_mask
policy              logprobs, old_logprobs, advantages   pg_per_token, ratio, pg_clipfrac, …
policy_agg          pg_per_token, mask                   pg_loss
approx_kl           pg_approx_kl, logprobs, …            approx_kl
value               values, old_values, returns, …       vf_per_token, vf_clipfrac, vf_loss_mask
value_agg           vf_per_token, vf_loss_mask           vf_loss
entropy             entropy, mask                        entropy_loss
kl_loss             logprobs, ref_logprobs, mask         kl_loss
kl_metric           kl_loss, logprobs, ref_logprobs, …   kl_metric
total               pg_loss, vf_loss, entropy_loss, …    loss
grads               loss, logprobs, values, masks        grad_logprobs, grad_values
==================  ===================================  ====================================

(spec/ppo.md: the full table with keys and functions, checked against :data:`STAGES` by a test.) One
stage alone: ``stage.run(q, conv.with_updates(...), hp, ev)``, ``q`` holding what it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from refppo.conventions import AdvantageEstimator, Whitening
from refppo.pipeline import correction as rcs
from refppo.pipeline import grad_naive as gn
from refppo.pipeline import naive as nv
from refppo.pipeline import naive_update as nu
from refppo.pipeline import needs as nd
from refppo.pipeline import rollout as ro
from refppo.pipeline import update as up
from refppo.pipeline.blocks import Evaluation
from refppo.pipeline.row_subset import group_advantages_on_every_row, kept_rows, put_rows, take_rows
from refppo.pipeline.settings import FLAT, HPARAM_KEYS, Convention, Hyperparams

StageFn = Callable[[Mapping[str, Any], Convention, Hyperparams, Evaluation], Mapping[str, Any]]
"""``fn(q, conv, hp, ev) -> {quantity: tensor or None}``: a stage's function."""


@dataclass(frozen=True)
class Stage:
    """One stage of the PPO step (module docstring)."""

    name: str
    phase: Literal["rollout", "update", "grad"]
    """``rollout``: once per rollout (steps 0–4); ``update``: per (micro-)batch (steps 5–9);
    ``grad``: the update's gradient (by autograd: the update stages walked with ``logprobs`` and
    ``values`` requiring a gradient)."""
    keys: tuple[str, ...]
    """The flat convention keys it may read (:data:`refppo.pipeline.settings.FLAT`)."""
    hparams: tuple[str, ...]
    """The :class:`Hyperparams` fields it may read."""
    reads: tuple[str, ...]
    """The quantities it reads (inputs of the step, or what an earlier stage makes; some may be
    None: no critic, no ``group_index``, no entropy)."""
    makes: tuple[str, ...]
    """The quantities it makes."""
    fn: StageFn = field(repr=False)
    """The vectorized function."""
    naive: StageFn = field(repr=False)
    """The naive twin (Python floats on the core's ``*_naive`` twins; ``ev`` unused)."""
    core: str = ""
    """The core (or pipeline) functions it calls, for the stage table of spec/ppo.md."""
    by_rows: bool = False
    """Evaluated by blocks of ``ev.rows`` rows when set (no autograd graph): the same values."""
    normalisers: bool = False
    """Reads ``ev.norm`` (the step's global token / sequence counts)."""
    collective: bool = False
    """Reads ``ev.all_reduce`` (a collective: every rank must run it)."""
    active: Callable[[Convention], tuple[str, ...]] | None = field(default=None, repr=False)
    """The keys and hyperparameters it reads under a given convention (a subset of
    ``keys + hparams``: an estimator reads only its own options); None: all of them."""
    output_reads: Mapping[str, tuple[str, ...]] = field(default_factory=dict, repr=False)
    """For an output that depends on part of :attr:`reads` only: that part (the policy stage's
    ``ratio`` and masked ``mean(l^old − l)`` read no advantages)."""
    output_keys: Mapping[str, tuple[str, ...]] = field(default_factory=dict, repr=False)
    """For an output that depends on part of :attr:`keys` + :attr:`hparams` only: that part (the
    policy stage's unclamped ``mean(l^old − l)`` reads no clip range)."""
    needs: Callable[[Convention, Hyperparams], nd.Needs] | None = field(default=None, repr=False)
    """What it cannot run without under a given setting: ``{optional input of :attr:`reads`, or
    hyperparameter of :attr:`hparams`: the setting that reads it}`` (:mod:`refppo.pipeline.needs`:
    ``ref_logprobs`` for the KL in the reward with β > 0, ``rollout_logprobs`` with the rollout
    correction on, γ/λ for GAE, ε_v with a critic, ...); None: nothing."""

    def __post_init__(self) -> None:
        bad = [k for k in self.keys if k not in FLAT] + [h for h in self.hparams if h not in HPARAM_KEYS]
        if bad:
            raise ValueError(f"stage {self.name}: unknown convention keys or hyperparameters {bad}")

    @property
    def rewrites(self) -> bool:
        """It makes a quantity it reads (a new ``mask``: the gate under ``rollout_rs_effect=drop_mask``)."""
        return bool(set(self.makes) & set(self.reads))

    @property
    def groups(self) -> tuple[str, ...]:
        """The :class:`Convention` groups its keys belong to, in order."""
        return tuple(dict.fromkeys(FLAT[k].group for k in self.keys))

    def reads_now(self, conv: Convention) -> tuple[str, ...]:
        """The keys and hyperparameters it reads under ``conv`` (:attr:`active`)."""
        return (*self.keys, *self.hparams) if self.active is None else self.active(conv)

    def key(self, conv: Convention, hp: Hyperparams) -> tuple[Any, ...]:
        """The values of what it reads under ``conv``/``hp``: two settings with the same key make the
        same outputs from the same inputs."""
        out: list[Any] = [self.name]
        for name in self.reads_now(conv):
            out.append((name, conv.get(name) if name in FLAT else getattr(hp, name)))
        return tuple(out)

    def run(
        self, q: Mapping[str, Any], conv: Convention, hp: Hyperparams, ev: Evaluation | None = None, *,
        naive: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """This stage alone: its outputs from ``q`` (which holds what it reads); ``ev`` None: the
        whole batch, local normalisers, one process."""
        out = dict((self.naive if naive else self.fn)(q, conv, hp, ev or Evaluation()))
        if set(out) != set(self.makes):
            raise RuntimeError(f"stage {self.name} made {sorted(out)}, declares {sorted(self.makes)}")
        return out


def walk(
    stages: Sequence[Stage],
    q: Mapping[str, Any],
    conv: Convention,
    hp: Hyperparams,
    ev: Evaluation | None = None,
    *,
    keep: Collection[str] | None = None,
    naive: bool = False,
) -> dict[str, Any]:
    """Run ``stages`` in order on the quantities ``q``; returns ``q`` with every quantity made.

    A stage whose outputs are all in ``q`` already is not run (an upstream result reused: the same
    call made it), unless it rewrites what it reads (the rejection gate's ``mask``: idempotent). Rows
    that such a rewrite leaves without a valid token are taken out of the stages after it
    (:mod:`refppo.pipeline.row_subset`; a group estimator's advantages first, on every row).
    ``keep``: after each stage, drop every quantity that neither a later stage reads nor ``keep`` names
    (None: keep everything).
    ``naive``: each stage's naive twin instead of its function.
    """
    out = dict(q)
    later: list[set[str]] = [set()] * len(stages)
    for i in range(len(stages) - 2, -1, -1):
        later[i] = later[i + 1] | set(stages[i + 1].reads)
    for i, st in enumerate(stages):
        before, rest = ({k: out[k] for k in st.makes if k in out} if st.rewrites else {}), stages[i + 1 :]
        if st.rewrites or not all(k in out for k in st.makes):
            out.update(st.run(out, conv, hp, ev, naive=naive))
        group_advantages_on_every_row(rest, out, before, conv, hp, ev, naive=naive)  # drop_mask: every row
        rows = kept_rows(out) if st.rewrites else None
        if rows is not None:  # the gate emptied rows: the rest walks the others (pipeline.row_subset)
            sub = walk(rest, take_rows(out, rows), conv, hp, ev, keep=keep, naive=naive)
            put_rows(out, sub, rows, [k for s in rest for k in s.makes])
            return out if keep is None else {k: v for k, v in out.items() if k in keep}
        if keep is not None:
            for name in [k for k in out if k not in keep and k not in later[i]]:
                del out[name]
    return out


_KL_KEYS = ("kl_estimator", "kl_log_ratio_clamp", "kl_value_clamp")
_KL_LOSS_KEYS = ("kl_loss_estimator", "kl_loss_log_ratio_clamp", "kl_loss_value_clamp")


def _reward_reads(conv: Convention) -> tuple[str, ...]:
    beta = ("kl_coef",) if conv.kl.placement.in_reward else ()
    slot = conv.reward.score_at.value != "last_valid" and conv.kl.placement.in_reward
    return ("score_at", "kl_in", "score_slot_kl", *beta, *(_KL_KEYS if slot else ()))


def _reward_whitening_reads(conv: Convention) -> tuple[str, ...]:
    if conv.reward.whiten is Whitening.NONE:
        return ("whiten_rewards",)
    return ("whiten_rewards", "whiten_variance", "whiten_eps_at", "whiten_eps")


_GROUP_KEYS = ("group_std", "group_std_level", "group_singleton", "group_kl", "group_eps", "kl_in")


def _advantage_reads(conv: Convention) -> tuple[str, ...]:
    est = conv.adv.estimator
    if est is AdvantageEstimator.GAE:
        return ("advantage", "gae_padding", "gae_holes", "gae_bootstrap", "gamma", "lam")
    if est is AdvantageEstimator.REINFORCE_PP:
        return ("advantage", "gae_holes", "gamma")
    return ("advantage", *_GROUP_KEYS, "kl_coef")


def _whitening_reads(conv: Convention) -> tuple[str, ...]:
    if conv.whiten.advantages is Whitening.NONE:
        return ("whiten_advantages", "whiten_holes")
    return ("whiten_advantages", "whiten_holes", "whiten_variance", "whiten_eps_at", "whiten_eps")


_GATE_READS = ("old_logprobs", "rollout_logprobs", "mask", "value_mask")
_GATE_MASK_READS = {"mask": ("old_logprobs", "rollout_logprobs", "mask")}  # no value mask: a graph walk
"""(resolving a read by its first maker) would loop ``mask`` ← ``value_mask`` ← ``mask``."""

_ROLLOUT = (
    Stage(
        "score_map", "rollout", ("score_bias", "score_scale", "score_clip"), (), ("scores",),
        ("mapped_scores",), ro.score_map_stage, nv.score_map_naive, "core.score_map.map_scores",
    ),
    Stage(
        "kl", "rollout", ("kl_estimator", "kl_log_ratio_clamp", "kl_value_clamp"), (),
        ("old_logprobs", "ref_logprobs", "mask"), ("kl",), ro.kl_stage, nv.kl_naive, "core.kl.token_kl",
        needs=nd.kl_needs,
    ),
    Stage(
        "value_mask", "rollout", ("score_at",), (), ("mask",), ("value_mask",), ro.value_mask_stage,
        nv.value_mask_naive_stage, "pipeline.rollout.value_mask",
    ),
    Stage(
        "rewards", "rollout", ("score_at", "kl_in", "score_slot_kl", *_KL_KEYS), ("kl_coef",),
        ("mapped_scores", "kl", "mask", "value_mask", "old_logprobs", "ref_logprobs"),
        ("token_rewards_raw",), ro.rewards_stage, nv.rewards_naive, "core.rewards.token_rewards",
        active=_reward_reads, needs=nd.rewards_needs,
    ),
    Stage(
        "reward_whitening", "rollout", ("whiten_rewards", "whiten_variance", "whiten_eps_at"),
        ("whiten_eps",), ("token_rewards_raw", "value_mask"), ("token_rewards",),
        ro.reward_whitening_stage, nv.reward_whitening_naive, "core.normalize.normalize",
        collective=True, active=_reward_whitening_reads,
    ),
    Stage(
        "rollout_gate", "rollout", rcs.RS_KEYS, (), _GATE_READS, ("mask", "value_mask"),
        rcs.rollout_gate_stage, rcs.rollout_gate_naive,
        "core.rollout_correction.rejection_mask (rollout_rs_effect=drop_mask)",
        active=rcs.rollout_gate_reads, needs=rcs.rollout_gate_needs, output_reads=_GATE_MASK_READS,
    ),
    Stage(
        "advantages", "rollout", ("advantage", "gae_padding", "gae_holes", *_GROUP_KEYS, "gae_bootstrap"),
        ("gamma", "lam", "kl_coef"),
        ("token_rewards", "old_values", "value_mask", "mask", "mapped_scores", "kl", "group_index",
         "bootstrap_values", "truncated"),
        ("advantages_raw", "returns"), ro.advantages_stage, nv.advantages_naive,
        "pipeline.blocks.gae_by_rows (core.gae.gae), pipeline.rollout.critic_free_advantages "
        "(core.group.group_advantages, discounted_returns)",
        collective=True, active=_advantage_reads, needs=nd.advantages_needs,
    ),
    Stage(
        "whitening", "rollout", ("whiten_advantages", "whiten_holes", "whiten_variance", "whiten_eps_at"),
        ("whiten_eps",), ("advantages_raw", "mask"), ("advantages",), ro.whitening_stage,
        nv.whitening_naive, "core.normalize.normalize", collective=True, active=_whitening_reads,
    ),
)  # fmt: skip


_UPDATE = (
    Stage(
        "rollout_correction", "update", (*rcs.RC_KEYS, *rcs.RS_KEYS), (),
        _GATE_READS, ("is_weights", "is_keep", "mask", "value_mask"),
        rcs.rollout_correction_stage, rcs.rollout_correction_naive,
        "core.rollout_correction.is_weights, core.rollout_correction.rejection_mask",
        active=rcs.rollout_correction_reads, needs=rcs.rollout_correction_needs,
        output_reads=_GATE_MASK_READS,
    ),
    Stage(
        "policy", "update",
        ("policy_loss", "dual_clip", "log_ratio_clamp", "truncated_rows", "clipfrac_agg", "clipfrac_counts"),
        ("cliprange", "cliprange_high"),
        ("logprobs", "old_logprobs", "advantages", "mask", "is_weights"),
        ("pg_per_token", "ratio", "pg_clipfrac", "pg_clipfrac_lower", "pg_approx_kl"),
        up.policy_stage, nu.policy_naive,
        "core.policy.clipped_policy_token_loss, core.gspo.gspo_policy_token_loss, "
        "core.cispo.cispo_policy_loss, core.clipfrac.clipfrac_row_mean, core.clipfrac.clip_fraction",
        by_rows=True,
        needs=nd.policy_needs,
        output_reads={q: ("logprobs", "old_logprobs", "mask") for q in ("ratio", "pg_approx_kl")},
        output_keys={
            "ratio": ("policy_loss", "log_ratio_clamp"), "pg_approx_kl": ("policy_loss",),
            **{q: ("policy_loss", "dual_clip", "log_ratio_clamp", "cliprange", "cliprange_high")
               for q in ("pg_per_token", "pg_clipfrac_lower")},
        },
    ),
    Stage(
        "policy_agg", "update", ("loss_agg", "truncated_rows"), ("horizon",),
        ("pg_per_token", "mask", "group_index"),
        ("pg_loss",), up.policy_agg_stage, nu.policy_agg_naive,
        "core.aggregate.aggregate_masked, core.aggregate.prompt_mean_masked", normalisers=True,
    ),
    Stage(
        "approx_kl", "update", ("approx_kl", "log_ratio_clamp"), (),
        ("pg_approx_kl", "logprobs", "old_logprobs", "mask"),
        ("approx_kl",), up.approx_kl_stage, nu.approx_kl_naive,
        "core.policy.approx_kl_k2_all_positions, core.approx_kl.approx_kl_k1_clamped",
    ),
    Stage(
        "value", "update", ("value_loss", "value_clip_form", "vf_mask", "advantage"), ("cliprange_value",),
        ("values", "old_values", "returns", "value_mask", "mask", "logprobs"),
        ("vf_per_token", "vf_clipfrac", "vf_loss_mask"), up.value_stage, nu.value_naive,
        "core.value.value_token_loss", by_rows=True, needs=nd.value_needs,
    ),
    Stage(
        "value_agg", "update", ("loss_agg", "value_loss_agg", "truncated_rows"), ("horizon",),
        ("vf_per_token", "vf_loss_mask", "logprobs"), ("vf_loss",), up.value_agg_stage, nu.value_agg_naive,
        "core.aggregate.aggregate_masked", normalisers=True,
    ),
    Stage(
        "entropy", "update", ("loss_agg", "entropy_agg", "truncated_rows"), ("horizon",),
        ("entropy", "mask", "logprobs", "group_index"), ("entropy_loss",), up.entropy_stage, nu.entropy_naive,
        "core.objective.entropy_bonus", by_rows=True, normalisers=True,
    ),
    Stage(
        "kl_loss", "update",
        ("kl_in", "kl_estimator", "kl_log_ratio_clamp", "kl_value_clamp", "loss_agg", "kl_loss_agg",
         "kl_grad_is_clip", "truncated_rows", *_KL_LOSS_KEYS),
        ("horizon",), ("logprobs", "ref_logprobs", "mask", "old_logprobs"), ("kl_loss",), up.kl_loss_stage,
        nu.kl_loss_naive_stage, "core.objective.kl_loss", by_rows=True, normalisers=True,
        needs=nd.kl_loss_needs,
    ),
    Stage(
        "kl_metric", "update",
        ("kl_in", "kl_estimator", "kl_log_ratio_clamp", "kl_value_clamp", "loss_agg", "kl_loss_agg",
         "kl_metric_agg", "truncated_rows", *_KL_LOSS_KEYS),
        ("horizon",), ("kl_loss", "logprobs", "ref_logprobs", "mask"),
        ("kl_metric",),
        up.kl_metric_stage, nu.kl_metric_naive_stage, "core.objective.kl_loss", by_rows=True,
        normalisers=True,
    ),
    Stage(
        "total", "update", ("kl_in",), ("vf_coef", "ent_coef", "kl_coef", "kl_loss_coef"),
        ("pg_loss", "vf_loss", "entropy_loss", "kl_loss"), ("loss",), up.total_stage, nu.total_naive,
        "core.objective.total_loss", needs=nd.total_needs,
    ),
)  # fmt: skip

_GRAD = Stage(
    "grads", "grad", (), (),
    ("loss", "logprobs", "values", "mask", "vf_loss_mask", "is_weights", "group_index"),
    ("grad_logprobs", "grad_values"), up.grads_stage, gn.grads_naive,
    "torch.autograd.grad (naive: pipeline.grad_naive.objective_grads_naive, core.grad)",
)  # fmt: skip

STAGES: tuple[Stage, ...] = (*_ROLLOUT, *_UPDATE, _GRAD)
"""Every stage of the step, in pipeline order."""
ROLLOUT_STAGES: tuple[Stage, ...] = tuple(s for s in STAGES if s.phase == "rollout")
"""Steps 0–4: once per rollout."""
UPDATE_STAGES: tuple[Stage, ...] = tuple(s for s in STAGES if s.phase == "update")
"""Steps 5–9: per (micro-)batch."""
BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}

OUTPUTS: tuple[str, ...] = (
    "kl",
    "token_rewards",
    "advantages",
    "returns",
    "pg_loss",
    "pg_clipfrac",
    "approx_kl",
    "vf_loss",
    "vf_clipfrac",
    "entropy_loss",
    "kl_loss",
    "loss",
    "grad_logprobs",
    "grad_values",
)
"""The trainer outputs a dump may hold, each a quantity a stage makes, in the order reports list them
(the first that differs is the first divergence): by stage, an aggregated loss before its per-token
stage's statistics, ``advantages`` (whitened) with step 3's ``returns`` after it."""
ROLLOUT_OUTPUTS: frozenset[str] = frozenset(q for s in ROLLOUT_STAGES for q in s.makes) & frozenset(OUTPUTS)
"""The outputs of the rollout stages (the rest need the update)."""


__all__ = [
    "BY_NAME",
    "OUTPUTS",
    "ROLLOUT_OUTPUTS",
    "ROLLOUT_STAGES",
    "STAGES",
    "UPDATE_STAGES",
    "Stage",
    "StageFn",
    "walk",
]
