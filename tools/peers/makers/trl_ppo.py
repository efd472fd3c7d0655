"""TRL 1.12.0's OWN ``PPOTrainer.train`` as dumps (the TRL side venv; refppo's capture on the path).

Each case is one PPO iteration of TRL 1.12.0's unmodified
``trl/experimental/ppo/ppo_trainer.py::PPOTrainer.train`` (the ppov2 lineage;
``trl/trainer/ppo_trainer.py`` before 0.26) on a tiny offline set-up (:func:`build_trainer`):
random-init GPT-2 policy / value / reward models (vocab 64, n_embd 32, 2 layers), 16 prompts of 8
tokens (refppo's words task and tokenizer), 12 new tokens, fp32, CPU, ``num_mini_batches = 1`` and
``gradient_accumulation_steps = 1`` (the minibatch is the whole batch).

How the tensors are captured (no TRL code is copied or restated): with the supported tracer
``refppo.capture.adapters.trl`` (``capture_train_locals`` + ``dump_from_locals``): ``sys.settrace`` on
the frame of ``PPOTrainer.train`` only, copying its locals at the first line of the chosen PPO epoch
(first minibatch, first micro-batch) where ``approxkl`` exists, and keeping the gradients of
``new_logprobs`` / ``vpred`` through ``retain_grad`` (dump v2 ``grad_logprobs`` / ``grad_values``).
TRL shuffles the batch with ``np.random.permutation``; the update tensors are put back into rollout
order.

Dump mapping (refppo ``spec/dump-format.md``):

==================  ==========================================================================
dump key            TRL 1.12.0 local of ``PPOTrainer.train``
==================  ==========================================================================
response_mask       ``~padding_mask`` (``padding_mask = idx > sequence_lengths``)
old_logprobs        ``logprobs`` (rollout; ``INVALID_LOGPROB = 1.0`` on padding, junk to refppo)
ref_logprobs        ``ref_logprobs`` (same sentinel)
old_values          ``values`` (zeroed beyond ``padding_mask_p1``; the score slot is a value position)
scores              ``scores`` (reward model score, ``missing_eos_penalty`` already subtracted)
logprobs / values   ``new_logprobs`` / ``vpred`` of the first minibatch, un-shuffled
kl                  ``kl``
token_rewards       ``rewards`` (score added at ``actual_end``, one slot past the last valid token)
advantages          ``advantages`` (after ``masked_whiten(advantages, ~padding_mask)``)
returns             ``returns``
pg_loss ... loss    ``pg_loss``, ``pg_clipfrac``, ``approxkl`` (-> ``approx_kl``), ``vf_loss``,
                    ``vf_clipfrac``, ``loss``
==================  ==========================================================================

Hyperparameters come from the run's ``PPOConfig`` (``kl_coef``, ``cliprange``, ``cliprange_value``,
``vf_coef``, ``gamma``, ``lam``; ``kl_estimator`` as a convention key).

Two case tables:

- :data:`CASES` (``tools/peers presets --venv trl``, :func:`make_preset_cases`): ``full`` (no stop
  token: every row full width, k1, TRL defaults), ``ragged`` (``stop_token="eos"``, EOS made likely,
  ``missing_eos_penalty = 1``: right-padded rows of different lengths, some without EOS),
  ``ragged_k3_epoch2`` (ragged, ``kl_estimator = "k3"``, non-default γ, λ, β, ε, ε_v, vf_coef, two
  PPO epochs with a large learning rate, captured in the SECOND epoch so that the ratio and the
  value prediction have moved and both clip branches are exercised), ``ragged_whiten_rewards``
  (``whiten_rewards=True``: checked with ``--set whiten_rewards=masked_no_shift``). Written with
  ``refppo.dump.write.write_dump`` (sidecar: hyperparameters and convention); ``NAME.set.json`` holds
  TRL's ``kl_estimator`` (the preset's conventions outrank the sidecar's) and the case's ``set``.
- :data:`DETECT_CASES` (``tools/peers detect``, :func:`make_detect_cases`): every option of the TRL
  rows of ``spec/conventions.md`` that changes a dumped quantity (``kl_estimator`` k1/k3,
  ``kl_coef``, ``whiten_rewards``, ``missing_eos_penalty`` / ``stop_token``, ``gamma``, ``lam``,
  ``cliprange``, ``cliprange_value``, ``vf_coef``), each in a combination :data:`CASES` does not run
  (k3 on full rows, whitened rewards with k3 or on full rows, rows without a penalty, captures in
  the second epoch with k1, ...). Written as ``peers.makers.common.save`` does (``NAME.pt``,
  ``NAME.pt.json`` with the hyperparameters only, so ``--detect`` starts from refppo's defaults,
  ``NAME.set.json``: TRL's ``kl_estimator`` and, with ``whiten_rewards=True``,
  ``whiten_rewards=masked_no_shift``) plus ``NAME.facts.json``.
"""

from __future__ import annotations

import copy
import json
import random
import tempfile
from pathlib import Path
from typing import Any

B, T, PROMPT_LEN = 16, 12, 8

CASES: dict[str, dict[str, Any]] = {
    "full": {"stop_token": None, "eos_boost": 0.0, "capture_epoch": 0, "config": {}},
    "ragged": {
        "stop_token": "eos",
        "eos_boost": 1.0,
        "capture_epoch": 0,
        "config": {"missing_eos_penalty": 1.0},
    },
    "ragged_k3_epoch2": {
        "stop_token": "eos",
        "eos_boost": 1.0,
        "capture_epoch": 1,
        "config": {
            "missing_eos_penalty": 0.5,
            "kl_estimator": "k3",
            "gamma": 0.99,
            "lam": 0.9,
            "kl_coef": 0.1,
            "cliprange": 0.1,
            "cliprange_value": 0.02,
            "vf_coef": 0.5,
            "num_ppo_epochs": 2,
            "learning_rate": 3e-3,
        },
    },
    "ragged_whiten_rewards": {
        "stop_token": "eos",
        "eos_boost": 1.0,
        "capture_epoch": 0,
        "config": {"missing_eos_penalty": 1.0, "whiten_rewards": True, "gamma": 0.95, "lam": 0.9},
        # PPOConfig.whiten_rewards: masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)
        "set": {"whiten_rewards": "masked_no_shift"},
    },
}


def build_trainer(spec: dict[str, Any]) -> tuple[Any, Any]:
    """TRL's ``PPOTrainer`` (and its ``PPOConfig``) on the tiny offline set-up of case ``spec``."""
    import torch
    from datasets import Dataset  # type: ignore[import-not-found]  # trl venv only
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel
    from trl.experimental.ppo import PPOConfig, PPOTrainer  # type: ignore[import-not-found]  # trl venv only

    from refppo.train.tasks.words import WordsTask, build_tokenizer

    torch.set_num_threads(2)
    tok = build_tokenizer()
    task = WordsTask(prompt_words=(6, 6))
    rng = random.Random(0)
    prompts = [tok(task.prompt(rng), add_special_tokens=False)["input_ids"] for _ in range(B)]
    assert all(len(x) == PROMPT_LEN for x in prompts)
    ds = Dataset.from_dict({"input_ids": prompts})

    def cfg(labels: int | None = None, tied: bool = True) -> Any:
        kw: dict[str, Any] = {"num_labels": labels} if labels else {}
        return GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied,
                          pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, **kw)  # fmt: skip

    torch.manual_seed(0)
    policy = GPT2LMHeadModel(cfg(tied=False))
    with torch.no_grad():
        # Give the random policy a fixed logit offset per token: feature 0 of the final layer norm
        # is the constant 1 (weight 0, bias 1) and column 0 of the (untied) LM head holds the offsets.
        # The pad token is never sampled (a pad at position 0 would leave a row without a valid
        # token) and EOS is made likely when the case wants ragged rows.
        policy.transformer.ln_f.weight[0] = 0.0
        policy.transformer.ln_f.bias[0] = 1.0
        offset = torch.zeros(policy.lm_head.weight.shape[0])
        offset[tok.pad_token_id] = -30.0
        offset[tok.eos_token_id] = float(spec["eos_boost"])
        policy.lm_head.weight[:, 0] = offset
    ref = copy.deepcopy(policy)
    with torch.no_grad():  # a reference policy that differs from the policy, so that KL != 0
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reward = GPT2ForSequenceClassification(cfg(1))
    value = GPT2ForSequenceClassification(cfg(1))
    conf_kw: dict[str, Any] = {
        "per_device_train_batch_size": B, "gradient_accumulation_steps": 1, "num_mini_batches": 1,
        "num_ppo_epochs": 1, "learning_rate": 3e-6, "response_length": T, "temperature": 0.7,
        "total_episodes": B, "missing_eos_penalty": None, "stop_token": spec["stop_token"],
        "local_rollout_forward_batch_size": B, "num_sample_generations": 0, "report_to": "none",
        "use_cpu": True, "bf16": False, "fp16": False, "save_strategy": "no", "logging_steps": 1,
        "seed": 0,
    }  # fmt: skip
    conf_kw.update(spec["config"])
    out = tempfile.mkdtemp(prefix="trl-validate-")
    conf = PPOConfig(output_dir=out, **conf_kw)
    trainer = PPOTrainer(args=conf, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                         train_dataset=ds, value_model=value)  # fmt: skip
    return trainer, conf


def run_trl(case: str, spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Run one TRL PPO iteration; return (dump tensors, hparams, convention) and some facts."""
    from refppo.capture.adapters.trl import capture_train_locals, dump_from_locals, trl_hparams

    trainer, conf = build_trainer(spec)
    c = capture_train_locals(trainer, epoch=int(spec["capture_epoch"]))
    tensors = dump_from_locals(c)
    mask = tensors["response_mask"]
    lengths = mask.sum(1)
    if int(lengths.min()) < 1:
        raise RuntimeError(f"{case}: a row has no valid response token (lengths {lengths.tolist()})")
    hp, convention = trl_hparams(conf)
    convention.pop("whiten_rewards", None)  # checked with the case's --set (the preset outranks the sidecar)
    facts = {
        "response_lengths": lengths.tolist(),
        "rows_without_eos": int((~c["contain_eos_token"]).sum()),
        "scores": [round(float(s), 4) for s in c["scores"]],
        "pg_clipfrac": float(c["pg_clipfrac"]),
        "vf_clipfrac": float(c["vf_clipfrac"]),
        "approxkl": float(c["approxkl"]),
    }
    return tensors, {"hparams": hp, "convention": convention}, facts


_EPOCH2 = {"num_ppo_epochs": 2, "learning_rate": 3e-3}
"""Captured in the second PPO epoch: the ratio and the value prediction have moved, so both clip
branches of the policy and the value loss fire."""

DETECT_CASES: dict[str, dict[str, Any]] = {
    # k3 on full-width rows (CASES runs k1 there)
    "trl_k3_full": {
        "stop_token": None,
        "eos_boost": 0.0,
        "capture_epoch": 0,
        "config": {"kl_estimator": "k3"},
    },
    # ragged rows without the EOS penalty; k3, no KL in the reward at all
    "trl_k3_ragged_nopenalty_klcoef0": {
        "stop_token": "eos",
        "eos_boost": 1.0,
        "capture_epoch": 0,
        "config": {"kl_estimator": "k3", "kl_coef": 0.0, "gamma": 0.9, "lam": 1.0},
    },
    # k1, second epoch, every loss hyperparameter off its default
    "trl_k1_ragged_epoch2_clips": {
        "stop_token": "eos",
        "eos_boost": 1.0,
        "capture_epoch": 1,
        "config": {
            "missing_eos_penalty": 2.0,
            "kl_coef": 0.2,
            "gamma": 0.97,
            "lam": 0.8,
            "cliprange": 0.15,
            "cliprange_value": 0.05,
            "vf_coef": 0.3,
            **_EPOCH2,
        },
    },
    # whitened rewards with k3, in the second epoch
    "trl_k3_whiten_rewards_epoch2": {
        "stop_token": "eos",
        "eos_boost": 1.0,
        "capture_epoch": 1,
        "config": {
            "kl_estimator": "k3",
            "whiten_rewards": True,
            "missing_eos_penalty": 0.5,
            "kl_coef": 0.1,
            "cliprange": 0.1,
            "cliprange_value": 0.02,
            "vf_coef": 0.5,
            **_EPOCH2,
        },
    },
    # whitened rewards on full-width rows (the score slot is the last position)
    "trl_k1_whiten_rewards_full": {
        "stop_token": None,
        "eos_boost": 0.0,
        "capture_epoch": 0,
        "config": {"whiten_rewards": True, "gamma": 0.99, "lam": 0.95},
    },
}


def make_preset_cases(out: Path) -> list[str]:
    """Every case of :data:`CASES` as ``trl_CASE.safetensors`` + sidecar + ``.set.json`` (+ facts)."""
    from refppo.dump.write import write_dump

    made = []
    for case, spec in CASES.items():
        tensors, side, facts = run_trl(case, spec)
        name = f"trl_{case}"
        write_dump(
            out / f"{name}.safetensors", tensors, hparams=side["hparams"], convention=side["convention"]
        )
        sets = {"kl_estimator": side["convention"]["kl_estimator"], **spec.get("set", {})}
        (out / f"{name}.set.json").write_text(json.dumps(sets))
        (out / f"{name}.facts.json").write_text(json.dumps(facts))
        made.append(name)
    return made


def make_detect_cases(out: Path) -> list[str]:
    """Every case of :data:`DETECT_CASES` (module docstring); raises, after writing the others,
    when a case could not run."""
    import traceback

    import torch

    made: list[str] = []
    failed: dict[str, str] = {}
    for name, spec in DETECT_CASES.items():
        try:
            tensors, side, facts = run_trl(name, spec)
        except Exception as exc:  # go on with the others; the run still fails below
            failed[name] = f"{type(exc).__name__}: {exc} | {traceback.format_exc().splitlines()[-2:]}"
            continue
        conv = {"kl_estimator": spec["config"].get("kl_estimator", "k1")}
        if spec["config"].get("whiten_rewards"):
            conv["whiten_rewards"] = "masked_no_shift"
        torch.save({k: v.detach().contiguous() for k, v in tensors.items()}, out / f"{name}.pt")
        (out / f"{name}.pt.json").write_text(json.dumps(side["hparams"]))
        (out / f"{name}.set.json").write_text(json.dumps(conv))
        (out / f"{name}.facts.json").write_text(json.dumps(facts))
        made.append(name)
    if failed:
        raise RuntimeError(f"{len(failed)} TRL case(s) could not run (made {made}): {failed}")
    return made
