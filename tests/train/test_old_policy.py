"""Old-policy freezing, shown both ways (issue #3, item 5).

(a) the cached π_old log-probs equal what a deep-copied snapshot of the old actor computes, at
    every PPO epoch and minibatch — both against the snapshot directly and through the naive
    update path (refppo.pipeline.naive) that keeps a real snapshot network and recomputes from it;
(b) at the first minibatch of the first epoch the ratio is exactly 1 (clipfrac 0, approx-KL 0);
(c) log-probs from ``generate(output_scores=True)`` vs the teacher-forced pass: measured.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from refppo.models.batch import SequenceBatch, left_pad
from refppo.models.readout import response_logprobs
from refppo.models.roles import eval_mode, make_reference
from refppo.models.rollout import RolloutConfig, ScoredRollout, generate_rollout, score_rollout
from refppo.models.rollout_naive import score_rollout_naive
from refppo.models.tiny import Arch, tiny_actor, tiny_critic
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import RolloutQuantities, rollout_quantities
from refppo.train.update import ppo_update
from refppo.train.update_config import MinibatchRecord, PPOUpdateConfig
from refppo.train.update_naive import ppo_update_naive

ARCHS: list[Arch] = ["gpt2", "llama"]
VOCAB = 32
PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 10], [1, 3], [1, 11, 12, 13]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def setup(
    arch: Arch, *, dropout: float = 0.1, temperature: float = 0.9
) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module, ScoredRollout, RolloutQuantities]:
    actor = tiny_actor(arch, VOCAB, seed=0, hidden=32, dropout=dropout)
    critic = tiny_critic(arch, VOCAB, seed=1, hidden=32, dropout=dropout)
    ref = make_reference(actor)
    pids, pm = left_pad(PROMPTS, 0)
    batch = generate_rollout(
        actor,
        pids,
        pm,
        RolloutConfig(max_new_tokens=6, temperature=temperature),
        torch.Generator().manual_seed(7),
    )

    def reward(p: list[int], r: list[int]) -> float:
        return float(sum(1 for tok in r if tok % 2 == 0)) / 6.0

    scored = score_rollout(actor, ref, critic, reward, batch, temperature=temperature)
    q = rollout_quantities(
        scores=scored.scores,
        old_logprobs=scored.old_logprobs,
        ref_logprobs=scored.ref_logprobs,
        old_values=scored.old_values,
        mask=batch.response_mask,
        hp=Hyperparams(),
        conv=Convention(),
    )
    return actor, critic, ref, scored, q


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_old_logprobs_equal_snapshot_at_every_minibatch(arch: Arch) -> None:
    actor, critic, _, scored, q = setup(arch)
    snapshot = copy.deepcopy(actor)
    actor_n, critic_n = copy.deepcopy(actor), copy.deepcopy(critic)
    cfg = PPOUpdateConfig(ppo_epochs=3, num_minibatches=2, micro_batch_size=1)
    recs: list[MinibatchRecord] = []
    opt_a, opt_c = (
        torch.optim.Adam(actor.parameters(), lr=1e-2),
        torch.optim.Adam(critic.parameters(), lr=1e-2),
    )
    ppo_update(
        actor, critic, opt_a, opt_c, scored, q, hp=Hyperparams(), conv=Convention(), cfg=cfg,
        generator=torch.Generator().manual_seed(3), on_minibatch=recs.append,
    )  # fmt: skip
    assert len(recs) == 6
    moved = 0.0
    for r in recs:
        with torch.no_grad(), eval_mode(snapshot):
            snap_lp, _ = response_logprobs(snapshot, scored.batch.select(r.rows), scored.temperature)
        torch.testing.assert_close(r.old_logprobs, snap_lp, atol=1e-6, rtol=0.0)
        m = scored.batch.response_mask[r.rows]
        moved = max(moved, float((r.logprobs - r.old_logprobs)[m].abs().max()))
    assert moved > 1e-3, "the live actor must have moved away from π_old (else the test is vacuous)"
    # the naive update keeps a REAL snapshot network and recomputes π_old at every minibatch
    perms = [torch.cat([r.rows for r in recs if r.epoch == e]) for e in range(cfg.ppo_epochs)]
    scored_n = score_rollout_naive(
        actor_n, make_reference(actor_n), critic_n, lambda p, r: 0.0, scored.batch,
        temperature=scored.temperature, eos_token_id=2,
    )  # fmt: skip
    torch.testing.assert_close(scored_n.old_logprobs, scored.old_logprobs, atol=1e-5, rtol=0.0)
    steps = ppo_update_naive(
        actor_n, critic_n, torch.optim.Adam(actor_n.parameters(), lr=1e-2),
        torch.optim.Adam(critic_n.parameters(), lr=1e-2), scored, q,
        hp=Hyperparams(), conv=Convention(), cfg=cfg, perms=perms,
    )  # fmt: skip
    for r, s in zip(recs, steps, strict=True):
        assert s.rows == r.rows.tolist()
        torch.testing.assert_close(s.snapshot_logprobs, r.old_logprobs, atol=1e-5, rtol=0.0)
        for k in ("pg_loss", "vf_loss", "approx_kl"):
            assert abs(s.stats[k] - r.stats[k]) <= 1e-4, (k, s.stats[k], r.stats[k])
    # the updated actors agree as functions (raw parameters can differ by up to ~lr where the
    # exact gradient is 0, e.g. the attention key bias: Adam turns rounding noise into steps)
    with torch.no_grad(), eval_mode(actor, actor_n):
        lp, lp_n = response_logprobs(actor, scored.batch)[0], response_logprobs(actor_n, scored.batch)[0]
    torch.testing.assert_close(lp_n, lp, atol=1e-4, rtol=0.0)


@pytest.mark.parametrize("arch", ARCHS)
def test_first_minibatch_ratio_is_exactly_one(arch: Arch) -> None:
    """Dropout configured (0.1) and micro-batches of 1 row: the update's forwards run in eval mode
    like the cached old log-probs, so the first ratio is exactly 1 — bit for bit."""
    actor, critic, _, scored, q = setup(arch, dropout=0.1)
    a2, c2 = copy.deepcopy(actor), copy.deepcopy(critic)
    recs: list[MinibatchRecord] = []
    cfg = PPOUpdateConfig(ppo_epochs=1, num_minibatches=2, micro_batch_size=1)
    m = ppo_update(
        actor, critic, torch.optim.Adam(actor.parameters(), lr=1e-2),
        torch.optim.Adam(critic.parameters(), lr=1e-2), scored, q, hp=Hyperparams(), conv=Convention(),
        cfg=cfg, generator=torch.Generator().manual_seed(0), on_minibatch=recs.append,
    )  # fmt: skip
    assert m["first_ratio_max_dev"] == 0.0
    assert m["first_pg_clipfrac"] == 0.0
    assert m["first_approx_kl"] == 0.0
    assert torch.equal(recs[0].logprobs, recs[0].old_logprobs)
    # control: with dropout active in the update the first ratio is no longer 1
    m2 = ppo_update(
        a2, c2, torch.optim.Adam(a2.parameters(), lr=1e-2), torch.optim.Adam(c2.parameters(), lr=1e-2),
        scored, q, hp=Hyperparams(), conv=Convention(),
        cfg=PPOUpdateConfig(ppo_epochs=1, dropout_in_update=True), generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert m2["first_ratio_max_dev"] > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_scores_vs_teacher_forced(arch: Arch) -> None:
    """transformers ``generate(output_scores=True)`` returns the PROCESSED scores. Plain sampling
    (temperature only): they agree with the teacher-forced pass to ≈5e-7 in fp32 on CPU. With a
    top-k warper the scores are renormalised over the k survivors: off by log Σ_top-k p (≈2.3
    here). refppo recomputes π_old with a teacher-forced pass (spec/models.md)."""
    actor = tiny_actor(arch, 64, seed=0, hidden=32)
    actor.eval()
    pids, pm = left_pad(PROMPTS, 0)
    devs = {}
    for name, kw in {"plain": {"top_k": 0}, "top_k=5": {"top_k": 5}}.items():
        torch.manual_seed(0)
        out = actor.generate(
            input_ids=pids, attention_mask=pm.long(), do_sample=True, max_new_tokens=6, temperature=0.9,
            top_p=1.0, output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=2, **kw,
        )  # fmt: skip
        resp = out.sequences[:, pids.shape[1] :]
        is_eos = (resp == 2).long()
        mask = (is_eos.cumsum(1) - is_eos) == 0  # up to and including the first EOS
        scores = torch.stack(out.scores, dim=1).float()
        lp_gen = torch.log_softmax(scores, -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            lp_tf, _ = response_logprobs(actor, SequenceBatch(pids, pm, resp, mask), temperature=0.9)
        devs[name] = float((lp_gen - lp_tf)[mask].abs().max())
    print(f"{arch}: max |generate-scores logp - teacher-forced logp| = {devs}")
    assert devs["plain"] <= 1e-5
    assert devs["top_k=5"] > 1e-2
