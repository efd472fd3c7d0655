"""siirl 0.2.0's OWN PPO functions as refppo dumps (the ``siirl`` side venv; no refppo import).

siirl (sii-research/siiRL) is a verl fork: these dumps are checked under ``--preset verl``, to show
that its PPO step needs no preset of its own. What runs (unmodified, from the installed wheel),
all from ``siirl/dag_worker/core_algos.py``:

- no KL in the reward (``use_kl_in_reward: False``, the default: ``dagworker.py`` hands
  ``token_level_scores`` on as ``token_level_rewards``). ``apply_kl_penalty`` is CALLED once and
  its failure recorded (``siirl_facts.json``): its parameter ``kl_penalty`` (the estimator's name)
  shadows the module's ``kl_penalty`` function, so it raises ``TypeError: 'str' object is not
  callable`` — ``use_kl_in_reward: True`` cannot run in siirl 0.2.0;
- ``compute_gae_advantage_return`` (the skip-holes recursion, ``masked_whiten`` of
  ``siirl/utils/model_utils/torch_functional.py``);
- ``compute_policy_loss_vanilla`` (log ratio clamped to ±20, the dual clip for A < 0) and, with the
  KL as a loss, ``kl_penalty`` of the current log-probs aggregated by ``agg_loss`` (the actor's sum,
  restated as verl's ``dp_actor`` writes it: ``pg_loss + kl_coef·kl_loss``); ``grad_logprobs`` by
  autograd through those calls;
- ``compute_value_loss`` (½·max of the clipped and unclipped squares around the old values).

Glue restated: the score at the last valid token (``valid_response_length − 1``, as verl's reward
manager; the ``token_level_scores`` the trainer hands ``apply_kl_penalty``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peers.makers.common import HP, inputs, install_stubs, mount, save

SIIRL_KL = {"k1": "kl", "k2": "mse", "k3": "low_var_kl", "abs": "abs"}
"""refppo's KL estimator → siirl's (verl's) ``kl_penalty`` name."""

CASES: dict[str, dict[str, Any]] = {
    "no_kl_token_mean": {"est": "k1", "kl_in": None, "agg": "token-mean", "lo": 0.2, "hi": 0.2,
                         "set": {"kl_in": "reward", "loss_agg": "token-mean"},
                         "control": {"loss_agg": "seq-mean-token-mean"}},
    "k3_loss_seq_mean": {"est": "k3", "kl_in": "loss", "agg": "seq-mean-token-mean", "lo": 0.2, "hi": 0.28,
                         "set": {"kl_estimator": "k3", "kl_in": "loss", "loss_agg": "seq-mean-token-mean"},
                         "control": {"gae_padding": "through"}},
}  # fmt: skip


class _Batch(dict[str, Any]):
    """The mapping ``apply_kl_penalty`` reads (``data[key]``, ``data.batch_size``) and writes
    (``data.batch[key]``)."""

    def __init__(self, **tensors: Any) -> None:
        super().__init__(**tensors)
        self.batch = self
        self.batch_size = (tensors["response_mask"].shape[0],)


class _ActorConfig:
    """The attributes ``compute_policy_loss_vanilla`` reads from siirl's ``ActorArguments``."""

    def __init__(self, low: float, high: float) -> None:
        self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c = low, low, high, 3.0


def _load() -> Any:
    install_stubs(extra=("tensordict", "transformers", "loguru", "omegaconf"))
    for pkg in ("siirl", "siirl.utils", "siirl.utils.model_utils", "siirl.utils.extras", "siirl.params",
                "siirl.execution", "siirl.execution.scheduler", "siirl.dag_worker"):  # fmt: skip
        mount(pkg)
    from siirl.dag_worker import core_algos  # type: ignore[import-not-found]  # siirl venv only

    return core_algos


def _record_kl_in_reward(ca: Any, out: Path) -> None:
    """Call ``apply_kl_penalty`` as ``dagworker.py`` does and record what it raises (``siirl_facts.json``)."""
    import json

    x = inputs(949)
    m = x["response_mask"]
    data = _Batch(responses=m, token_level_scores=m * 0, response_mask=m, old_log_probs=x["old_logprobs"],
                  ref_log_prob=x["ref_logprobs"])  # fmt: skip
    try:
        ca.apply_kl_penalty(data, ca.FixedKLController(0.05), "kl")
        got = "no error"
    except Exception as exc:  # the recorded fact is the exception itself
        got = f"{type(exc).__name__}: {exc}"
    (out / "siirl_facts.json").write_text(json.dumps({"apply_kl_penalty": got}))


def run_case(ca: Any, seed: int, spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    x = inputs(seed)
    m = x["response_mask"]
    scores = torch.zeros_like(m)
    scores[torch.arange(m.shape[0]), (m.sum(dim=1) - 1).long()] = x["scores"]
    rewards = scores  # use_kl_in_reward False: token_level_rewards = token_level_scores
    adv, ret = ca.compute_gae_advantage_return(rewards, x["old_values"], m, HP["gamma"], HP["lam"])
    lp = x["logprobs"].clone().requires_grad_(True)
    cfg = _ActorConfig(spec["lo"], spec["hi"])
    pg, clipfrac, ppo_kl, _ = ca.compute_policy_loss_vanilla(
        x["old_logprobs"], lp, adv, m, loss_agg_mode=spec["agg"], config=cfg
    )
    keep = ("response_mask", "old_logprobs", "ref_logprobs", "old_values", "values", "scores")
    dump = {k: x[k] for k in keep}
    dump.update(logprobs=x["logprobs"], token_rewards=rewards, advantages=adv, returns=ret, pg_loss=pg,
                pg_clipfrac=clipfrac, approx_kl=ppo_kl)  # fmt: skip
    loss = pg
    if spec["kl_in"] == "loss":
        kld = ca.kl_penalty(lp, x["ref_logprobs"], kl_penalty=SIIRL_KL[spec["est"]])
        kl_loss = ca.agg_loss(loss_mat=kld, loss_mask=m, loss_agg_mode=spec["agg"])
        loss = loss + HP["kl_coef"] * kl_loss
        dump["kl_loss"] = kl_loss
    (g,) = torch.autograd.grad(loss, (lp,))
    vf, vf_clipfrac = ca.compute_value_loss(
        x["values"], ret, x["old_values"], m, cliprange_value=HP["cliprange_value"], loss_agg_mode=spec["agg"]
    )
    dump.update(loss=loss, grad_logprobs=torch.where(m.bool(), g, torch.zeros_like(g)), vf_loss=vf,
                vf_clipfrac=vf_clipfrac)  # fmt: skip
    kl_coef = HP["kl_coef"] if spec["kl_in"] == "loss" else 0.0
    sidecar = {**HP, "kl_coef": kl_coef, "cliprange": spec["lo"], "cliprange_high": spec["hi"],
               "world_size": 1, "micro_batches": 1}  # fmt: skip
    return dump, sidecar


def make(out: Path) -> list[str]:
    """Every case of :data:`CASES` as ``siirl_CASE.pt`` + sidecar + ``.set.json`` + ``.control.json``."""
    import torch

    torch.set_num_threads(1)
    ca = _load()
    _record_kl_in_reward(ca, out)
    made = []
    for i, (case, spec) in enumerate(CASES.items()):
        dump, sidecar = run_case(ca, 950 + i, spec)
        dump = {k: torch.as_tensor(v) for k, v in dump.items()}
        made.append(save(out, f"siirl_{case}", dump, sidecar, spec["set"], spec["control"]))
    return made
