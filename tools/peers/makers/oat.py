"""oat-llm 0.2.4 step dumps from its own ``PPOLearner.learning_step`` (run with the ``oat`` venv's python).

``oat/algorithms/ppo.py::PPOLearner.learning_step`` runs as installed on a learner object built
without ``__init__``: its ``_init`` (the loss aggregator: ``masked_mean``, or ``masked_sum`` over
``generate_max_length`` under ``critic_type=drgrpo``) on a bare ``RLLearner`` base, its
``get_batch_logps`` (``use_fused_lm_head=False``: ``log_softmax(logits / temperature)`` gathered),
``compute_ppo_advantages`` (GAE over ``response_masks``, ``masked_whiten`` when ``whiten_adv``) and
``compute_monte_carlo_advantages`` (``grpo`` / ``drgrpo``). Stand-ins, nothing of oat's arithmetic:
the policy and reference "models" return fixed logits ``[B, 1 + T, V]`` (the policy's
differentiable under autograd, its old logits under ``no_grad``), the critic returns fixed values
(differentiable under autograd), ``strategy.backward`` takes ``torch.autograd.grad`` of the loss it
is given (the policy's ``pg_loss + reg_loss`` w.r.t. the log-probs ``get_batch_logps`` returned,
the critic's ``critic_loss`` w.r.t. the values), ``optimizer_step`` does nothing, and
``torch.cuda.current_device`` answers ``"cpu"``. One prompt token per row (its row id: the
mini-batch permutation is undone from it), ``train_batch_size_per_device = B`` (one mini-batch, one
optimizer step: v2, one rank), ``num_ppo_epochs = 1``. float32 (oat's own dtype).

The behaviour (vLLM) log-probs ``action_logprobs`` are the old log-probs minus ``0.6·N(0, 1)``, so
``tis = clamp(exp(l^old − l^vllm), max=tis_c)`` binds on some tokens.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

from peers.makers.common import HP, install_stubs, mount, save

V = 11
"""Vocabulary size of the stand-in models."""

# name: PPOArgs overrides (critic_type, beta, kl_penalty_coef, tis_c, whiten_adv, gamma, lam, ...)
CASES: dict[str, dict[str, Any]] = {
    "ppo_k3_loss_tis2": dict(
        critic_type="ppo", beta=0.1, kl_penalty_coef=0.0, tis_c=2.0, gamma=0.99, lam=0.95
    ),
    "ppo_k1_reward_whiten_tis1.5": dict(
        critic_type="ppo", beta=0.0, kl_penalty_coef=0.05, tis_c=1.5, whiten_adv=True, gamma=0.99, lam=0.95
    ),
    "ppo_no_tis": dict(critic_type="ppo", beta=0.1, kl_penalty_coef=0.0, tis_c=None, gamma=1.0, lam=1.0),
    "grpo_k1_reward_tis2": dict(critic_type="grpo", beta=0.0, kl_penalty_coef=0.05, tis_c=2.0),
    "drgrpo_k3_loss_tis2": dict(critic_type="drgrpo", beta=0.05, kl_penalty_coef=0.0, tis_c=2.0),
}
N_SAMPLES = 4
"""``num_samples`` (responses per prompt): rows ``4g .. 4g+3`` are group ``g``."""
GEN_MAX = 24
"""``generate_max_length`` (Dr. GRPO's constant normaliser; refppo's ``horizon``)."""


def import_oat() -> Any:
    """``oat.algorithms.ppo`` with oat's heavy imports stubbed and a bare ``RLLearner`` base."""
    install_stubs(extra=("tyro", "tree", "transformers", "launchpad", "oat.actors", "oat.utils.data"))
    mount("oat")
    mount("oat.utils")
    mount("oat.algorithms")
    learners = types.ModuleType("oat.learners")

    class RLLearner:  # the base's _init builds models, optimisers, Ray/launchpad: nothing the step reads
        def _init(self, args: Any, actors: Any) -> None:
            return None

    class OfflineLearner:
        pass

    learners.RLLearner = RLLearner  # type: ignore[attr-defined]  # a module built by hand
    learners.OfflineLearner = OfflineLearner  # type: ignore[attr-defined]  # a module built by hand
    sys.modules["oat.learners"] = learners
    from oat.algorithms import ppo  # type: ignore[import-not-found]  # oat venv only

    return ppo


class _Model:
    """Logits ``[B, 1 + T, V]`` by row id (``input_ids[:, 0]``): ``live`` under autograd, ``frozen``
    under ``no_grad``; trimmed to the mini-batch's width."""

    def __init__(self, frozen: Any, live: Any = None) -> None:
        self.frozen, self.live = frozen, live

    def __call__(self, input_ids: Any, attention_mask: Any = None) -> Any:
        import torch

        table = self.live if (self.live is not None and torch.is_grad_enabled()) else self.frozen
        return {"logits": table[input_ids[:, 0], : input_ids.shape[1]]}


class _Critic(_Model):
    def __call__(self, input_ids: Any, attention_mask: Any = None) -> Any:
        return super().__call__(input_ids, attention_mask)["logits"]


class _Strategy:
    """``backward`` = ``torch.autograd.grad`` of the loss w.r.t. the tensors registered for the model."""

    grad_acc_step = 1

    def __init__(self, wrt: dict[int, Any], grads: dict[int, Any], losses: dict[int, Any]) -> None:
        self.wrt, self.grads, self.losses = wrt, grads, losses

    def backward(self, loss: Any, model: Any, optimizer: Any) -> None:
        import torch

        self.losses[id(model)] = loss.detach()
        (self.grads[id(model)],) = torch.autograd.grad(loss, (self.wrt[id(model)],))

    def optimizer_step(self, *args: Any) -> None:
        return None

    def get_gradient_norm(self, model: Any) -> float:
        return 0.0


def _batch(seed: int, B: int = 8, T: int = 16) -> dict[str, Any]:
    """Row lengths (row 0 full, row 1 one token), token ids (column 0 = the row id, the prompt), the
    logit tables ``[B, 1 + T, V]`` (old, live = old + 0.3·N, reference = old + 0.3·N), the critic's
    value tables ``[B, 1 + T]`` (old, live = old + 0.5·N) and the scores."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = T, 1
    ids = torch.randint(0, V, (B, 1 + T), generator=g)
    ids[:, 0] = torch.arange(B)
    att = (torch.arange(1 + T).expand(B, 1 + T) <= lengths.unsqueeze(1)).long()
    old = 1.5 * torch.randn(B, 1 + T, V, generator=g)
    v_old = torch.randn(B, 1 + T, generator=g)
    return {
        "lengths": lengths, "input_ids": ids, "attention_mask": att, "old": old,
        "live": (old + 0.3 * torch.randn(old.shape, generator=g)).requires_grad_(True),
        "ref": old + 0.3 * torch.randn(old.shape, generator=g),
        "v_old": v_old, "v_live": (v_old + 0.5 * torch.randn(v_old.shape, generator=g)).requires_grad_(True),
        "scores": torch.randn(B, generator=g), "beh_noise": torch.randn(B, T, generator=g),
    }  # fmt: skip


def _learner(ppo: Any, args: Any, b: dict[str, Any], seen: dict[str, Any]) -> Any:
    """A ``PPOLearner`` without ``__init__``: oat's ``_init`` on the bare base, the stand-in models,
    and ``get_batch_logps`` / the advantage methods wrapped to record what oat computed."""
    learner = object.__new__(ppo.PPOLearner)
    learner._init(args, [])
    policy = _Model(b["old"], b["live"])
    learner.model = policy
    learner.ref_model = _Model(b["ref"]) if (args.beta > 0 or args.kl_penalty_coef > 0) else None
    learner.critic = _Critic(b["v_old"], b["v_live"]) if args.critic_type == "ppo" else None
    wrt = {id(learner.critic): b["v_live"]}
    learner.strategy = _Strategy(wrt, seen.setdefault("grads", {}), seen.setdefault("losses", {}))
    for k in ("optimizer", "scheduler", "critic_optimizer", "critic_scheduler"):
        setattr(learner, k, None)
    logps = learner.get_batch_logps

    def get_batch_logps(**kw: Any) -> Any:
        import torch

        lp, ent = logps(**kw)
        if torch.is_grad_enabled():  # the policy-learning forward: its log-probs get the gradient
            seen.update(lp=lp, ent=ent, rows=kw["input_ids"][:, 0])
            wrt[id(policy)] = lp
        return lp, ent

    learner.get_batch_logps = get_batch_logps
    for name in ("compute_ppo_advantages", "compute_monte_carlo_advantages"):
        setattr(learner, name, _recorded(getattr(learner, name), name, seen))
    return learner


def _recorded(f: Any, name: str, seen: dict[str, Any]) -> Any:
    """``f`` that also keeps its arguments and result in ``seen[name]``."""

    def record(*a: Any) -> Any:
        out = f(*a)
        seen[name] = (a, out)
        return out

    return record


def _trajectory(b: dict[str, Any], beh: Any) -> dict[str, Any]:
    """What ``learning_step`` reads of the collated ``TransitionDataset`` batch."""
    lengths = [int(n) for n in b["lengths"]]
    return {
        "input_ids": b["input_ids"], "attention_mask": b["attention_mask"],
        "rewards": [[0.0] * (n - 1) + [float(s)] for n, s in zip(lengths, b["scores"], strict=True)],
        "prompt_ids_lens": [1] * len(lengths),
        "action_logprobs": [beh[i, :n].tolist() for i, n in enumerate(lengths)],
        "loss_masks": [True] * len(lengths),
    }  # fmt: skip


def _unpermute(x: Any, rows: Any) -> Any:
    import torch

    out = torch.zeros_like(x)
    out[rows] = x
    return out


def oat_step(ppo: Any, over: dict[str, Any], seed: int) -> dict[str, Any]:
    """One ``PPOLearner.learning_step`` under ``PPOArgs(**over)`` on a fresh batch; the dump's tensors."""
    import numpy as np
    import torch

    args = ppo.PPOArgs(
        **over, num_samples=N_SAMPLES, generate_max_length=GEN_MAX, train_batch_size_per_device=8,
        num_ppo_epochs=1, use_fused_lm_head=False, temperature=1.0, vf_coef=1.0, cliprange=0.2,
        cliprange_value=0.2,
    )  # fmt: skip
    b = _batch(seed)
    seen: dict[str, Any] = {}
    learner = _learner(ppo, args, b, seen)
    ids, att = b["input_ids"], b["attention_mask"]
    with torch.no_grad():
        old, _ = learner.get_batch_logps(model=learner.model, input_ids=ids, att_mask=att, temperature=1.0)
        ref, _ = learner.get_batch_logps(model=_Model(b["ref"]), input_ids=ids, att_mask=att, temperature=1.0)
    m = att[:, 1:].to(old.dtype)
    beh = torch.where(m.bool(), old - 0.6 * b["beh_noise"], torch.full_like(old, 7.5))
    # learning_step moves its tensors .to(torch.cuda.current_device()); a device name works as well
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]  # no GPU here
    np.random.seed(seed)  # its mini-batch permutation
    infos = learner.learning_step(_trajectory(b, beh))
    rows = seen["rows"]
    # oat's own logged clip fraction (a mean over rows of each row's token mean: clipfrac_agg=row-mean),
    # popped by make() into NAME.facts.json: --detect does not walk clipfrac_agg yet
    clipfrac = float(infos["pg_clipfrac"])
    dump: dict[str, Any] = {
        "response_mask": m, "old_logprobs": old, "rollout_logprobs": beh, "scores": b["scores"],
        "logprobs": _unpermute(seen["lp"].detach(), rows), "entropy": _unpermute(seen["ent"], rows),
        "pg_loss": infos["pg_loss"], "entropy_loss": infos["entropy"],
        "loss": seen["losses"][id(learner.model)],
        "grad_logprobs": torch.where(m.bool(), _unpermute(seen["grads"][id(learner.model)], rows), 0.0),
    }  # fmt: skip
    if learner.ref_model is not None:
        dump["ref_logprobs"] = ref
    if args.beta > 0:  # infos["pg_loss"] aliases `loss`, which `loss += reg_loss` then grows in place
        dump.update(pg_loss=infos["pg_loss"] - infos["reg_loss"], kl_loss=infos["reg_loss"] / args.beta)
        dump["logged_pg_loss"] = infos["pg_loss"]  # popped by make(): NAME.facts.json
    if args.critic_type == "ppo":
        (rewards, *_), (adv, ret, _) = seen["compute_ppo_advantages"]
        dump.update(
            token_rewards=rewards, advantages=adv, returns=ret, old_values=b["v_old"][:, :-1],
            values=b["v_live"][:, :-1].detach(), vf_loss=infos["critic_loss"] / args.vf_coef,
            vf_clipfrac=infos["vf_clipfrac"], grad_values=seen["grads"][id(learner.critic)][:, :-1] * m,
        )  # fmt: skip
    else:
        (rewards, _), adv = seen["compute_monte_carlo_advantages"]
        dump.update(token_rewards=rewards, advantages=adv[:, None] * m)
        dump["group_index"] = torch.arange(m.shape[0]) // N_SAMPLES
    dump["logged_pg_clipfrac"] = clipfrac
    return dump


def _conventions(over: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``--set`` keys over ``--preset oat`` and the sidecar of one case, from its ``PPOArgs``."""
    hp: dict[str, Any] = dict(
        HP, cliprange=0.2, cliprange_value=0.2, vf_coef=1.0, world_size=1, micro_batches=1
    )
    conv: dict[str, Any] = {}
    if over["kl_penalty_coef"] > 0:
        conv.update(kl_estimator="k1", kl_in="reward")
        hp["kl_coef"] = over["kl_penalty_coef"]
    else:
        hp["kl_coef"] = over["beta"]
    if over["critic_type"] == "ppo":
        hp.update(gamma=over["gamma"], lam=over["lam"], separate_critic=True)
        if over.get("whiten_adv"):
            conv["whiten_advantages"] = "masked"
    else:
        conv["advantage"] = {"grpo": "grpo", "drgrpo": "dr-grpo"}[over["critic_type"]]
        hp.update(gamma=1.0, lam=1.0)
    if over["critic_type"] == "drgrpo":
        hp["horizon"] = GEN_MAX
    if over["tis_c"] is None:
        conv["rollout_is"] = "none"
    elif over["tis_c"] != 2.0:
        conv["rollout_is_high"] = over["tis_c"]
    return conv, hp


CONTROLS: dict[str, dict[str, Any]] = {
    # each flips the option its case exercises; the dump must then NOT match
    "ppo_k3_loss_tis2": {"rollout_is": "none"},
    "ppo_k1_reward_whiten_tis1.5": {"rollout_is_high": 2.0},
    "ppo_no_tis": {"rollout_is": "token"},
    "grpo_k1_reward_tis2": {"group_kl": "to_go"},
    "drgrpo_k3_loss_tis2": {"loss_agg": "seq-mean-token-mean"},
}


def make(out: Path) -> list[str]:
    """One dump per case of :data:`CASES` (``oat_NAME.pt`` with its sidecar, ``--set`` and control)."""
    ppo = import_oat()
    made = []
    for i, (name, over) in enumerate(CASES.items()):
        dump = oat_step(ppo, over, 2200 + i)
        # oat's own metrics, beside the dump (spec/conventions.md, oat)
        facts = {"logged_pg_clipfrac": float(dump.pop("logged_pg_clipfrac"))}
        if "logged_pg_loss" in dump:
            facts["logged_pg_loss"] = float(dump.pop("logged_pg_loss"))
        (out / f"oat_{name}.facts.json").write_text(json.dumps(facts))
        conv, hp = _conventions(over)
        made.append(save(out, f"oat_{name}", dump, hp, conv, CONTROLS[name]))
    return made
