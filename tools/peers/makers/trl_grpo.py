"""TRL GRPOTrainer dumps from TRL's own code (run with the ``trl`` or ``trl-grpo`` venv's python).

Called, for each case:

- ``trl/trainer/grpo_config.py::GRPOConfig`` (its ``__post_init__`` maps the bool forms of
  ``scale_rewards``: ``True`` → ``"group"``, ``False`` → ``"none"``; the defaults of ``loss_type``,
  ``epsilon``);
- the advantage block of ``trl/trainer/grpo_trainer.py::GRPOTrainer._generate_and_score_completions``:
  the method computes the advantages inline (no helper in 1.12.0 or 1.16.0), between
  ``num_generations = ...`` and ``advantages = torch.nan_to_num(...)``. Those statements are taken
  from the INSTALLED method's source (``inspect.getsource`` + ``ast``, nothing re-typed) and executed
  in the trainer module's globals (TRL's ``nanstd``) on a stand-in ``self`` holding what they read
  (``scale_rewards``, ``multi_objective_aggregation``, ``reward_weights``, ``num_generations``),
  with ``rewards_per_func`` = the scores (one reward function). Driving the whole method would need
  generation, tokenisation and a model; the block is the smallest unit of TRL's code that computes
  the advantages;
- ``GRPOTrainer._compute_loss`` unbound on a stand-in ``self`` (as ``tools/peers/trl_grpo.py``)
  for the loss under the case's ``loss_type`` (``num_items_in_batch`` = the batch's tokens: one
  process, no accumulation).

TRL's groups are contiguous blocks of ``num_generations`` rows (``rewards.view(-1, n)``):
``group_index`` = ``arange(B) // n``. TRL's advantage is one number per row; the dump's
``advantages`` [B, T] is it on the valid tokens and 0 on the padding (the format's, as
``_compute_loss`` multiplies by ``completion_mask``). Nothing from refppo is imported.

:func:`make_no_reference`: the ``beta = 0`` cases as TRL runs them (no reference model is loaded at
``beta = 0``; ``_compute_loss`` reads ``ref_per_token_logps`` only when ``beta != 0``), dumps without
``ref_logprobs`` and sidecars without ``gamma``, ``lam``, ``cliprange_value``, ``vf_coef``.
"""

from __future__ import annotations

import ast
import collections
import inspect
import sys
import tempfile
import textwrap
import types
from pathlib import Path
from typing import Any

from peers.makers.common import HP, inputs, save

B = 12
T = 10

# (name, scale_rewards as passed to GRPOConfig, loss_type, beta, num_generations, dtype, scores kind,
#  --set keys on top of --preset trl, control that must NOT reproduce)
CASES: list[tuple[str, Any, str, float, int, str, str, dict[str, Any], dict[str, Any]]] = [
    ("group_dapo", "group", "dapo", 0.0, 4, "f64", "randn",
     {"advantage": "grpo"}, {"group_std": "population"}),
    ("group_bool_grpo_beta", True, "grpo", 0.04, 4, "f64", "randn",
     {"advantage": "grpo", "loss_agg": "seq-mean-token-mean"}, {"loss_agg": "token-mean"}),
    ("group_bnpo_n3", "group", "bnpo", 0.0, 3, "f64", "randn",
     {"advantage": "grpo"}, {"group_eps": 1e-6}),
    ("group_equal_scores", "group", "dapo", 0.0, 4, "f64", "equal",
     {"advantage": "grpo"}, {"advantage": "dr-grpo"}),
    # n = 1 only on the advantage block's stand-in: GRPOConfig refuses num_generations < 2 ("GRPO requires
    # at least 2 generations per prompt", trl 1.12.0 and 1.16.0), so make() passes max(n, 2) to the
    # config; TRL reaches this torch.zeros_like branch only as num_generations_eval = 1 (no loss).
    ("group_n1", "group", "dapo", 0.0, 1, "f64", "randn",
     {"advantage": "grpo"}, {"group_singleton": "score"}),
    ("group_f32_beta", "group", "dapo", 0.04, 4, "f32", "randn",
     {"advantage": "grpo"}, {"kl_in": "reward"}),
    ("none_dr_grpo", "none", "dr_grpo", 0.0, 4, "f64", "randn",
     {"advantage": "dr-grpo", "loss_agg": "seq-mean-token-sum-norm"}, {"advantage": "grpo"}),
    ("none_bool_bnpo_n3_beta", False, "bnpo", 0.04, 3, "f64", "randn",
     {"advantage": "dr-grpo"}, {"advantage": "grpo"}),
    # scale_rewards="batch": the group mean over the batch's unbiased std around the batch mean
    # (group_std_level=batch); "equal": two groups of equal scores (σ_G = 0, σ_B ≠ 0), the third random.
    ("batch_dapo", "batch", "dapo", 0.0, 4, "f64", "randn",
     {"advantage": "grpo", "group_std_level": "batch"}, {"group_std_level": "group"}),
    ("batch_equal_scores_beta", "batch", "grpo", 0.04, 4, "f64", "equal",
     {"advantage": "grpo", "group_std_level": "batch", "loss_agg": "seq-mean-token-mean"},
     {"group_std_level": "group"}),
    ("batch_bnpo_n3_f32", "batch", "bnpo", 0.0, 3, "f32", "randn",
     {"advantage": "grpo", "group_std_level": "batch", "loss_agg": "token-mean"},
     {"group_std_level": "batch-centred"}),
]  # fmt: skip
EPS_HIGH = 0.28


def _advantage_block(trainer_cls: Any) -> Any:
    """The installed ``_generate_and_score_completions`` statements from ``num_generations = ...``
    to ``advantages = torch.nan_to_num(...)``, compiled (TRL's own source, not a copy)."""
    src = textwrap.dedent(inspect.getsource(trainer_cls._generate_and_score_completions))
    fn = ast.parse(src).body[0]
    if not isinstance(fn, ast.FunctionDef):
        raise RuntimeError("GRPOTrainer._generate_and_score_completions: expected a plain method")
    body = fn.body

    def assigns(stmt: ast.stmt, name: str) -> bool:
        return isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in stmt.targets
        )

    start = next(i for i, s in enumerate(body) if assigns(s, "num_generations"))
    end = next(
        i
        for i, s in enumerate(body)
        if assigns(s, "advantages") and "nan_to_num" in ast.unparse(s) and i > start
    )
    block = ast.Module(body=body[start : end + 1], type_ignores=[])
    text = ast.unparse(block)
    if "1e-4" not in text and "0.0001" not in text:
        raise RuntimeError("the advantage block no longer holds TRL's epsilon 1e-4; re-read the method")
    return compile(block, "<trl GRPOTrainer._generate_and_score_completions advantage block>", "exec")


class _Accelerator:
    """One process: gather/reduce are the identity."""

    num_processes = 1
    process_index = 0
    device = "cpu"

    def gather(self, x: Any) -> Any:
        return x

    def gather_for_metrics(self, x: Any) -> Any:
        return x

    def reduce(self, x: Any, reduction: str = "sum") -> Any:
        return x


def trl_advantages(module: Any, code: Any, scores: Any, scale_rewards: str, n: int) -> Any:
    """Run TRL's advantage block: one reward function (weight 1), mode ``train``."""
    import torch

    me = types.SimpleNamespace(
        scale_rewards=scale_rewards,
        multi_objective_aggregation="sum_then_normalize",
        reward_weights=torch.ones(1, dtype=scores.dtype),
        num_generations=n,
        num_generations_eval=n,
    )
    scope: dict[str, Any] = dict(vars(module))
    scope.update(self=me, mode="train", device="cpu", rewards_per_func=scores.clone().unsqueeze(1))
    exec(code, scope)  # TRL's own statements (see _advantage_block)
    return scope["advantages"]


def trl_loss(
    trainer_cls: Any,
    x: dict[str, Any],
    adv: Any,
    loss_type: str,
    beta: float,
    metrics: Any = None,
    **vllm: Any,
) -> Any:
    """``GRPOTrainer._compute_loss`` on a stand-in ``self`` (one process, token-level ratio).

    ``metrics``: a ``{"train": defaultdict(list), ...}`` that receives what TRL logs (``_metrics``);
    ``vllm``: ``is_ratio`` (TRL's ``vllm_importance_sampling_ratio``; the loss then multiplies by it,
    ``use_vllm`` and the correction on) and ``leaf`` (the ``per_token_logps`` tensor to use, with
    grad: the loss is then computed under autograd); returns ``(loss, inputs)`` when given;
    ``epsilon_high`` (default :data:`EPS_HIGH`): the trainer's ``epsilon_high``."""
    import torch

    lp = vllm.pop("leaf", x["logprobs"].clone())
    eps_high = vllm.pop("epsilon_high", EPS_HIGH)
    grad = lp.requires_grad
    me = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=beta, loss_type=loss_type, epsilon_low=HP["cliprange"], epsilon_high=eps_high,
        use_vllm=False, vllm_importance_sampling_correction=False,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=T, accelerator=_Accelerator(),
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        _metrics=metrics or {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
        _entropy_bonus_enabled=False, aux_loss_enabled=False, use_adaptive_entropy=False,
    )  # fmt: skip
    m = x["response_mask"].long()
    b = m.shape[0]
    batch = {
        "prompt_ids": torch.zeros(b, 2, dtype=torch.long),
        "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.zeros(b, T, dtype=torch.long),
        "completion_mask": m,
        "advantages": adv,
        "old_per_token_logps": x["old_logprobs"],
        "ref_per_token_logps": x.get("ref_logprobs"),
        "num_items_in_batch": m.sum(),
    }
    if not vllm and not grad:
        with torch.no_grad():
            return trainer_cls._compute_loss(me, None, batch)
    if "is_ratio" in vllm:  # what _generate_and_score_completions adds with vLLM and the correction
        me.use_vllm = me.vllm_importance_sampling_correction = True
        batch.update(
            importance_sampling_ratio=vllm["is_ratio"], sampling_per_token_logps=x["rollout_logprobs"]
        )
    return trainer_cls._compute_loss(me, None, batch), batch


def _scores(kind: str, x: dict[str, Any], n: int) -> Any:
    """``randn`` (the batch's), or ``equal``: the first group all 1.0, the second all 0.5 (σ = 0)."""
    s = x["scores"] / 4.0
    if kind == "equal":
        s = s.clone()
        s[:n] = 1.0
        s[n : 2 * n] = 0.5
    return s


def make_no_reference(out: Path) -> list[str]:
    """The ``beta = 0`` cases of :func:`make` without a reference (module doc)."""
    return make(out, no_reference=True)


def make(out: Path, no_reference: bool = False) -> list[str]:
    from importlib.metadata import version

    import torch

    from peers.stubs import StubFinder

    sys.meta_path.insert(0, StubFinder(("requests", "urllib3")))  # TRL's vLLM client only
    from trl import GRPOConfig  # type: ignore[import-not-found]  # trl venv only
    from trl.trainer import grpo_trainer  # type: ignore[import-not-found]  # trl venv only

    trl_version = version("trl")
    cls = grpo_trainer.GRPOTrainer
    code = _advantage_block(cls)
    made = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, scale, loss_type, beta, n, dt, kind, conv, control) in enumerate(CASES):
            if no_reference and beta != 0.0:
                continue
            cfg = GRPOConfig(
                output_dir=tmp, scale_rewards=scale, loss_type=loss_type, beta=beta,
                epsilon_high=EPS_HIGH, num_generations=max(n, 2), per_device_train_batch_size=B,
                report_to=[], use_cpu=True,
            )  # fmt: skip
            x = inputs(900 + i, B=B, T=T, dtype=torch.float64 if dt == "f64" else torch.float32)
            for k in ("old_values", "values", "entropy", *(("ref_logprobs",) if no_reference else ())):
                x.pop(k)
            x["scores"] = _scores(kind, x, n)
            x["group_index"] = torch.arange(B, dtype=torch.int64) // n
            a = trl_advantages(grpo_trainer, code, x["scores"], cfg.scale_rewards, n)
            loss = trl_loss(cls, x, a, cfg.loss_type, cfg.beta)
            m = x["response_mask"]
            dump: dict[str, Any] = dict(x)
            dump.update(advantages=torch.where(m.bool(), a.unsqueeze(1) * m, 0.0 * m), loss=loss)
            if beta == 0.0:
                dump["pg_loss"] = loss.clone()
            hp = dict(HP, gamma=1.0, lam=1.0, kl_coef=beta, cliprange=cfg.epsilon, cliprange_high=EPS_HIGH)
            if no_reference:  # only what a critic-free step reads
                hp = {"kl_coef": 0.0, "cliprange": cfg.epsilon, "cliprange_high": EPS_HIGH, "ent_coef": 0.0}
            if loss_type == "dr_grpo":
                hp["horizon"] = float(T)  # max_completion_length
            tag = "trl" + trl_version.replace(".", "") + ("_noref" if no_reference else "")
            made.append(save(out, f"{tag}_grpo_{name}", dump, hp, conv, control))
    return made
