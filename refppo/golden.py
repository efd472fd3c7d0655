"""Golden PPO trajectories on tiny real models: build, run (batched or naive), save, compare.

``tools/make_golden.py`` writes ``spec/golden/ppo_<case>.{json,safetensors}``; ``tests/golden``
replays them. Format (schema version :data:`SCHEMA_VERSION`, described in spec/models.md):

- ``.safetensors``: per iteration ``i``: ``it{i}.<field>`` for every field of :data:`TENSOR_FIELDS`
  (rollout tokens and masks, π_old/π_ref log-probs, values, scores, KL, token rewards, advantages,
  returns) and ``it{i}.perm`` ``[epochs, B]`` (row order of each PPO epoch);
- ``.json``: ``schema_version``, ``case`` (the full configuration), ``tolerances``, ``environment``
  (versions, threads; informative), ``init_checksums`` and ``iterations``: per iteration the
  scalars (``metrics``), per-minibatch ``steps`` scalars, and ``checksums``: for every parameter
  tensor ``[Σp, Σp², Σ|p|]`` in float64 after that iteration's update.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from refppo.conventions import AdvantageEstimator, Whitening
from refppo.cpu_numerics import PINNED_CPU_ENV
from refppo.models import (
    Arch,
    Critic,
    RewardModel,
    SequenceBatch,
    left_pad,
    make_reference,
    tiny_actor,
    tiny_critic,
    tiny_reward_model,
)
from refppo.pipeline import Convention, Hyperparams
from refppo.ppo import MinibatchRecord, PPOUpdateConfig, iteration, rollout_metrics
from refppo.ppo_naive import ppo_update_naive, rollout_quantities_naive, score_rollout_naive
from refppo.rollout import RolloutConfig

SCHEMA_VERSION = 1

TENSOR_FIELDS = (
    "prompt_ids",
    "prompt_mask",
    "response_ids",
    "response_mask",
    "old_logprobs",
    "ref_logprobs",
    "old_values",
    "raw_scores",
    "scores",
    "kl",
    "token_rewards",
    "advantages",
    "returns",
)
EXACT_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "perm")

COMPARED_METRICS = (
    "score",
    "kl",
    "loss",
    "pg_loss",
    "vf_loss",
    "entropy",
    "pg_clipfrac",
    "approx_kl",
    "vf_clipfrac",
    "actor_grad_norm",
    "critic_grad_norm",
)


@dataclass(frozen=True)
class Tolerances:
    """``|a − b| <= atol + rtol·|b|`` for tensors and scalars; checksums: ``|ΔΣp| <= ck·Σ|p|``,
    ``|ΔΣp²| <= ck·Σp²``. Clip fractions are counts over a few dozen tokens and compared to
    ``frac_atol``."""

    atol: float
    rtol: float
    checksum: float
    frac_atol: float


CPU_REPLAY = Tolerances(atol=1e-5, rtol=1e-5, checksum=2e-4, frac_atol=0.0)
"""Same seed, batched path, CPU, kernels pinned to AVX2 (:mod:`refppo.cpu_numerics`). Bit-identical
with 1 thread on the generating machine; unpinned, another CPU model moved whitened advantages by up
to 5.4e-5; with 2
threads tensors moved by <= 8.4e-7 and checksums by <= 3.9e-5 relative. The checksum margin is
wide because Adam turns rounding noise into lr-sized steps where the exact gradient is 0 (e.g.
the attention key bias: softmax is invariant to it)."""
NAIVE = Tolerances(atol=5e-4, rtol=5e-4, checksum=5e-4, frac_atol=0.07)
"""Per-prefix naive path vs the goldens (float64 Python twins + Adam amplifying ~1e-7 gradient
differences; a clip-fraction may flip one token whose ratio sits on 1±ε)."""
CUDA_REPLAY = Tolerances(atol=1e-3, rtol=1e-3, checksum=1e-4, frac_atol=0.07)
"""Batched path on a CUDA device (different kernels and reduction orders)."""


@dataclass(frozen=True)
class GoldenCase:
    """Everything that defines one golden trajectory."""

    name: str
    arch: Arch
    vocab_size: int = 32
    hidden: int = 32
    layers: int = 2
    heads: int = 2
    dropout: float = 0.1
    prompts: tuple[tuple[int, ...], ...] = ((1, 5, 6), (1, 7, 8, 9, 10), (1, 3), (1, 11, 12, 13))
    seed: int = 1234
    iterations: int = 3
    lr: float = 3e-3
    rollout: RolloutConfig = field(
        default_factory=lambda: RolloutConfig(max_new_tokens=8, temperature=0.9, missing_eos_penalty=1.0)
    )
    update: PPOUpdateConfig = field(
        default_factory=lambda: PPOUpdateConfig(
            ppo_epochs=2, num_minibatches=2, micro_batch_size=1, max_grad_norm=1.0
        )
    )
    hp: Hyperparams = field(default_factory=lambda: Hyperparams(kl_coef=0.05, ent_coef=0.01, vf_coef=0.1))
    conv: Convention = field(default_factory=Convention)
    group_size: int = 1
    """Responses per prompt: each prompt's row is repeated ``group_size`` times (consecutive rows,
    ``group_index`` = the prompt's position); the group estimators need ≥ 2."""

    @property
    def critic_free(self) -> bool:
        """``conv.advantage`` is not GAE: no critic model, optimizer or value loss."""
        return self.conv.advantage is not AdvantageEstimator.GAE

    def rows(self) -> tuple[list[list[int]], Tensor]:
        """The prompt of every row and ``group_index`` ``[B]`` (B = prompts × ``group_size``)."""
        rows = [list(p) for p in self.prompts for _ in range(self.group_size)]
        gi = torch.arange(len(self.prompts)).repeat_interleave(self.group_size)
        return rows, gi

    def to_dict(self) -> dict[str, Any]:
        def dc(x: Any) -> dict[str, Any]:
            return {k: getattr(x, k) for k in x.__dataclass_fields__}

        out = {
            "name": self.name,
            "arch": self.arch,
            "vocab_size": self.vocab_size,
            "hidden": self.hidden,
            "layers": self.layers,
            "heads": self.heads,
            "dropout": self.dropout,
            "prompts": [list(p) for p in self.prompts],
            "seed": self.seed,
            "iterations": self.iterations,
            "optimizer": {"kind": "Adam", "lr": self.lr, "separate_actor_critic": not self.critic_free},
            "model_seeds": {"actor": 0, "critic": 1, "reward": 2},
            "rollout": dc(self.rollout),
            "update": dc(self.update),
            "hp": dc(self.hp),
            "conv": self.conv.to_dict(),
        }
        if self.group_size != 1:  # the PPO goldens' documents stay as written
            out["group_size"] = self.group_size
        return out


CASES: dict[str, GoldenCase] = {
    "gpt2": GoldenCase(name="gpt2", arch="gpt2"),
    "llama": GoldenCase(name="llama", arch="llama"),
    # critic-free: GRPO over groups of 4 responses to each of the 4 prompts (16 rows), no
    # advantage whitening beyond the group's own (verl/OpenRLHF GRPO), KL folded into the score
    "grpo_gpt2": GoldenCase(
        name="grpo_gpt2",
        arch="gpt2",
        group_size=4,
        conv=Convention(advantage=AdvantageEstimator.GRPO, whiten_advantages=Whitening.NONE),
        update=PPOUpdateConfig(ppo_epochs=2, num_minibatches=2, micro_batch_size=2, max_grad_norm=1.0),
    ),
}


@dataclass
class Models:
    actor: nn.Module
    reference: nn.Module
    critic: Critic | None
    reward: RewardModel
    actor_opt: torch.optim.Optimizer
    critic_opt: torch.optim.Optimizer | None


def build(case: GoldenCase, device: torch.device | str = "cpu") -> Models:
    """Models (seeded random init) and optimizers of ``case`` on ``device``."""
    kw: dict[str, Any] = {"hidden": case.hidden, "layers": case.layers, "heads": case.heads}
    actor = tiny_actor(case.arch, case.vocab_size, seed=0, dropout=case.dropout, **kw).to(device)
    critic = None
    if not case.critic_free:
        critic = tiny_critic(case.arch, case.vocab_size, seed=1, dropout=case.dropout, **kw).to(device)
    reward = tiny_reward_model(case.arch, case.vocab_size, seed=2, **kw).to(device)
    reference = make_reference(actor)
    ao = torch.optim.Adam(actor.parameters(), lr=case.lr)
    co = torch.optim.Adam(critic.parameters(), lr=case.lr) if critic is not None else None
    return Models(actor, reference, critic, reward, ao, co)


def checksums(models: Models) -> dict[str, list[float]]:
    """``[Σp, Σp², Σ|p|]`` (float64) of every actor and critic (if any) parameter tensor."""
    out: dict[str, list[float]] = {}
    trained = [("actor", models.actor)] + ([("critic", models.critic)] if models.critic is not None else [])
    for prefix, model in trained:
        for name, p in model.named_parameters():
            d = p.detach().double().cpu()
            out[f"{prefix}.{name}"] = [float(d.sum()), float((d * d).sum()), float(d.abs().sum())]
    return out


@dataclass
class Trajectory:
    """What a run produces: tensors (``it{i}.<field>``) and the JSON-able record."""

    tensors: dict[str, Tensor]
    record: dict[str, Any]


def run(
    case: GoldenCase,
    *,
    device: torch.device | str = "cpu",
    naive_from: Trajectory | None = None,
) -> Trajectory:
    """Run ``case`` for ``case.iterations`` PPO iterations.

    Batched path (default): sample with the seeded generator, :func:`refppo.ppo.iteration`.
    Naive path (``naive_from`` = a golden): replay its sampled tokens and epoch permutations;
    score with per-prefix forwards, rollout quantities from the core's naive twins, update with
    :func:`refppo.ppo_naive.ppo_update_naive` (a real snapshot network for π_old).
    """
    models = build(case, device)
    rows, group_index = case.rows()
    gi = group_index.to(device) if case.critic_free else None
    prompt_ids, prompt_mask = left_pad(rows, case.rollout.pad_token_id)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    gen = torch.Generator().manual_seed(case.seed)
    tensors: dict[str, Tensor] = {}
    iters: list[dict[str, Any]] = []
    record: dict[str, Any] = {"init_checksums": checksums(models)}
    for it in range(case.iterations):
        steps: list[dict[str, Any]] = []
        if naive_from is None:
            recs: list[MinibatchRecord] = []
            res = iteration(
                models.actor,
                models.reference,
                models.critic,
                models.reward,
                models.actor_opt,
                models.critic_opt,
                prompt_ids,
                prompt_mask,
                rollout_cfg=case.rollout,
                update_cfg=case.update,
                hp=case.hp,
                conv=case.conv,
                generator=gen,
                on_minibatch=recs.append,
                group_index=gi,
            )
            scored, q, metrics = res.scored, res.quantities, res.metrics
            perm = torch.stack(
                [torch.cat([r.rows for r in recs if r.epoch == e]) for e in range(case.update.ppo_epochs)]
            )
            steps = [{k: r.stats[k] for k in COMPARED_METRICS if k in r.stats} for r in recs]
        else:
            g = naive_from.tensors
            batch = SequenceBatch(
                g[f"it{it}.prompt_ids"].to(device),
                g[f"it{it}.prompt_mask"].to(device),
                g[f"it{it}.response_ids"].to(device),
                g[f"it{it}.response_mask"].to(device),
            )
            scored = score_rollout_naive(
                models.actor,
                models.reference,
                models.critic,
                models.reward,
                batch,
                temperature=case.rollout.temperature,
                eos_token_id=case.rollout.eos_token_id,
                missing_eos_penalty=case.rollout.missing_eos_penalty,
            )
            q = rollout_quantities_naive(
                scores=scored.scores,
                old_logprobs=scored.old_logprobs,
                ref_logprobs=scored.ref_logprobs,
                old_values=scored.old_values,
                mask=batch.response_mask,
                hp=case.hp,
                conv=case.conv,
                group_index=gi,
            )
            perm = g[f"it{it}.perm"]
            nsteps = ppo_update_naive(
                models.actor,
                models.critic,
                models.actor_opt,
                models.critic_opt,
                scored,
                q,
                hp=case.hp,
                conv=case.conv,
                cfg=case.update,
                perms=list(perm),
            )
            steps = [{k: s.stats[k] for k in COMPARED_METRICS if k in s.stats} for s in nsteps]
            metrics = rollout_metrics(scored, q, case.hp, case.conv)
            for k in steps[0]:
                metrics[k] = sum(s[k] for s in steps) / len(steps)
        b = scored.batch
        fields_ = {
            "prompt_ids": b.prompt_ids,
            "prompt_mask": b.prompt_mask,
            "response_ids": b.response_ids,
            "response_mask": b.response_mask,
            "old_logprobs": scored.old_logprobs,
            "ref_logprobs": scored.ref_logprobs,
            "old_values": scored.old_values,
            "raw_scores": scored.raw_scores,
            "scores": scored.scores,
            "kl": q.kl,
            "token_rewards": q.token_rewards,
            "advantages": q.advantages,
            "returns": q.returns,
            "perm": perm,
        }
        for k, v in fields_.items():
            tensors[f"it{it}.{k}"] = v.detach().cpu().clone().contiguous()
        iters.append(
            {
                "metrics": {k: float(metrics[k]) for k in sorted(metrics)},
                "steps": steps,
                "checksums": checksums(models),
            }
        )
    record["iterations"] = iters
    return Trajectory(tensors, record)


def _close(a: float, b: float, atol: float, rtol: float) -> bool:
    return math.isfinite(a) and abs(a - b) <= atol + rtol * abs(b)


def compare(golden: Trajectory, got: Trajectory, tol: Tolerances) -> list[str]:
    """Every mismatch between ``got`` and ``golden`` (empty: the trajectory is reproduced).

    Measured deviations: :func:`max_deviations`.
    """
    bad: list[str] = []
    n_it = len(golden.record["iterations"])
    for it in range(n_it):
        for f in (*TENSOR_FIELDS, "perm"):
            key = f"it{it}.{f}"
            a, b = got.tensors[key], golden.tensors[key]
            if a.shape != b.shape:
                bad.append(f"{key}: shape {list(a.shape)} != golden {list(b.shape)}")
                continue
            if f in EXACT_FIELDS:
                if not torch.equal(a, b):
                    bad.append(f"{key}: differs from golden (exact field)")
                continue
            a64, b64 = a.double(), b.double()
            excess = (a64 - b64).abs() - (tol.atol + tol.rtol * b64.abs())
            if bool((excess > 0).any()) or not bool(torch.isfinite(a64).all()):
                bad.append(f"{key}: max |Δ| {float((a64 - b64).abs().max()):.3g} over tolerance")
        gi, ai = golden.record["iterations"][it], got.record["iterations"][it]
        for k in COMPARED_METRICS:
            atol = tol.frac_atol if "clipfrac" in k else tol.atol
            if not _close(ai["metrics"][k], gi["metrics"][k], atol, tol.rtol):
                bad.append(f"it{it}.metrics.{k}: {ai['metrics'][k]!r} != golden {gi['metrics'][k]!r}")
        for s, (sa, sg) in enumerate(zip(ai["steps"], gi["steps"], strict=True)):
            for k in sg:
                atol = tol.frac_atol if "clipfrac" in k else tol.atol
                if not _close(sa[k], sg[k], atol, tol.rtol):
                    bad.append(f"it{it}.steps[{s}].{k}: {sa[k]!r} != golden {sg[k]!r}")
        for name, (s, s2, sabs) in gi["checksums"].items():
            a_s, a_s2, _ = ai["checksums"][name]
            if not (
                abs(a_s - s) <= tol.checksum * sabs + 1e-12 and abs(a_s2 - s2) <= tol.checksum * s2 + 1e-12
            ):
                bad.append(f"it{it}.checksums.{name}: [{a_s!r}, {a_s2!r}] != golden [{s!r}, {s2!r}]")
    return bad


def max_deviations(golden: Trajectory, got: Trajectory) -> dict[str, float]:
    """Measured max |Δ| per tensor field (over iterations), per metric, and the max relative
    checksum deviation — for reports (tests print them)."""
    out: dict[str, float] = {}
    n_it = len(golden.record["iterations"])
    for f in TENSOR_FIELDS:
        if f in EXACT_FIELDS:
            continue
        out[f] = max(
            float((got.tensors[f"it{it}.{f}"].double() - golden.tensors[f"it{it}.{f}"].double()).abs().max())
            for it in range(n_it)
        )
    for k in COMPARED_METRICS:
        out[f"metric.{k}"] = max(
            abs(got.record["iterations"][it]["metrics"][k] - golden.record["iterations"][it]["metrics"][k])
            for it in range(n_it)
        )
    ck = 0.0
    for it in range(n_it):
        for name, (s, s2, sabs) in golden.record["iterations"][it]["checksums"].items():
            a_s, a_s2, _ = got.record["iterations"][it]["checksums"][name]
            ck = max(ck, abs(a_s - s) / sabs, abs(a_s2 - s2) / s2)
    out["checksum_rel"] = ck
    return out


def paths(directory: str | os.PathLike[str], name: str) -> tuple[str, str]:
    """``(json_path, safetensors_path)`` of golden ``name`` in ``directory``."""
    d = os.fspath(directory)
    return os.path.join(d, f"ppo_{name}.json"), os.path.join(d, f"ppo_{name}.safetensors")


def save(traj: Trajectory, case: GoldenCase, directory: str | os.PathLike[str]) -> None:
    """Write the golden files of ``case``."""
    from safetensors.torch import save_file

    jpath, tpath = paths(directory, case.name)
    save_file(traj.tensors, tpath)
    doc = {
        "schema_version": SCHEMA_VERSION,
        "case": case.to_dict(),
        "tolerances": {
            "cpu_replay": CPU_REPLAY.__dict__,
            "naive": NAIVE.__dict__,
            "cuda_replay": CUDA_REPLAY.__dict__,
        },
        "environment": {
            "torch": torch.__version__,
            "transformers": _transformers_version(),
            "num_threads": torch.get_num_threads(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "pinned_env": {k: os.environ.get(k) for k in PINNED_CPU_ENV},
        },
        **traj.record,
    }
    with open(jpath, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1, sort_keys=True)
        fh.write("\n")


def load(directory: str | os.PathLike[str], name: str) -> tuple[Trajectory, dict[str, Any]]:
    """``(trajectory, json document)`` of golden ``name``; checks the schema version."""
    from safetensors.torch import load_file

    jpath, tpath = paths(directory, name)
    with open(jpath, encoding="utf-8") as fh:
        doc: dict[str, Any] = json.load(fh)
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{jpath}: schema_version {doc.get('schema_version')!r} != {SCHEMA_VERSION}")
    record = {"init_checksums": doc["init_checksums"], "iterations": doc["iterations"]}
    return Trajectory(load_file(tpath), record), doc


def _transformers_version() -> str:
    import transformers

    v: str = transformers.__version__
    return v


def variant(case: GoldenCase, **changes: Any) -> GoldenCase:
    """``case`` with hyperparameters (``hp`` fields) or conventions (``conv`` fields) changed."""
    hp_f = {k: v for k, v in changes.items() if k in Hyperparams.__dataclass_fields__}
    conv_f = {k: v for k, v in changes.items() if k in Convention.__dataclass_fields__}
    unknown = set(changes) - set(hp_f) - set(conv_f)
    if unknown:
        raise ValueError(f"variant: unknown fields {sorted(unknown)}")
    return replace(case, hp=replace(case.hp, **hp_f), conv=case.conv.with_updates(conv_f))


__all__ = [
    "CASES",
    "CPU_REPLAY",
    "CUDA_REPLAY",
    "NAIVE",
    "SCHEMA_VERSION",
    "GoldenCase",
    "Tolerances",
    "Trajectory",
    "build",
    "compare",
    "load",
    "max_deviations",
    "run",
    "save",
    "variant",
]
