"""``refppo.capture.adapters`` without the peers: duck-typed containers, metrics, gradients, errors.

The peers' own containers are exercised by ``tests/peers/test_adapters.py`` (side venvs); here the
containers are plain stand-ins with the peers' field names, and the expected dumps are written out
by hand.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from refppo.capture.adapters.openrlhf import from_openrlhf, openrlhf_hparams
from refppo.capture.adapters.trl import dump_from_locals, trl_hparams
from refppo.capture.adapters.verl import from_verl, verl_hparams


class _Metric:
    """The attributes of verl's ``Metric`` that the adapter reads."""

    def __init__(self, how: str, values: list[float]) -> None:
        self.aggregation = types.SimpleNamespace(value=how)
        self.values = values

    def aggregate(self) -> float:
        return sum(self.values) if self.aggregation.value == "sum" else sum(self.values) / len(self.values)


def _verl_batch() -> dict[str, torch.Tensor]:
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    return {
        "responses": torch.tensor([[5, 6, 7], [8, 0, 0]]),
        "attention_mask": torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
        "old_log_probs": torch.full((2, 3), -1.0, dtype=torch.float64),
        "ref_log_prob": torch.full((2, 3), -1.5, dtype=torch.float64),
        "values": torch.zeros(2, 3, dtype=torch.float64),
        "token_level_scores": torch.tensor([[0.0, 0.0, 2.0], [-1.0, 0.0, 0.0]], dtype=torch.float64) * mask,
        "token_level_rewards": torch.tensor([[-0.1, -0.1, 1.9], [-1.1, 0.0, 0.0]], dtype=torch.float64),
        "advantages": torch.ones(2, 3, dtype=torch.float64),
        "returns": torch.ones(2, 3, dtype=torch.float64),
    }


def test_verl_batch_keys_become_dump_keys_and_the_mask_is_the_response_slice() -> None:
    dump = from_verl(
        types.SimpleNamespace(batch=_verl_batch()), {"actor/pg_loss": 0.25, "critic/vf_loss": [0.5]}
    )
    assert dump["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]  # attention_mask[:, -3:]
    assert dump["scores"].tolist() == [2.0, -1.0]  # row sums of token_level_scores
    assert torch.equal(dump["old_logprobs"], torch.full((2, 3), -1.0, dtype=torch.float64))
    assert torch.equal(dump["ref_logprobs"], torch.full((2, 3), -1.5, dtype=torch.float64))
    assert "old_values" in dump and "values" not in dump  # verl's values are the rollout-time ones
    assert dump["token_rewards"][1, 0].item() == -1.1
    assert dump["pg_loss"].item() == 0.25 and dump["pg_loss"].dtype == torch.float64
    assert dump["vf_loss"].item() == 0.5


def test_verl_gradients_come_from_the_leaves_autograd_went_through() -> None:
    lp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    (lp * torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=torch.float64)).sum().backward()
    dump = from_verl(_verl_batch(), logprobs=lp)
    assert dump["grad_logprobs"].tolist() == [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]
    assert "grad_values" not in dump  # no values given: nothing invented
    assert not dump["logprobs"].requires_grad


def test_verl_metrics_summed_over_micro_batches_are_read_and_a_mean_is_refused() -> None:
    dump = from_verl(_verl_batch(), {"actor/pg_loss": _Metric("sum", [0.125, 0.5])})
    assert dump["pg_loss"].item() == 0.625
    with pytest.raises(ValueError, match=r"actor/pg_clipfrac.*2 micro-batch values.*'mean'"):
        from_verl(_verl_batch(), {"actor/pg_clipfrac": _Metric("mean", [0.1, 0.3])})
    with pytest.raises(ValueError, match=r"critic/vf_clipfrac.*2 values"):
        from_verl(_verl_batch(), {"critic/vf_clipfrac": [0.1, 0.2]})


def test_verl_missing_keys_are_named() -> None:
    batch = _verl_batch()
    del batch["old_log_probs"], batch["token_level_scores"]
    with pytest.raises(ValueError, match="missing old_log_probs, token_level_scores"):
        from_verl(batch)


def test_verl_behaviour_log_probs_map_and_the_reference_and_critic_are_optional() -> None:
    """A β = 0 critic-free verl batch (no ``ref_log_prob``, no ``values``) with the engine's
    ``rollout_log_probs``: the three roles are the dump's, nothing is invented for the others."""
    batch = _verl_batch()
    del batch["ref_log_prob"], batch["values"]
    batch["rollout_log_probs"] = torch.full((2, 3), -1.25, dtype=torch.float64)
    dump = from_verl(batch, logprobs=torch.full((2, 3), -0.5, dtype=torch.float64))
    assert dump["rollout_logprobs"][0, 0].item() == -1.25 and dump["old_logprobs"][0, 0].item() == -1.0
    assert dump["logprobs"][0, 0].item() == -0.5
    assert not {"ref_logprobs", "old_values", "rollout_log_probs"} & set(dump)


def test_verl_rollout_correction_config_becomes_the_rollout_is_keys() -> None:
    from refppo.capture.adapters.verl import verl_correction

    assert verl_correction(None) == {} and verl_correction({"rollout_is": None}) == {}
    assert verl_correction({"rollout_is": "token", "rollout_is_threshold": 2.0}) == {
        "rollout_is": "token", "rollout_is_mode": "truncate", "rollout_is_low": None, "rollout_is_high": 2.0,
    }  # fmt: skip
    assert verl_correction({"rollout_is": "sequence", "rollout_is_threshold": "0.5_5.0"}) == {
        "rollout_is": "sequence", "rollout_is_mode": "mask", "rollout_is_low": 0.5, "rollout_is_high": 5.0,
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"rollout_correction.rollout_rs='token' has no refppo counterpart"):
        verl_correction({"rollout_is": "token", "rollout_rs": "token"})
    with pytest.raises(ValueError, match=r"rollout_is_batch_normalize=True"):
        verl_correction({"rollout_is": "token", "rollout_is_batch_normalize": True})
    cfg: dict[str, Any] = {
        "algorithm": {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 1.5}}
    }
    assert verl_hparams(cfg)[1]["rollout_is_high"] == 1.5


def test_verl_hparams_read_verls_config_names() -> None:
    cfg: dict[str, Any] = {
        "algorithm": {"gamma": 0.9, "lam": 0.8, "use_kl_in_reward": False},
        "actor_rollout_ref": {
            "actor": {
                "clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.3, "clip_ratio_c": 2.5,
                "loss_agg_mode": "seq-mean-token-sum", "entropy_coeff": 0.01, "use_kl_loss": True,
                "kl_loss_type": "low_var_kl", "kl_loss_coef": 0.02,
            }
        },
        "critic": {"cliprange_value": 0.4, "loss_agg_mode": "token-mean"},
    }  # fmt: skip
    hp, conv = verl_hparams(cfg)
    assert hp == {
        "gamma": 0.9, "lam": 0.8, "kl_coef": 0.02, "cliprange": 0.1, "cliprange_high": 0.3,
        "cliprange_value": 0.4, "vf_coef": 1.0, "ent_coef": 0.01, "separate_critic": True,
    }  # fmt: skip
    assert conv == {
        "kl_estimator": "k3", "kl_in": "loss", "loss_agg": "seq-mean-token-sum", "dual_clip": 2.5,
        "value_loss_agg": "token-mean",
    }  # fmt: skip
    cfg["actor_rollout_ref"]["actor"]["use_kl_loss"] = False
    assert verl_hparams(cfg)[0]["kl_coef"] == 0.0  # no KL anywhere
    cfg["algorithm"].update(use_kl_in_reward=True, kl_penalty="mse", kl_ctrl={"kl_coef": 0.07})
    hp, conv = verl_hparams(cfg)
    assert (hp["kl_coef"], conv["kl_estimator"], conv["kl_in"]) == (0.07, "k2", "reward")
    cfg["algorithm"]["kl_penalty"] = "full"
    with pytest.raises(ValueError, match="'full' has no refppo counterpart"):
        verl_hparams(cfg)


def _experience(with_ref: bool) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        action_mask=torch.tensor([[True, True], [True, False]]),
        action_log_probs=torch.full((2, 2), -1.0),
        base_action_log_probs=torch.full((2, 2), -2.0) if with_ref else None,
        values=torch.full((2, 2), 0.5),
        rewards=torch.tensor([1.0, 3.0]),
        kl=None,
        advantages=torch.ones(2, 2),
        returns=torch.full((2, 2), 2.0),
        info={"ppo_clip_ratio": torch.tensor(0.25), "ppo_kl": torch.tensor(0.0625)},
    )


def test_openrlhf_fields_and_policy_loss_outputs_become_dump_keys() -> None:
    vals = torch.zeros(2, 2, requires_grad=True)
    (3.0 * vals).sum().backward()
    pol = (torch.tensor(0.5), torch.tensor(0.125), torch.tensor(0.03125), None, None)
    dump = from_openrlhf(_experience(True), policy_loss=pol, value_loss=torch.tensor(0.75), values=vals)
    assert dump["response_mask"].tolist() == [[True, True], [True, False]]
    assert dump["scores"].tolist() == [1.0, 3.0]
    assert dump["ref_logprobs"][0, 0].item() == -2.0 and dump["old_values"][0, 0].item() == 0.5
    assert "kl" not in dump  # None in the Experience: left out, not zero-filled
    # the PolicyLoss tuple wins over experience.info (it is this step's output)
    assert (dump["pg_loss"].item(), dump["pg_clipfrac"].item(), dump["approx_kl"].item()) == (
        0.5,
        0.125,
        0.03125,
    )
    assert dump["vf_loss"].item() == 0.75
    assert dump["grad_values"].tolist() == [[3.0, 3.0], [3.0, 3.0]]
    info_only = from_openrlhf(_experience(True))
    assert (info_only["pg_clipfrac"].item(), info_only["approx_kl"].item()) == (0.25, 0.0625)


def test_openrlhf_without_reference_log_probs_leaves_them_out_or_takes_them() -> None:
    """``make_experience`` drops ``base_action_log_probs`` (β = 0: there are none): the dump has no
    reference (the oracle requires it where a KL term with β > 0 reads it); given, it is the dump's."""
    assert "ref_logprobs" not in from_openrlhf(_experience(False))
    dump = from_openrlhf(_experience(False), ref_logprobs=torch.full((2, 2), -3.0))
    assert dump["ref_logprobs"][1, 1].item() == -3.0


def test_openrlhf_behaviour_log_probs_and_the_is_correction_config() -> None:
    from refppo.capture.adapters.openrlhf import openrlhf_correction

    exp = _experience(True)
    exp.rollout_log_probs = torch.full((2, 2), -1.5)
    exp.values = None  # critic-free (REINFORCE++, GRPO): no critic values
    dump = from_openrlhf(exp)
    assert dump["rollout_logprobs"][0, 1].item() == -1.5 and "old_values" not in dump

    def args(**adv: Any) -> types.SimpleNamespace:
        return types.SimpleNamespace(algo=types.SimpleNamespace(advantage=types.SimpleNamespace(**adv)))

    assert openrlhf_correction(args(is_correction_level="off")) == {}
    assert openrlhf_correction(args()) == {}
    on = {
        "is_correction_level": "token",
        "is_correction_gating": "ratio",
        "is_correction_threshold": [0.5, 1.5],
    }
    assert openrlhf_correction(args(**on, is_correction_mode="clip")) == {
        "rollout_is": "token", "rollout_is_mode": "truncate", "rollout_is_low": 0.5, "rollout_is_high": 1.5,
    }  # fmt: skip
    assert openrlhf_correction(args(**on, is_correction_mode="mask"))["rollout_is_mode"] == "mask"
    with pytest.raises(ValueError, match="is_correction_level='seq'"):
        openrlhf_correction(args(**{**on, "is_correction_level": "seq"}, is_correction_mode="clip"))


def test_trl_grpo_inputs_become_dump_keys() -> None:
    from refppo.capture.adapters.trl_grpo import from_trl_grpo, trl_grpo_hparams

    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    inputs = {
        "completion_mask": mask,
        "advantages": torch.tensor([0.5, -0.5, 1.0, -1.0], dtype=torch.float64),
        "sampling_per_token_logps": torch.full((4, 3), -2.0, dtype=torch.float64),
        "num_items_in_batch": mask.sum(),
    }
    lp = torch.full((4, 3), -1.0, dtype=torch.float64, requires_grad=True)
    (3.0 * lp).sum().backward()
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    dump = from_trl_grpo(inputs, scores=scores, num_generations=2, logprobs=lp, loss=0.25, pg_loss=0.25)
    assert dump["advantages"].tolist() == [
        [0.5, 0.5, 0.0],
        [-0.5, -0.5, -0.5],
        [1.0, 0.0, 0.0],
        [-1.0, -1.0, 0.0],
    ]
    assert dump["group_index"].tolist() == [0, 0, 1, 1]  # contiguous blocks of num_generations
    assert dump["rollout_logprobs"][0, 0].item() == -2.0
    assert dump["old_logprobs"][0, 0].item() == -1.0  # no old_per_token_logps: TRL's detached forward
    assert "ref_logprobs" not in dump and dump["grad_logprobs"][0, 0].item() == 3.0
    with pytest.raises(ValueError, match="no old_per_token_logps"):
        from_trl_grpo(inputs, scores=scores, num_generations=2)
    cfg = types.SimpleNamespace(
        beta=0.0, epsilon=0.2, epsilon_high=0.28, scale_rewards=False, loss_type="dr_grpo",
        max_completion_length=3, use_vllm=True, vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_min=0.5,
        vllm_importance_sampling_clip_max=3.0,
    )  # fmt: skip
    hp, conv = trl_grpo_hparams(cfg)
    assert hp == {"kl_coef": 0.0, "cliprange": 0.2, "cliprange_high": 0.28, "horizon": 3.0}
    assert (conv["advantage"], conv["loss_agg"], conv["rollout_is"], conv["rollout_is_mode"]) == (
        "dr-grpo", "seq-mean-token-sum-norm", "sequence", "mask",
    )  # fmt: skip
    assert (conv["rollout_is_low"], conv["rollout_is_high"], conv["rollout_is_agg"]) == (0.5, 3.0, "product")


def test_openrlhf_hparams_read_openrlhfs_args() -> None:
    ns = types.SimpleNamespace
    args = ns(
        algo=ns(advantage=ns(gamma=1.0, lambd=0.95), kl=ns(init_coef=0.01, estimator="k2", use_loss=False)),
        actor=ns(
            eps_clip_low_high=(0.2, 0.3),
            dual_clip=None,
            entropy_coef=None,
            loss_agg_mode="seq-mean-token-mean",
        ),
        critic=ns(value_clip=0.2),
        reward=ns(clip_range=(-5.0, 5.0)),
    )
    hp, conv = openrlhf_hparams(args)
    assert (hp["kl_coef"], hp["cliprange"], hp["cliprange_high"], hp["ent_coef"]) == (0.01, 0.2, 0.3, 0.0)
    assert conv == {
        "kl_estimator": "k2",
        "kl_in": "reward",
        "loss_agg": "seq-mean-token-mean",
        "score_clip": 5.0,
    }
    args.reward.clip_range = (-1.0, 5.0)
    with pytest.raises(ValueError, match="symmetric"):
        openrlhf_hparams(args)


def _trl_locals(order: list[int]) -> dict[str, Any]:
    b = len(order)
    rows = torch.arange(b, dtype=torch.float32).unsqueeze(1).expand(b, 3)
    idx = torch.tensor(order)
    return {
        "padding_mask": torch.zeros(b, 3, dtype=torch.bool),
        **{
            k: rows.clone()
            for k in ("logprobs", "ref_logprobs", "values", "kl", "rewards", "advantages", "returns")
        },
        "scores": torch.arange(b, dtype=torch.float32),
        "micro_batch_inds": idx.numpy(),
        "new_logprobs": rows[idx] + 100.0,  # in the shuffled order of the micro-batch
        "vpred": rows[idx] + 200.0,
        "grad_new_logprobs": rows[idx] + 300.0,
        **{
            k: torch.tensor(0.0)
            for k in ("pg_loss", "pg_clipfrac", "approxkl", "vf_loss", "vf_clipfrac", "loss")
        },
    }


def test_trl_update_tensors_and_gradients_are_put_back_into_rollout_order() -> None:
    dump = dump_from_locals(_trl_locals([2, 0, 3, 1]))
    assert dump["logprobs"][:, 0].tolist() == [100.0, 101.0, 102.0, 103.0]
    assert dump["values"][:, 0].tolist() == [200.0, 201.0, 202.0, 203.0]
    assert dump["grad_logprobs"][:, 0].tolist() == [300.0, 301.0, 302.0, 303.0]
    assert "grad_values" not in dump
    assert dump["response_mask"].all()


def test_trl_a_micro_batch_that_is_not_the_whole_step_is_refused() -> None:
    loc = _trl_locals([2, 0, 3, 1])
    loc["micro_batch_inds"] = loc["micro_batch_inds"][:2]
    with pytest.raises(ValueError, match=r"2 of 4 rows.*num_mini_batches=1"):
        dump_from_locals(loc)


def test_trl_hparams_map_whiten_rewards() -> None:
    conf = types.SimpleNamespace(gamma=1.0, lam=0.95, kl_coef=0.05, cliprange=0.2, cliprange_value=0.2,
                                 vf_coef=0.1, kl_estimator="k1", whiten_rewards=True)  # fmt: skip
    hp, conv = trl_hparams(conf)
    assert hp["vf_coef"] == 0.1 and "separate_critic" not in hp  # one optimizer for policy and value head
    assert conv == {"kl_estimator": "k1", "whiten_rewards": "masked_no_shift"}


def test_rows_of_a_v2_step_carry_their_micro_batch_and_rank() -> None:
    dump = from_verl(_verl_batch(), micro_batch=torch.tensor([1, 0]), rank=torch.tensor([0, 1]))
    assert dump["micro_batch"].tolist() == [1, 0] and dump["rank"].tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"rank: expected a \[B\] integer tensor, got torch.float32"):
        from_openrlhf(_experience(True), rank=torch.zeros(2))


class _FakePPOTrainer:
    """A ``train`` with the local names of TRL's ``PPOTrainer.train``: 2 PPO epochs, one minibatch and
    one micro-batch each, the rows of the micro-batch shuffled as ``[1, 0]``; the loss's gradient on
    ``new_logprobs`` is ``(epoch + 1)·C`` and on ``vpred`` 1."""

    C = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])

    def train(self) -> None:
        logprobs = ref_logprobs = values = kl = rewards = advantages = returns = torch.zeros(2, 3)
        scores, sequence_lengths = torch.zeros(2), torch.tensor([2, 2])
        padding_mask = padding_mask_p1 = torch.zeros(2, 3, dtype=torch.bool)
        contain_eos_token = torch.ones(2, dtype=torch.bool)
        leaf = torch.zeros(2, 3, requires_grad=True)
        for ppo_epoch_idx in range(2):
            minibatch_idx = 0
            gradient_accumulation_idx = 0
            micro_batch_inds = [1, 0]
            new_logprobs = leaf * 1.0
            vpred = leaf + 1.0
            pg_loss = vf_loss = pg_clipfrac = vf_clipfrac = torch.tensor(0.0)
            loss = (new_logprobs * self.C * (ppo_epoch_idx + 1.0)).sum() + vpred.sum()
            loss.backward()
            approxkl = torch.tensor(0.5)
            del loss, approxkl
        del logprobs, ref_logprobs, values, kl, rewards, advantages, returns, scores, sequence_lengths
        del padding_mask, padding_mask_p1, contain_eos_token, micro_batch_inds, pg_loss, vf_loss
        del pg_clipfrac, vf_clipfrac, minibatch_idx, gradient_accumulation_idx
        _after_the_step()


def _after_the_step() -> None:
    """Called by the fake ``train`` after the captured step: a restored outer tracer sees it."""


def test_trl_tracer_keeps_the_gradients_of_the_chosen_epoch_and_restores_a_previous_tracer() -> None:
    import sys

    from refppo.capture.adapters.trl import trace_ppo_step

    seen: list[str] = []

    def outer(frame: Any, event: str, arg: Any) -> Any:
        seen.append(frame.f_code.co_name)
        return None

    previous = sys.gettrace()
    sys.settrace(outer)
    try:
        dump = trace_ppo_step(_FakePPOTrainer(), epoch=1)
        after = sys.gettrace()
    finally:
        sys.settrace(previous)
    assert after is outer and "_after_the_step" in seen  # restored as soon as the step was copied
    # epoch 1 (factor 2), the micro-batch's rows [1, 0] put back in rollout order
    assert dump["grad_logprobs"].tolist() == [[8.0, 10.0, 12.0], [2.0, 4.0, 6.0]]
    assert dump["grad_values"].tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    assert trace_ppo_step(_FakePPOTrainer(), epoch=0, grads=False).keys().isdisjoint({"grad_logprobs"})


def test_trl_tracer_says_when_it_never_saw_the_step() -> None:
    from refppo.capture.adapters.trl import trace_ppo_step

    with pytest.raises(RuntimeError, match=r"never saw `approxkl` in _FakePPOTrainer.train \(PPO epoch 5\)"):
        trace_ppo_step(_FakePPOTrainer(), epoch=5)


@pytest.mark.parametrize(
    ("name", "est"),
    [
        ("kl+", "k1+"),
        ("k1+", "k1+"),
        ("low_var_kl+", "k3+"),
        ("k3+", "k3+"),
        ("abs+", "abs+"),
        ("mse+", "k2"),
        ("k2+", "k2"),
    ],
)
def test_verl_hparams_map_the_straight_through_kl_names(name: str, est: str) -> None:
    """verl's ``+`` names (tools/peers/kl_straight_through.py runs verl 0.9.1's kl_penalty on them)."""
    cfg: dict[str, Any] = {
        "algorithm": {"use_kl_in_reward": False},
        "actor_rollout_ref": {"actor": {"use_kl_loss": True, "kl_loss_type": name, "kl_loss_coef": 0.02}},
    }
    hp, conv = verl_hparams(cfg)
    assert (conv["kl_estimator"], conv["kl_in"], hp["kl_coef"]) == (est, "loss", 0.02)
    cfg["actor_rollout_ref"]["actor"]["use_kl_loss"] = False
    cfg["algorithm"].update(use_kl_in_reward=True, kl_penalty=name, kl_ctrl={"kl_coef": 0.07})
    assert verl_hparams(cfg)[1]["kl_estimator"] == est


def test_verl_kl_map_agrees_with_the_peer_validated_names() -> None:
    """The names tools/peers/kl_straight_through.py checks against verl's code map as the adapter does."""
    import importlib.util
    import sys
    from pathlib import Path

    from refppo.capture.adapters.verl import VERL_KL

    tool = Path(__file__).resolve().parents[2] / "tools" / "peers" / "kl_straight_through.py"
    spec = importlib.util.spec_from_file_location("kl_straight_through", tool)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(tool.parents[1]))  # the module imports the package ``peers`` of tools/
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(tool.parents[1]))
    assert mod.NAMES and {k: VERL_KL.get(k) for k in mod.NAMES} == mod.NAMES
