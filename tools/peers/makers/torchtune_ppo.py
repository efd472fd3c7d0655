"""torchtune 0.6.1's OWN PPO recipe step as refppo dumps (the ``torchtune`` side venv; no refppo import).

What runs (unmodified, from the installed wheel): the recipe
``recipes/ppo_full_finetune_single_device.py::PPOFullFinetuneRecipeSingleDevice`` — its methods
``generate_trajectory`` (sampling with ``torchtune.generation.generate``, the log-probs, the
truncation at the first stop token ``rlhf.truncate_sequence_at_first_stop_token``, the reward
model's score at ``seq_lens + context_length``, ``rlhf.get_reward_penalty_mask`` with
``penalise_no_eos`` / ``min_response_length``, log-probs set to 1.0 on padding, ``value_seq_idxs``
and the value padding mask) and ``ppo_step`` (the current log-probs and values, ``PPOLoss``,
``loss.backward()``, ``approx_policy_kls``), called on a bare object holding the attributes they
read, with tiny random-init torchtune models (``torchtune.models.llama2.llama2`` policy and
reference, ``llama2_classifier(num_classes=1)`` value and reward models). Between them the two
calls of ``train`` are made exactly as the recipe makes them: ``rlhf.get_rewards_ppo(scores,
logprobs, ref_logprobs, kl_coeff, value_seq_idxs)`` and ``rlhf.estimate_advantages(values, rewards,
gamma, lmbda, masks=~response_padding_masks)``. One PPO mini-batch = one backward batch = the whole
batch (``gradient_accumulation_steps`` 1); a case with ``epochs = 2`` takes an SGD step after the
first ``ppo_step`` (as ``train`` steps its optimizer over policy and value parameters) and captures
the second, so the ratio and the values have moved and both clip branches fire.

The locals of ``ppo_step`` are read with a ``sys.settrace`` tracer on that frame only, which calls
``retain_grad`` on ``pi_logprobs`` and ``phi_values`` so that the recipe's own ``loss.backward()``
leaves ``grad_logprobs`` / ``grad_values`` (dump v2, one rank, one micro-batch).

Dump mapping: ``response_mask = ~response_padding_masks`` (the first stop token is a valid token),
``old_logprobs`` / ``ref_logprobs`` / ``old_values`` / ``scores`` = the trajectory's (1.0 / 1.0 / 0.0
on the padding torchtune masks; ``scores`` after the penalty), ``logprobs`` / ``values`` =
``pi_logprobs`` / ``phi_values``, ``kl``, ``token_rewards`` (``rewards``), ``advantages``,
``returns``, ``pg_loss`` (``policy_loss``), ``pg_clipfrac`` (``clipfrac``), ``vf_loss``
(``value_loss``), ``loss``, ``approx_kl`` (``approx_policy_kls``). torchtune logs no value clip
fraction: ``vf_clipfrac`` is not in the dump.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

from peers.makers.common import install_stubs, save

EXTRA_STUBS = (
    "torchao", "tiktoken", "sentencepiece", "blobfile", "kagglehub", "huggingface_hub", "tokenizers",
    "torchvision",
)  # fmt: skip
"""Imported by torchtune's package ``__init__`` files, never called by the PPO step."""

B, PROMPT, V = 12, 6, 24
PAD = 0
CASES: dict[str, dict[str, Any]] = {
    # name: stop tokens, max_generated_tokens, penalties, hyperparameters, epochs, one-token rows wanted
    "ragged": {"stop": (3, 4, 5), "T": 10, "penalise_no_eos": True, "min_len": None, "epochs": 1,
               "hp": {}, "one_token_rows": False},
    "ragged_epoch2": {"stop": (3, 4), "T": 12, "penalise_no_eos": True, "min_len": 4, "epochs": 2,
                      "hp": {"gamma": 0.95, "lmbda": 0.9, "kl_coeff": 0.1, "epsilon": 0.1,
                             "value_clip_range": 0.05, "value_coeff": 0.5}, "one_token_rows": False},
    "full": {"stop": (), "T": 8, "penalise_no_eos": False, "min_len": None, "epochs": 2, "hp": {},
             "one_token_rows": False},
    "one_token_row": {"stop": (3, 4, 5), "T": 10, "penalise_no_eos": True, "min_len": None, "epochs": 1,
                      "hp": {}, "one_token_rows": True},
}  # fmt: skip
DEFAULTS: dict[str, float] = {
    "gamma": 1.0, "lmbda": 0.95, "kl_coeff": 0.01, "epsilon": 0.2, "value_clip_range": 0.2,
    "value_coeff": 0.1,
}  # fmt: skip
"""recipes/configs/mistral/7B_full_ppo_low_memory.yaml (the wheel's one PPO config)."""


def load_recipe() -> types.ModuleType:
    """The recipe module, loaded from its file (``recipes`` refuses to be imported as a package)."""
    install_stubs(extra=EXTRA_STUBS)
    from peers.stubs import site_packages

    path = os.path.join(site_packages(), "recipes", "ppo_full_finetune_single_device.py")
    spec = importlib.util.spec_from_file_location("torchtune_ppo_recipe", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _models(seed: int, T: int) -> dict[str, Any]:
    import torch
    from torchtune.models.llama2 import llama2, llama2_classifier  # type: ignore[import-not-found]

    kw = {"vocab_size": V, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "embed_dim": 16,
          "max_seq_len": PROMPT + T + 2}  # fmt: skip
    torch.manual_seed(seed)
    policy = llama2(**kw)
    with torch.no_grad():  # the pad token is never sampled (its logit row pushed down)
        policy.output.weight[PAD].fill_(0.0)
    ref = copy.deepcopy(policy)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    value = llama2_classifier(1, **kw)
    reward = llama2_classifier(1, **kw)
    with torch.no_grad():
        reward.output.weight.mul_(20.0)  # scores of order 1
        value.output.weight.mul_(5.0)
    return {"policy": policy, "ref": ref, "value": value, "reward": reward}


def _recipe_self(spec: dict[str, Any], hp: dict[str, float], seed: int) -> Any:
    """A bare object with the attributes ``generate_trajectory`` and ``ppo_step`` read."""
    import torch
    from torchtune.rlhf.loss import PPOLoss  # type: ignore[import-not-found]

    m = _models(seed, spec["T"])
    s = types.SimpleNamespace()
    s._policy_model, s._ref_policy_model = m["policy"], m["ref"]
    s._value_model, s._reward_model = m["value"], m["reward"]
    s.cache_ctx_manager = lambda enable_kv_cache, decoder_max_seq_len: contextlib.nullcontext()
    s.enable_kv_cache = False
    s._max_generated_tokens, s._temperature, s._top_k = spec["T"], 0.7, None
    s._tokenizer = types.SimpleNamespace(pad_id=PAD)
    s._rng = torch.Generator().manual_seed(seed)
    s._stop_token_ids = torch.tensor(spec["stop"], dtype=torch.long)
    s._penalise_no_eos, s._min_response_length, s._reward_penalty = (
        spec["penalise_no_eos"],
        spec["min_len"],
        -3.0,
    )
    s._gradient_accumulation_steps = 1
    s._loss_fn = PPOLoss(
        epsilon=hp["epsilon"], value_clip_range=hp["value_clip_range"], value_coeff=hp["value_coeff"]
    )
    return s


def _traced_ppo_step(recipe: Any, s: Any, *args: Any) -> dict[str, Any]:
    """Run the recipe's ``ppo_step``; return its frame's locals at return (gradients retained)."""
    code = recipe.PPOFullFinetuneRecipeSingleDevice.ppo_step.__code__
    seen: dict[str, Any] = {}

    def local(frame: Any, event: str, arg: Any) -> Any:
        for name in ("pi_logprobs", "phi_values"):
            t = frame.f_locals.get(name)
            if t is not None and t.requires_grad and not t.retains_grad:
                t.retain_grad()
        if event == "return":
            seen.update(frame.f_locals)
        return local

    def glob(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code is code else None

    sys.settrace(glob)
    try:
        recipe.PPOFullFinetuneRecipeSingleDevice.ppo_step(s, *args)
    finally:
        sys.settrace(None)
    return seen


def run_case(
    recipe: Any, name: str, spec: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    import torch
    from torchtune import rlhf  # type: ignore[import-not-found]  # torchtune venv only

    hp = {**DEFAULTS, **spec["hp"]}
    R = recipe.PPOFullFinetuneRecipeSingleDevice
    for seed in range(200):  # the first seed whose rows have (or lack) a one-token response
        s = _recipe_self(spec, hp, seed)
        g = torch.Generator().manual_seed(1000 + seed)
        prompts = torch.randint(1, V, (B, PROMPT), generator=g)
        prompts[torch.isin(prompts, s._stop_token_ids)] = 1
        with torch.no_grad():
            tr = R.generate_trajectory(s, prompts)
        lens = (~tr.response_padding_masks).sum(1)
        if bool((lens == 1).any()) == spec["one_token_rows"] and (
            not spec["stop"] or bool((lens < spec["T"]).any())
        ):
            break
    else:
        raise RuntimeError(f"{name}: no seed gives the rows the case wants")
    rewards, kl, _ = rlhf.get_rewards_ppo(
        tr.scores, tr.logprobs, tr.ref_logprobs, hp["kl_coeff"], tr.value_seq_idxs
    )
    adv, ret = rlhf.estimate_advantages(
        tr.values, rewards, hp["gamma"], hp["lmbda"], masks=~tr.response_padding_masks
    )
    params = [*s._policy_model.parameters(), *s._value_model.parameters()]
    for _ in range(spec["epochs"] - 1):  # train's optimizer step between PPO epochs (plain SGD here)
        R.ppo_step(s, tr, adv, ret, PROMPT)
        with torch.no_grad():
            for p in params:
                p.sub_(0.5 * p.grad)
                p.grad = None
    loc = _traced_ppo_step(recipe, s, tr, adv, ret, PROMPT)
    stats = loc["loss"], loc["policy_loss"], loc["value_loss"], loc["clipfrac"], loc["approx_policy_kls"]
    dump = {
        "response_mask": (~tr.response_padding_masks).float(),
        "old_logprobs": tr.logprobs, "ref_logprobs": tr.ref_logprobs, "old_values": tr.values,
        "scores": tr.scores, "logprobs": loc["pi_logprobs"], "values": loc["phi_values"],
        "kl": kl, "token_rewards": rewards, "advantages": adv, "returns": ret,
        "loss": stats[0], "pg_loss": stats[1], "vf_loss": stats[2], "pg_clipfrac": stats[3],
        "approx_kl": stats[4],
        "grad_logprobs": loc["pi_logprobs"].grad, "grad_values": loc["phi_values"].grad,
    }  # fmt: skip
    sidecar = {
        "gamma": hp["gamma"], "lam": hp["lmbda"], "kl_coef": hp["kl_coeff"], "cliprange": hp["epsilon"],
        "cliprange_value": hp["value_clip_range"], "vf_coef": hp["value_coeff"], "ent_coef": 0.0,
        "world_size": 1, "micro_batches": 1,
    }  # fmt: skip
    facts = {
        "seed": seed, "response_lengths": lens.tolist(), "value_seq_idxs": tr.value_seq_idxs.tolist(),
        "scores": [round(float(x), 4) for x in tr.scores], "pg_clipfrac": float(stats[3]),
    }  # fmt: skip
    return dump, sidecar, facts


CONTROLS: dict[str, dict[str, Any]] = {
    "ragged": {"whiten_advantages": "masked"},  # torchtune's whiten() adds the mean back
    "ragged_epoch2": {"approx_kl": "k1"},  # torchtune logs ½·mean((l − l_old)²) over every position
    "full": {"value_loss": "unclipped"},  # PPOLoss clips the value around the old one
    "one_token_row": {"score_at": "after_last_valid"},  # would score the one-token row at 1, not 0
}
"""``--set`` keys that must NOT reproduce each case. ``one_token_row``: torchtune scores its
one-token row at position 0 (``value_seq_idxs`` needs ``seq_lens > 0``), the preset's
``after_last_valid_unless_first``; plain ``after_last_valid`` puts it at 1."""


def make(out: Path) -> list[str]:
    """Every case of :data:`CASES` as ``torchtune_CASE.pt`` + sidecar + ``.set.json`` +
    ``.control.json`` + ``.facts.json``."""
    import json

    import torch

    torch.set_num_threads(1)
    recipe = load_recipe()
    made = []
    for case, spec in CASES.items():
        dump, sidecar, facts = run_case(recipe, case, spec)
        name = f"torchtune_{case}"
        made.append(save(out, name, dump, sidecar, {}, CONTROLS.get(case)))
        (out / f"{name}.facts.json").write_text(json.dumps(facts))
    return made
