"""refppo.ppo: exact micro-batch accumulation, the DDP hook, PPO-ptx, KL-in-loss, metrics."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import KLEstimator, KLPlacement, LossAgg, ScorePosition
from refppo.errors import ShapeError
from refppo.models.batch import left_pad
from refppo.models.readout import response_logprobs
from refppo.models.roles import eval_mode, make_reference
from refppo.models.rollout import RolloutConfig, ScoredRollout, generate_rollout, score_rollout
from refppo.models.tiny import tiny_actor, tiny_critic
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import RolloutQuantities, rollout_quantities
from refppo.train.iteration import iteration
from refppo.train.update import ppo_update, ptx_loss
from refppo.train.update_config import MinibatchRecord, PPOUpdateConfig, PtxBatch
from refppo.train.update_naive import ppo_update_naive

VOCAB = 32
PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 10], [1, 3], [1, 11, 12, 13]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def setup(conv: Convention, hp: Hyperparams) -> tuple[nn.Module, nn.Module, ScoredRollout, RolloutQuantities]:
    actor = tiny_actor("gpt2", VOCAB, seed=0, hidden=32)
    critic = tiny_critic("gpt2", VOCAB, seed=1, hidden=32)
    pids, pm = left_pad(PROMPTS, 0)
    batch = generate_rollout(
        actor, pids, pm, RolloutConfig(max_new_tokens=6), torch.Generator().manual_seed(4)
    )
    # responses of lengths 6, 2, 4, 1 so that the aggregation modes differ
    batch = type(batch)(
        batch.prompt_ids, batch.prompt_mask, batch.response_ids,
        batch.response_mask & (torch.arange(6) < torch.tensor([[6], [2], [4], [1]])),
    )  # fmt: skip
    ref = make_reference(actor)
    with torch.no_grad():  # move the actor off the reference so that the KL terms are non-zero
        for p in actor.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    scored = score_rollout(actor, ref, critic, lambda p, r: float(sum(r) % 7) / 7.0, batch)
    q = rollout_quantities(
        scores=scored.scores,
        old_logprobs=scored.old_logprobs,
        ref_logprobs=scored.ref_logprobs,
        old_values=scored.old_values,
        mask=batch.response_mask,
        hp=hp,
        conv=conv,
    )
    return actor, critic, scored, q


def update_delta(
    actor: nn.Module,
    critic: nn.Module,
    scored: ScoredRollout,
    q: RolloutQuantities,
    cfg: PPOUpdateConfig,
    conv: Convention,
    hp: Hyperparams,
    **kw: Any,
) -> torch.Tensor:
    """Parameter change of one plain-SGD step (= −lr · gradient) of copies of actor and critic."""
    a, c = copy.deepcopy(actor), copy.deepcopy(critic)
    before = torch.cat([p.detach().flatten() for p in (*a.parameters(), *c.parameters())])
    opt = torch.optim.SGD([*a.parameters(), *c.parameters()], lr=1.0)
    ppo_update(a, c, opt, None, scored, q, hp=hp, conv=conv, cfg=cfg, generator=torch.Generator(), **kw)
    after = torch.cat([p.detach().flatten() for p in (*a.parameters(), *c.parameters())])
    return after - before


@pytest.mark.parametrize("agg", list(MASK_AGGS))
def test_micro_batch_accumulation_is_exact(agg: LossAgg) -> None:
    conv = Convention.of(loss_agg=agg, score_at=ScorePosition.AFTER_LAST_VALID)
    hp = Hyperparams(ent_coef=0.01)
    actor, critic, scored, q = setup(conv, hp)
    one = PPOUpdateConfig(ppo_epochs=1, max_grad_norm=None, shuffle=False)
    micro = PPOUpdateConfig(ppo_epochs=1, max_grad_norm=None, shuffle=False, micro_batch_size=1)
    d_one = update_delta(actor, critic, scored, q, one, conv, hp)
    d_micro = update_delta(actor, critic, scored, q, micro, conv, hp)
    assert float(d_one.abs().max()) > 1e-4
    torch.testing.assert_close(d_micro, d_one, atol=1e-7, rtol=1e-5)


def test_mean_of_micro_means_would_differ() -> None:
    """Control for the test above: with LOCAL normalisers (a mean of micro-batch means) the
    token-mean gradient is not the one-shot gradient when lengths differ (verl #5625)."""
    conv, hp = Convention(), Hyperparams()
    actor, _critic, scored, q = setup(conv, hp)
    a = copy.deepcopy(actor)
    grads = []
    for split in (False, True):
        a.zero_grad()
        groups = [torch.arange(4)] if not split else [torch.tensor([i]) for i in range(4)]
        for idx in groups:
            lp, _ = response_logprobs(a, scored.batch.select(idx))
            m = scored.batch.response_mask[idx]
            ratio = torch.exp(lp - scored.old_logprobs[idx])
            loss = -(q.advantages[idx] * ratio)[m].mean() / len(groups)
            torch.autograd.backward(loss)
        grads.append(torch.cat([p.grad.flatten() for p in a.parameters() if p.grad is not None]))
    assert float((grads[0] - grads[1]).abs().max()) > 1e-4


@pytest.mark.parametrize("agg", [LossAgg.TOKEN_MEAN, LossAgg.SEQ_MEAN_TOKEN_MEAN])
def test_ddp_hook_reproduces_single_process(agg: LossAgg) -> None:
    """Two simulated ranks (rows {0,1} and {2,3}): counts all-reduced through the hook, loss × 2,
    then gradients averaged as DDP does — equals one process on the whole batch."""
    conv, hp = Convention.of(loss_agg=agg), Hyperparams()
    actor, critic, scored, q = setup(conv, hp)
    cfg = PPOUpdateConfig(ppo_epochs=1, max_grad_norm=None, shuffle=False)
    single = update_delta(actor, critic, scored, q, cfg, conv, hp)
    halves = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    m, vm = scored.batch.response_mask, q.value_mask
    counts = [torch.tensor([float(m[h].sum()), 2.0, float(vm[h].sum())], dtype=torch.float64) for h in halves]
    deltas = []
    for r, h in enumerate(halves):
        other = counts[1 - r]
        q_r = RolloutQuantities(*(getattr(q, f)[h] for f in q.__dataclass_fields__))
        deltas.append(
            update_delta(
                actor,
                critic,
                scored.select(h),
                q_r,
                cfg,
                conv,
                hp,
                world_size=2,
                all_reduce=lambda t, o=other: t + o,
            )
        )
    ddp = (deltas[0] + deltas[1]) / 2
    torch.testing.assert_close(ddp, single, atol=1e-7, rtol=1e-5)
    # without the world_size scaling the step would be half as large
    assert float((deltas[0] / 2 + deltas[1] / 2 - single / 2).abs().max()) > 1e-5


def test_ptx_term() -> None:
    conv, hp = Convention(), Hyperparams()
    actor, critic, scored, q = setup(conv, hp)
    ids = torch.tensor([[1, 4, 5, 6, 7], [0, 0, 1, 8, 9]])
    am = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    ptx = PtxBatch(ids, am)
    with torch.no_grad(), eval_mode(actor):
        got = float(ptx_loss(actor, ptx))
        nll = []
        for seq in ([1, 4, 5, 6, 7], [1, 8, 9]):  # naive: each sequence alone, token by token
            for t in range(1, len(seq)):
                out = actor(input_ids=torch.tensor([seq[:t]])).logits[0, -1]
                nll.append(-float(torch.log_softmax(out.double(), -1)[seq[t]]))
    assert abs(got - sum(nll) / len(nll)) < 1e-5
    base = PPOUpdateConfig(ppo_epochs=1, max_grad_norm=None, shuffle=False)
    with_ptx = PPOUpdateConfig(ppo_epochs=1, max_grad_norm=None, shuffle=False, ptx_coef=0.5)
    d0 = update_delta(actor, critic, scored, q, base, conv, hp, ptx_batch=ptx)
    d1 = update_delta(actor, critic, scored, q, with_ptx, conv, hp, ptx_batch=ptx)
    assert float((d1 - d0).abs().max()) > 1e-4


def test_kl_in_loss_and_entropy_bonus_match_naive_update() -> None:
    conv = Convention.of(
        kl_in=KLPlacement.LOSS, kl_estimator=KLEstimator.K3, loss_agg=LossAgg.SEQ_MEAN_TOKEN_SUM
    )
    hp = Hyperparams(kl_coef=0.3, ent_coef=0.05)
    actor, critic, scored, q = setup(conv, hp)
    assert float(q.kl.abs().max()) == 0.0  # KL is not in the reward
    cfg = PPOUpdateConfig(ppo_epochs=2, num_minibatches=2, max_grad_norm=0.5)
    a1, c1, a2, c2 = (copy.deepcopy(m) for m in (actor, critic, actor, critic))
    recs: list[MinibatchRecord] = []
    opt1 = torch.optim.SGD([*a1.parameters(), *c1.parameters()], lr=0.05)
    metrics = ppo_update(
        a1, c1, opt1, None, scored, q, hp=hp, conv=conv, cfg=cfg,
        generator=torch.Generator().manual_seed(0), on_minibatch=recs.append,
    )  # fmt: skip
    assert metrics["kl_loss"] > 0.0 and metrics["entropy"] > 0.0
    perms = [torch.cat([r.rows for r in recs if r.epoch == e]) for e in range(2)]
    opt2 = torch.optim.SGD([*a2.parameters(), *c2.parameters()], lr=0.05)
    steps = ppo_update_naive(a2, c2, opt2, None, scored, q, hp=hp, conv=conv, cfg=cfg, perms=perms)
    for r, s in zip(recs, steps, strict=True):
        for k in ("loss", "kl_loss", "entropy", "pg_loss", "vf_loss", "actor_grad_norm"):
            assert abs(r.stats[k] - s.stats[k]) <= 1e-5 * max(1.0, abs(s.stats[k])), (
                k,
                r.stats[k],
                s.stats[k],
            )
    for p1, p2 in zip(
        [*a1.parameters(), *c1.parameters()], [*a2.parameters(), *c2.parameters()], strict=True
    ):
        torch.testing.assert_close(p1, p2, atol=1e-6, rtol=1e-5)


def test_seq_mean_token_sum_norm_update_matches_naive_with_micro_batches() -> None:
    # Dr. GRPO's mode is a mean over the minibatch's sequences (verl 0.9.1 agg_loss, SkyRL-train
    # 0.3.1 reduce_loss): split into micro-batches of one row, each must divide by the minibatch's
    # sequence count, not its own. The naive twin aggregates each minibatch whole, row by row.
    conv = Convention.of(loss_agg=LossAgg.SEQ_MEAN_TOKEN_SUM_NORM, score_at=ScorePosition.AFTER_LAST_VALID)
    hp = Hyperparams(ent_coef=0.05)
    actor, critic, scored, q = setup(conv, hp)
    cfg = PPOUpdateConfig(ppo_epochs=1, num_minibatches=2, micro_batch_size=1, max_grad_norm=None)
    a1, c1, a2, c2 = (copy.deepcopy(m) for m in (actor, critic, actor, critic))
    recs: list[MinibatchRecord] = []
    opt1 = torch.optim.SGD([*a1.parameters(), *c1.parameters()], lr=0.05)
    ppo_update(
        a1, c1, opt1, None, scored, q, hp=hp, conv=conv, cfg=cfg,
        generator=torch.Generator().manual_seed(0), on_minibatch=recs.append,
    )  # fmt: skip
    perms = [torch.cat([r.rows for r in recs])]
    opt2 = torch.optim.SGD([*a2.parameters(), *c2.parameters()], lr=0.05)
    steps = ppo_update_naive(a2, c2, opt2, None, scored, q, hp=hp, conv=conv, cfg=cfg, perms=perms)
    for r, s in zip(recs, steps, strict=True):
        for k in ("loss", "entropy", "pg_loss", "vf_loss", "actor_grad_norm"):
            assert abs(r.stats[k] - s.stats[k]) <= 1e-5 * max(1.0, abs(s.stats[k])), (
                k,
                r.stats[k],
                s.stats[k],
            )
    for p1, p2 in zip(
        [*a1.parameters(), *c1.parameters()], [*a2.parameters(), *c2.parameters()], strict=True
    ):
        torch.testing.assert_close(p1, p2, atol=1e-6, rtol=1e-5)


def test_iteration_metrics() -> None:
    actor = tiny_actor("llama", VOCAB, seed=0, hidden=32)
    critic = tiny_critic("llama", VOCAB, seed=1, hidden=32)
    ref = make_reference(actor)
    pids, pm = left_pad(PROMPTS, 0)
    opt_a = torch.optim.Adam(actor.parameters(), lr=1e-2)
    opt_c = torch.optim.Adam(critic.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    kw: dict[str, Any] = {
        "rollout_cfg": RolloutConfig(max_new_tokens=5, missing_eos_penalty=0.25),
        "update_cfg": PPOUpdateConfig(ppo_epochs=2, num_minibatches=2),
        "hp": Hyperparams(kl_coef=0.1),
        "conv": Convention(),
        "generator": g,
    }
    first = iteration(actor, ref, critic, lambda p, r: 1.0, opt_a, opt_c, pids, pm, **kw)
    assert first.metrics["kl"] == 0.0  # the actor starts at the reference
    res = iteration(actor, ref, critic, lambda p, r: 1.0, opt_a, opt_c, pids, pm, **kw)
    m, s = res.metrics, res.scored
    mask = s.batch.response_mask
    assert m["score"] == pytest.approx(float(s.scores.double().mean()))
    assert m["score"] == pytest.approx(1.0 - 0.25 * (1.0 - float(s.has_eos.double().mean())))
    kl_manual = (
        sum(
            sum(float(s.old_logprobs[b, t] - s.ref_logprobs[b, t]) for t in range(5) if mask[b, t])
            for b in range(4)
        )
        / 4
    )
    assert m["kl"] == pytest.approx(kl_manual, abs=1e-6) and m["kl"] != 0.0
    assert m["non_score_reward"] == pytest.approx(-0.1 * kl_manual, abs=1e-6)
    assert m["response_length"] == pytest.approx(float(mask.sum()) / 4)
    for k in ("pg_loss", "vf_loss", "pg_clipfrac", "approx_kl", "entropy", "actor_grad_norm"):
        assert k in m
    assert 0.0 <= m["pg_clipfrac"] <= 1.0


def test_uneven_split_raises() -> None:
    conv, hp = Convention(), Hyperparams()
    actor, critic, scored, q = setup(conv, hp)
    opt = torch.optim.SGD([*actor.parameters(), *critic.parameters()], lr=0.1)
    with pytest.raises(ShapeError, match="evenly"):
        ppo_update(
            actor, critic, opt, None, scored, q, hp=hp, conv=conv,
            cfg=PPOUpdateConfig(num_minibatches=3), generator=torch.Generator(),
        )  # fmt: skip
