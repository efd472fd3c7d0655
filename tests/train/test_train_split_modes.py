"""The trainer's split step under ``ppo.rollout_rs_effect=drop_mask`` (issue #22, verl 0.9.1) and
``loss_agg=prompt-mean`` (issue #23, SkyRL 0.4.0): :func:`refppo.train.update.ppo_update` with one
row per micro-batch (and two simulated ranks) takes the step of the whole batch's loss composed
here from the core's functions directly — the gate's kept tokens as the mask, the rows it empties
out of every count; each prompt's token mean, then the mean over prompts. Controls: the same core
loss with the sampled mask's counts (the trainer's counts before this mode), and each piece's own
prompts, are other steps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from refppo.core.aggregate import aggregate_loss, prompt_mean_loss
from refppo.core.objective import total_loss
from refppo.core.policy import clipped_policy_token_loss
from refppo.core.rollout_correction import rejection_mask
from refppo.core.value import value_token_loss
from refppo.models.batch import left_pad
from refppo.models.readout import response_logprobs, response_values
from refppo.models.roles import make_reference
from refppo.models.rollout import RolloutConfig, ScoredRollout, generate_rollout, score_rollout
from refppo.models.tiny import tiny_actor, tiny_critic
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import RolloutQuantities, rollout_quantities
from refppo.rollout_conventions import ISLevel
from refppo.train.update import ppo_update
from refppo.train.update_config import Behaviour, PPOUpdateConfig

VOCAB = 32
PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 10], [1, 3], [1, 11, 12, 13]]
LENGTHS = [6, 2, 4, 1]
HP = Hyperparams(ent_coef=0.01, vf_coef=0.5)
GATE = {
    "rollout_rs": "token",
    "rollout_rs_effect": "drop_mask",
    "rollout_rs_low": 0.75,
    "rollout_rs_high": 1.3,
}
"""A token gate on the ratio ``π^prox/π^beh`` in [0.75, 1.3]: some tokens of rows 0–2 out, row 3 emptied."""


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _setup(conv: Convention) -> tuple[nn.Module, nn.Module, ScoredRollout, RolloutQuantities, Tensor]:
    """Tiny actor and critic, 4 responses of lengths 6, 2, 4, 1, their rollout quantities under
    ``conv`` and behaviour log-probs: ``old + N(0, 0.3)`` on rows 0–2, ``old + 2`` on row 3 (its one
    token far outside any band: the gate empties it)."""
    actor = tiny_actor("gpt2", VOCAB, seed=0, hidden=32)
    critic = tiny_critic("gpt2", VOCAB, seed=1, hidden=32)
    pids, pm = left_pad(PROMPTS, 0)
    batch = generate_rollout(
        actor, pids, pm, RolloutConfig(max_new_tokens=6), torch.Generator().manual_seed(4)
    )
    keep = batch.response_mask & (torch.arange(6) < torch.tensor([[n] for n in LENGTHS]))
    batch = type(batch)(batch.prompt_ids, batch.prompt_mask, batch.response_ids, keep)
    ref = make_reference(actor)
    with torch.no_grad():  # the actor off the reference: a KL in the reward
        for p in actor.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    scored = score_rollout(actor, ref, critic, lambda p, r: float(sum(r) % 7) / 7.0, batch)
    noise = 0.3 * torch.randn(scored.old_logprobs.shape, generator=torch.Generator().manual_seed(9))
    noise[3] = 2.0
    beh = torch.where(keep, scored.old_logprobs + noise, torch.zeros_like(noise))
    q = rollout_quantities(
        scores=scored.scores, old_logprobs=scored.old_logprobs, ref_logprobs=scored.ref_logprobs,
        old_values=scored.old_values, mask=keep, hp=HP, conv=conv, rollout_logprobs=beh,
    )  # fmt: skip
    return actor, critic, scored, q, beh


def _params(*models: nn.Module) -> Tensor:
    return torch.cat([p.detach().flatten() for m in models for p in m.parameters()])


def _trainer_delta(conv: Convention, micro: int, rows: Tensor | None = None, **kw: Any) -> Tensor:
    """The parameter change of one SGD step (lr 1: −gradient) of :func:`ppo_update` (one epoch, one
    minibatch, ``micro`` rows per micro-batch, no shuffle, no clipping) on ``rows`` (None: all)."""
    actor, critic, scored, q, beh = _setup(conv)
    if rows is not None:  # one simulated rank's rows
        scored, beh = scored.select(rows), beh[rows]
        q = RolloutQuantities(*(getattr(q, f)[rows] for f in q.__dataclass_fields__))
    before = _params(actor, critic)
    cfg = PPOUpdateConfig(
        ppo_epochs=1, num_minibatches=1, micro_batch_size=micro, max_grad_norm=None, shuffle=False
    )
    opt = torch.optim.SGD([*actor.parameters(), *critic.parameters()], lr=1.0)
    pv = torch.zeros(int(beh.shape[0]), dtype=torch.long)
    ppo_update(
        actor, critic, opt, None, scored, q, hp=HP, conv=conv, cfg=cfg, generator=torch.Generator(),
        behaviour=Behaviour(beh, pv, 1), **kw,
    )  # fmt: skip
    return _params(actor, critic) - before


def _ranks_delta(conv: Convention, groups: Tensor | None = None) -> Tensor:
    """Two simulated ranks (rows {0, 1} and {2, 3}, one row per micro-batch): each rank's counts
    all-reduced (a first pass records the vector each rank sends), its loss × 2, then the gradients
    averaged as DDP does."""
    halves = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    sent: list[list[Tensor]] = [[], []]

    def kw(r: int) -> dict[str, Any]:
        return {"world_size": 2, "group_index": None if groups is None else groups[halves[r]]}

    def recorder(r: int) -> Callable[[Tensor], Tensor]:
        def send(t: Tensor) -> Tensor:
            sent[r].append(t.clone())
            return t

        return send

    for r, h in enumerate(halves):
        _trainer_delta(conv, 1, h, all_reduce=recorder(r), **kw(r))
    assert [len(s) for s in sent] == [1, 1]  # one count vector per optimizer step
    deltas = [
        _trainer_delta(conv, 1, h, all_reduce=lambda t, o=sent[1 - r][0]: t + o, **kw(r))
        for r, h in enumerate(halves)
    ]
    return (deltas[0] + deltas[1]) / 2


Agg = Callable[[Tensor, Tensor], Tensor]


def _core_delta(conv: Convention, mask_of: Callable[[Tensor, Tensor], Tensor], agg: Agg, vagg: Agg) -> Tensor:
    """The same step from the whole batch's loss composed from the core's functions: ``mask_of(m,
    beh)`` the update's mask, rows without a token left out; ``agg(per_token, mask)`` the policy
    and entropy aggregation over the rows kept, ``vagg`` the value loss's."""
    actor, critic, scored, q, beh = _setup(conv)
    before = _params(actor, critic)
    m = mask_of(scored.batch.response_mask, beh)
    rows = m.any(dim=1)
    lp, ent = response_logprobs(actor, scored.batch, scored.temperature)
    values = response_values(critic, scored.batch)
    pol = clipped_policy_token_loss(
        lp[rows], scored.old_logprobs[rows], q.advantages[rows], m[rows], clip_low=HP.cliprange
    )
    vm = q.value_mask[rows] & m[rows]
    val = value_token_loss(
        values[rows], scored.old_values[rows], q.returns[rows], vm, clip=HP.cliprange_value
    )
    ent_rows = torch.where(m[rows], ent[rows], torch.zeros_like(ent[rows]))
    loss = total_loss(
        agg(pol.per_token, m[rows]), vagg(val.per_token, vm), agg(ent_rows, m[rows]),
        vf_coef=HP.vf_coef, ent_coef=HP.ent_coef,
    )  # fmt: skip
    loss.backward()
    with torch.no_grad():
        for p in [*actor.parameters(), *critic.parameters()]:
            if p.grad is not None:
                p.sub_(p.grad)
    return _params(actor, critic) - before


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_drop_mask_micro_batches_take_the_whole_batch_core_step(agg: str) -> None:
    """One row per micro-batch (micro-batch 3 holds the emptied row only: a zero backward) and two
    simulated ranks equal the core's whole-batch step on the gate's mask; the core step with the
    sampled mask's counts (the rejected tokens and the emptied row still counted) is another."""
    conv = Convention.of(**GATE, loss_agg=agg)
    _, _, scored, _, beh = _setup(conv)
    old, sampled_mask = scored.old_logprobs, scored.batch.response_mask

    def gated(m: Tensor, b: Tensor) -> Tensor:
        return m & rejection_mask(old, b, m, level=ISLevel.TOKEN, low=0.75, high=1.3)

    kept = gated(sampled_mask, beh)
    assert kept.sum(dim=1).tolist()[3] == 0  # row 3 emptied
    assert 0 < int(kept[:3].sum()) < int(sampled_mask[:3].sum())  # tokens of rows 0–2 rejected
    whole = _core_delta(
        conv, gated, lambda x, m: aggregate_loss(x, m, agg), lambda x, m: aggregate_loss(x, m, agg)
    )
    assert float(whole.abs().max()) > 1e-4
    for micro in (4, 1):
        got = _trainer_delta(conv, micro)
        torch.testing.assert_close(got, whole, atol=1e-7, rtol=1e-5, msg=f"micro={micro}")
    torch.testing.assert_close(_ranks_delta(conv), whole, atol=1e-7, rtol=1e-5, msg="2 ranks")
    n_tok, n_seq = float(sampled_mask.sum()), 4.0  # the sampled mask's counts

    def sampled(x: Tensor, m: Tensor) -> Tensor:
        return aggregate_loss(x, m, agg, token_count=n_tok, seq_count=n_seq)

    control = _core_delta(conv, gated, sampled, sampled)
    assert float((control - whole).abs().max()) > 1e-3 * float(whole.abs().max())


GROUPS = torch.tensor([2, 0, 2, 0])
"""Two prompts of two rows each, a prompt's rows in different micro-batches and ranks."""


def test_prompt_mean_micro_batches_take_the_whole_batch_core_step() -> None:
    """``loss_agg=prompt-mean`` (policy and entropy; the value loss ``token-mean``): one row per
    micro-batch and two simulated ranks equal the core's whole-batch step (each prompt's token mean,
    the mean over the 2 prompts); each piece's own prompts (no step table: every row its own prompt,
    the pieces summed) is another step."""
    conv = Convention.of(loss_agg="prompt-mean", value_loss_agg="token-mean")

    def token_mean(x: Tensor, m: Tensor) -> Tensor:
        return aggregate_loss(x, m, "token-mean")

    def every_row(m: Tensor, b: Tensor) -> Tensor:
        return m

    whole = _core_delta(conv, every_row, lambda x, m: prompt_mean_loss(x, m, GROUPS), token_mean)
    assert float(whole.abs().max()) > 1e-4
    for micro in (4, 1):
        got = _trainer_delta(conv, micro, group_index=GROUPS)
        torch.testing.assert_close(got, whole, atol=1e-7, rtol=1e-5, msg=f"micro={micro}")
    torch.testing.assert_close(_ranks_delta(conv, GROUPS), whole, atol=1e-7, rtol=1e-5, msg="2 ranks")

    def own(x: Tensor, m: Tensor) -> Tensor:
        pieces = [prompt_mean_loss(x[b : b + 1], m[b : b + 1], GROUPS[b : b + 1]) for b in range(4)]
        return torch.stack(pieces).sum()

    control = _core_delta(conv, every_row, own, token_mean)
    assert float((control - whole).abs().max()) > 1e-3 * float(whole.abs().max())
