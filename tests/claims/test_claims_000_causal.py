"""Claims of note 000 about what each model sees (Q2, Q5, Q7, Q8), on a tiny causal transformer.

The model below is a one-layer, one-head self-attention LM with a value head, written out by hand
so that the causal mask is explicit and can be switched off (to show the tests can fail). The
expectations are computed the slow way (one forward per prefix, as during generation) and compared
with the one-pass teacher-forced read-out that PPO uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from refppo.core.logprobs import logprobs_from_logits
from refppo.core.policy import policy_ratio

F64 = torch.float64
VOCAB = 7
DIM = 8
MAX_LEN = 16


@dataclass(frozen=True)
class TinyLM:
    """Weights of a one-layer causal self-attention LM with an LM head and a scalar value head."""

    emb: Tensor
    pos: Tensor
    wq: Tensor
    wk: Tensor
    wv: Tensor
    w_mlp: Tensor
    lm_head: Tensor
    v_head: Tensor


def make_lm(seed: int) -> TinyLM:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=F64) * scale

    s = 1.0 / math.sqrt(DIM)
    return TinyLM(
        emb=rnd(VOCAB, DIM),
        pos=rnd(MAX_LEN, DIM, scale=0.5),
        wq=rnd(DIM, DIM, scale=s),
        wk=rnd(DIM, DIM, scale=s),
        wv=rnd(DIM, DIM, scale=s),
        w_mlp=rnd(DIM, DIM, scale=s),
        lm_head=rnd(DIM, VOCAB),
        v_head=rnd(DIM),
    )


def forward(m: TinyLM, ids: Tensor, *, causal: bool = True) -> tuple[Tensor, Tensor]:
    """Logits ``[B, S, V]`` and values ``[B, S]``; position ``i`` sees positions ``≤ i`` when causal."""
    S = ids.shape[1]
    h = m.emb[ids] + m.pos[:S]
    att = (h @ m.wq) @ (h @ m.wk).transpose(1, 2) / math.sqrt(DIM)
    if causal:
        keep = torch.ones(S, S, dtype=torch.bool).tril()
        att = att.masked_fill(~keep, float("-inf"))
    h = h + torch.softmax(att, dim=-1) @ (h @ m.wv)
    h = h + torch.tanh(h @ m.w_mlp)
    return h @ m.lm_head, h @ m.v_head


def generate(m: TinyLM, prompt: Tensor, n_new: int, seed: int) -> tuple[Tensor, Tensor]:
    """Sample ``n_new`` tokens autoregressively; return the response ``[B, N]`` and its log-probs.

    The log-probs are recorded at sampling time, one forward per step on the growing prefix: this
    is what a rollout caches as ``old_logprobs``.
    """
    g = torch.Generator().manual_seed(seed)
    seq = prompt
    logps = []
    for _ in range(n_new):
        logits, _ = forward(m, seq)
        logp_all = torch.log_softmax(logits[:, -1], dim=-1)
        tok = torch.multinomial(logp_all.exp(), 1, generator=g)
        logps.append(logp_all.gather(1, tok).squeeze(1))
        seq = torch.cat([seq, tok], dim=1)
    return seq[:, prompt.shape[1] :], torch.stack(logps, dim=1)


def prefix_logprobs(m: TinyLM, prompt: Tensor, response: Tensor) -> Tensor:
    """``log π(y_t | x, y_<t)`` the slow way: one forward per prefix ``(x, y_<t)``, last position read."""
    out = []
    for t in range(response.shape[1]):
        logits, _ = forward(m, torch.cat([prompt, response[:, :t]], dim=1))
        out.append(torch.log_softmax(logits[:, -1], dim=-1).gather(1, response[:, t : t + 1]).squeeze(1))
    return torch.stack(out, dim=1)


def prefix_values(m: TinyLM, prompt: Tensor, response: Tensor) -> Tensor:
    """``V(x, y_<t)`` the slow way: one forward per prefix, value at its last position."""
    out = []
    for t in range(response.shape[1]):
        _, values = forward(m, torch.cat([prompt, response[:, :t]], dim=1))
        out.append(values[:, -1])
    return torch.stack(out, dim=1)


def one_pass_logprobs(m: TinyLM, prompt: Tensor, response: Tensor, *, causal: bool = True) -> Tensor:
    """One forward on ``(x, y)``; the logits for ``y_t`` are read at the position *before* ``y_t``."""
    P, N = prompt.shape[1], response.shape[1]
    logits, _ = forward(m, torch.cat([prompt, response], dim=1), causal=causal)
    return logprobs_from_logits(logits[:, P - 1 : P + N - 1], response)


def one_pass_values(m: TinyLM, prompt: Tensor, response: Tensor, *, causal: bool = True) -> Tensor:
    """One forward on ``(x, y)``; ``V(x, y_<t)`` read at the position before ``y_t`` (same shift)."""
    P, N = prompt.shape[1], response.shape[1]
    _, values = forward(m, torch.cat([prompt, response], dim=1), causal=causal)
    return values[:, P - 1 : P + N - 1]


PROMPT = torch.tensor([[1, 4, 2], [3, 3, 0]])
N_RESP = 5


def test_rollout_logprobs_equal_one_pass_teacher_forced_logprobs() -> None:
    """Q5/Q4: the log-probs recorded while sampling equal one teacher-forced pass over (x, y)."""
    actor = make_lm(0)
    y, logp_rollout = generate(actor, PROMPT, N_RESP, seed=11)
    torch.testing.assert_close(one_pass_logprobs(actor, PROMPT, y), logp_rollout, rtol=0, atol=1e-12)
    torch.testing.assert_close(prefix_logprobs(actor, PROMPT, y), logp_rollout, rtol=0, atol=1e-12)


def test_reference_single_forward_on_prompt_plus_response() -> None:
    """Q2: ref gets (x, y) once — no generation — and y's ids index its logits one position earlier."""
    actor, ref = make_lm(0), make_lm(1)
    y, _ = generate(actor, PROMPT, N_RESP, seed=5)
    slow = prefix_logprobs(ref, PROMPT, y)  # N separate forwards, one per prefix (x, y_<t)
    fast = one_pass_logprobs(ref, PROMPT, y)  # ONE forward on the concatenation
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-12)
    # The ids of y pick entries of ref's log-softmax: fast[b, t] is log_softmax(...)[y_t] by hand.
    P = PROMPT.shape[1]
    logits, _ = forward(ref, torch.cat([PROMPT, y], dim=1))
    b, t = 1, 2
    by_hand = logits[b, P - 1 + t, y[b, t]] - torch.logsumexp(logits[b, P - 1 + t], dim=-1)
    assert abs(float(fast[b, t] - by_hand)) < 1e-12


def test_one_pass_readout_is_shifted_by_one() -> None:
    """Q2/Q8 caveat: the score for y_t is read at the position of y_{t-1}, not at y_t's own position.

    The position of ``y_t`` has already seen ``y_t``; reading there is a different (leaking) number.
    """
    ref = make_lm(1)
    y, _ = generate(make_lm(0), PROMPT, N_RESP, seed=5)
    P, N = PROMPT.shape[1], N_RESP
    logits, values = forward(ref, torch.cat([PROMPT, y], dim=1))
    unshifted = logprobs_from_logits(logits[:, P : P + N], y)
    assert not torch.allclose(unshifted, prefix_logprobs(ref, PROMPT, y), atol=1e-6)
    assert not torch.allclose(values[:, P : P + N], prefix_values(ref, PROMPT, y), atol=1e-6)


def test_critic_one_pass_with_causal_mask_equals_per_prefix_values() -> None:
    """Q7/Q8: causal mask + teacher forcing give every V(x, y_<t) in one forward pass."""
    critic = make_lm(2)
    y, _ = generate(make_lm(0), PROMPT, N_RESP, seed=3)
    torch.testing.assert_close(one_pass_values(critic, PROMPT, y), prefix_values(critic, PROMPT, y))


def test_critic_value_ignores_future_tokens_only_with_causal_mask() -> None:
    """Q7: V_t must not depend on y_t, …, y_N. Changing them leaves V_t alone under the causal mask;
    without the mask the same change moves V_t (the property is the mask's doing)."""
    critic = make_lm(2)
    y, _ = generate(make_lm(0), PROMPT, N_RESP, seed=3)
    t = 2
    y_alt = y.clone()
    y_alt[:, t:] = (y[:, t:] + 1) % VOCAB  # a different future from position t on
    v, v_alt = one_pass_values(critic, PROMPT, y), one_pass_values(critic, PROMPT, y_alt)
    torch.testing.assert_close(v[:, : t + 1], v_alt[:, : t + 1], rtol=0, atol=0)  # V_0..V_t: unchanged
    assert (v[:, t + 1 :] - v_alt[:, t + 1 :]).abs().min() > 1e-9  # V_{t+1}.. see y_t: they move
    v_nc = one_pass_values(critic, PROMPT, y, causal=False)
    v_nc_alt = one_pass_values(critic, PROMPT, y_alt, causal=False)
    assert (v_nc[:, :t] - v_nc_alt[:, :t]).abs().min() > 1e-9  # no mask: the past sees the future


def test_new_actor_scores_stored_response_it_does_not_regenerate() -> None:
    """Q5 (wrong in the note): the update re-scores the *stored* y by teacher forcing.

    Regenerating would give other tokens (so no per-token ratio against the cached π_old(y_t)
    could be formed, and the advantages computed for y would not belong to them). Scoring the
    stored y with the not-yet-updated actor gives ratio exactly 1 at the first minibatch.
    """
    actor = make_lm(0)
    y, logp_old = generate(actor, PROMPT, N_RESP, seed=11)
    y_regen, _ = generate(actor, PROMPT, N_RESP, seed=12)
    assert not torch.equal(y_regen, y)
    logp_new = one_pass_logprobs(actor, PROMPT, y)
    mask = torch.ones_like(y, dtype=torch.bool)
    ratio = policy_ratio(logp_new, logp_old, mask)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-12)
