"""A home-grown PPO step, written as a user writes their own trainer (plain torch: the KL, the
rewards, GAE, the whitening and both losses by hand, none of refppo's helpers), two micro-batches
of unequal token counts, captured by ``refppo.capture.recorder.StepRecorder`` and checked by
``refppo.testing.assert_step_matches``; then the same trainer with each of four classic bugs
switched on, one at a time (issue #21, item 4). The clean step passes; each buggy step fails with
the bug NAMED in the assertion's message:

================================ ===================================================================
bug                               the trainer's line
================================ ===================================================================
``value_clip_around_new``         ``V_clip = V + clip(V − V_old, ±ε_v)`` (around the new values)
``kl_reward_sign_flipped``        ``r_t = +β·KL_t`` (the penalty added with the wrong sign)
``ratio_against_ref``             ``ρ = exp(log π − log π_ref)`` (the reference, not the rollout)
``advantages_not_detached``       ``A = (R − V − μ)/σ`` with ``V`` the live critic output
================================ ===================================================================

Two states of the step: ``epoch=1`` (the first update after the rollout: ``V = V_old`` and
``log π = log π_old`` exactly) and ``epoch=2`` (after one SGD step on the same batch, so the ratio
moves off 1 and the value clip binds). The live-critic advantages keep their values only in epoch 1
(later they are different numbers, another bug), so that bug is checked there; the value clip around
the new values is a no-op in value at ``V = V_old``, so it is checked in epoch 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from refppo.capture.recorder import StepRecorder
from refppo.testing import assert_step_matches

VOCAB, HIDDEN, T = 11, 8, 7
LENGTHS = (7, 3, 5, 2, 6, 4, 7, 5)
MICRO_BATCHES = ((0, 1, 2), (3, 4, 5, 6, 7))  # 15 and 24 valid tokens: unequal
GAMMA, LAM, BETA, EPS, EPS_V, VF_COEF, WHITEN_EPS = 1.0, 0.95, 0.05, 0.2, 0.2, 0.1, 1e-8
HPARAMS = {
    "gamma": GAMMA,
    "lam": LAM,
    "kl_coef": BETA,
    "cliprange": EPS,
    "cliprange_value": EPS_V,
    "vf_coef": VF_COEF,
    "ent_coef": 0.0,
    "whiten_eps": WHITEN_EPS,
}


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        logp = torch.log_softmax(self.out(torch.tanh(self.emb(ids[:, :-1]))), dim=-1)
        return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(ids[:, :-1]))).squeeze(-1)


def rollout(policy: Policy, critic: Critic) -> dict[str, Tensor]:
    """What the user's rollout phase stores: ids, mask, old/ref log-probs, old values, scores, and
    the advantages and returns (KL penalty, score on the last token, GAE, whitening)."""
    g = torch.Generator().manual_seed(1)
    B = len(LENGTHS)
    ids = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    mask = torch.arange(T).expand(B, T) < torch.tensor(LENGTHS).unsqueeze(1)
    with torch.no_grad():
        old_lp, old_v = policy(ids), critic(ids)
    ref_lp = old_lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    scores = torch.randn(B, generator=g, dtype=torch.float64)
    return {"ids": ids, "mask": mask, "old_lp": old_lp, "ref_lp": ref_lp, "old_v": old_v, "scores": scores}


def advantages(b: dict[str, Tensor], sign_bug: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(whitened A, returns, raw A)``: k1 KL penalty, score at the last valid token, masked GAE."""
    mask, B = b["mask"], len(LENGTHS)
    kl = b["old_lp"] - b["ref_lp"]
    rewards = (BETA if sign_bug else -BETA) * kl * mask
    for i, n in enumerate(LENGTHS):
        rewards[i, n - 1] += b["scores"][i]
    raw = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        last, nxt_v = 0.0, 0.0
        for t in reversed(range(n)):
            delta = rewards[i, t] + GAMMA * nxt_v - b["old_v"][i, t]
            last = delta + GAMMA * LAM * last
            raw[i, t] = last
            nxt_v = b["old_v"][i, t]
    returns = raw + b["old_v"] * mask
    mu, var = raw[mask].mean(), raw[mask].var()  # unbiased
    white = torch.where(mask, (raw - mu) / torch.sqrt(var + WHITEN_EPS), 0.0)
    return white, returns, raw


def train_step(
    policy: Policy,
    critic: Critic,
    b: dict[str, Tensor],
    bug: str | None,
    rec: StepRecorder | None,
    grads_only: bool = False,
) -> None:
    """One optimizer step over the two micro-batches; token-means over the step's token count."""
    adv, returns, raw = advantages(b, sign_bug=bug == "kl_reward_sign_flipped")
    mask = b["mask"]
    n_tokens = float(mask.sum())
    mu, sigma = raw[mask].mean(), torch.sqrt(raw[mask].var() + WHITEN_EPS)
    opt = torch.optim.SGD([*policy.parameters(), *critic.parameters()], lr=0.5)
    opt.zero_grad()
    for k, rows in enumerate(MICRO_BATCHES):
        idx = torch.tensor(rows)
        m = mask[idx]
        logprobs, values = policy(b["ids"][idx]), critic(b["ids"][idx])
        old_lp, ref_lp, old_v, ret = b["old_lp"][idx], b["ref_lp"][idx], b["old_v"][idx], returns[idx]
        a = adv[idx]
        if bug == "advantages_not_detached":  # recomputed from the live critic output
            a = torch.where(m, (ret - values - mu) / sigma, 0.0)
        ratio = torch.exp(logprobs - (ref_lp if bug == "ratio_against_ref" else old_lp))
        pg_tok = torch.max(-a * ratio, -a * torch.clamp(ratio, 1 - EPS, 1 + EPS))
        pg = (pg_tok * m).sum() / n_tokens
        if bug == "value_clip_around_new":
            v_clip = values + torch.clamp(values - old_v, -EPS_V, EPS_V)
        else:
            v_clip = torch.clamp(values, old_v - EPS_V, old_v + EPS_V)
        vf_tok = 0.5 * torch.max((values - ret) ** 2, (v_clip - ret) ** 2)
        vf = (vf_tok * m).sum() / n_tokens
        loss = pg + VF_COEF * vf
        if rec is not None:
            more = (
                {}
                if grads_only
                else {"advantages": a, "returns": ret, "pg_loss": pg, "vf_loss": vf, "loss": loss}
            )
            rec.record(
                micro_batch=k, logprobs=logprobs, values=values, response_mask=m, old_logprobs=old_lp,
                ref_logprobs=ref_lp, old_values=old_v, scores=b["scores"][idx], **more,
            )  # fmt: skip
        loss.backward()
    opt.step()


def dump_step(tmp_path: Path, bug: str | None, epoch: int, grads_only: bool = False) -> Path:
    """The user's CI helper: rollout, ``epoch − 1`` unrecorded updates, then the recorded one
    (``grads_only``: no advantages, returns or losses recorded, the gradients alone)."""
    torch.manual_seed(0)
    policy, critic = Policy().double(), Critic().double()
    b = rollout(policy, critic)
    for _ in range(epoch - 1):
        train_step(policy, critic, b, bug, None)
    rec = StepRecorder(hparams=HPARAMS, conventions={"loss_agg": "token-mean"})
    train_step(policy, critic, b, bug, rec, grads_only)
    path = tmp_path / f"{bug or 'clean'}-{epoch}-{int(grads_only)}.safetensors"
    rec.write(path)
    return path


def recorded(grads_only: bool) -> tuple[str, ...]:
    """What this trainer records, required compared (it computes no KL or token rewards of its own)."""
    grads = ("grad_logprobs", "grad_values")
    return grads if grads_only else (*grads, "advantages", "returns", "pg_loss", "vf_loss", "loss")


@pytest.mark.parametrize("grads_only", [False, True])
@pytest.mark.parametrize("epoch", [1, 2])
def test_the_clean_home_grown_step_passes(tmp_path: Path, epoch: int, grads_only: bool) -> None:
    outcome = assert_step_matches(dump_step(tmp_path, None, epoch, grads_only), require=recorded(grads_only))
    assert outcome.match


CASES = [
    ("value_clip_around_new", 2),
    ("kl_reward_sign_flipped", 1),
    ("kl_reward_sign_flipped", 2),
    ("ratio_against_ref", 1),
    ("ratio_against_ref", 2),
    ("advantages_not_detached", 1),
]
NAMED = {
    "value_clip_around_new": "a known bug (value_clip_around_new): the clipped value is taken around the NEW",
    "kl_reward_sign_flipped": "a known bug (kl_reward_sign_flipped): the KL penalty is added to the reward "
    "with the wrong sign",
    "ratio_against_ref": "a known bug (ratio_against_ref): the policy ratio is taken against the reference",
    "advantages_not_detached": "the advantages are not detached and are whitened: A = (R − V − μ)/σ",
}
MISLEADING = (
    "a constant factor can point at the loss aggregation",
    "no single convention change or known bug explains",
    "no named gradient pattern reproduces",
    "run with --detect",
)


@pytest.mark.parametrize("grads_only", [False, True])
@pytest.mark.parametrize(("bug", "epoch"), CASES)
def test_each_classic_bug_fails_with_the_bug_named(
    tmp_path: Path, bug: str, epoch: int, grads_only: bool
) -> None:
    with pytest.raises(AssertionError) as err:
        assert_step_matches(dump_step(tmp_path, bug, epoch, grads_only), require=recorded(grads_only))
    text = str(err.value)
    assert "MISMATCH" in text, text
    assert f"explained by {NAMED[bug]}" in text, text
    assert "; with it every quantity in the dump matches" in text, text
    for hint in MISLEADING:
        assert hint not in text, (hint, text)
