"""``Convention.advantage``: the critic-free estimators through ``refppo.pipeline`` (issue #13 item 2).

The pipeline's steps 3–4 are compared with the NAIVE twins of :mod:`refppo.core.group` (Python
floats, one response at a time), fed with the scores/penalties each ``group_kl`` form defines —
never with the vectorized functions the pipeline itself calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from refppo.core.group_naive import group_advantages_naive, reinforce_pp_advantages_naive
from refppo.core.policy import clipped_policy_loss
from refppo.errors import ConventionError
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import (
    RolloutQuantities,
    rollout_quantities,
    rollout_quantities_naive,
    update_quantities,
)

B, T, BETA = 9, 6, 0.07
F64 = torch.float64


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 1, 3, 5, 2, 6, 4, 3, 1])
    mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(1)
    junk = torch.full((B, T), 7.5, dtype=F64)
    old = -torch.rand(B, T, generator=g, dtype=F64) - 0.1
    return {
        "mask": mask,
        "old_logprobs": torch.where(mask, old, junk),
        "ref_logprobs": torch.where(mask, old + 0.3 * torch.randn(B, T, generator=g, dtype=F64), junk),
        "logprobs": torch.where(mask, old + 0.2 * torch.randn(B, T, generator=g, dtype=F64), junk),
        "scores": torch.randn(B, generator=g, dtype=F64),
        "group_index": torch.tensor([5, 2, 5, 9, 2, 5, 9, 2, 9]),  # three interleaved groups of 3
    }


_GIVEN = object()


def _run(
    x: dict[str, torch.Tensor], conv: Convention, hp: Hyperparams, group_index: object = _GIVEN
) -> RolloutQuantities:
    gi = x["group_index"] if group_index is _GIVEN else group_index
    assert gi is None or isinstance(gi, torch.Tensor)
    return rollout_quantities(
        scores=x["scores"],
        old_logprobs=x["old_logprobs"],
        ref_logprobs=x["ref_logprobs"],
        old_values=None,
        mask=x["mask"],
        hp=hp,
        conv=conv,
        group_index=gi,
    )


def _kl_loops(x: dict[str, torch.Tensor]) -> list[list[float]]:
    """k1 = log π_old − log π_ref per valid token, 0 elsewhere (plain floats)."""
    m, o, r = x["mask"].tolist(), x["old_logprobs"].tolist(), x["ref_logprobs"].tolist()
    return [[o[i][t] - r[i][t] if m[i][t] else 0.0 for t in range(T)] for i in range(B)]


def _folded_scores(x: dict[str, torch.Tensor], beta: float) -> torch.Tensor:
    """verl: the score of a row is the sum of its token rewards, ``s − β·Σ_t KL_t``."""
    kl = _kl_loops(x)
    return torch.tensor([float(x["scores"][i]) - beta * sum(kl[i]) for i in range(B)], dtype=F64)


@pytest.mark.parametrize("est", ["grpo", "dr-grpo", "rloo"])
@pytest.mark.parametrize("std", ["unbiased", "population"])
def test_group_estimator_fold_equals_naive_on_folded_scores(est: str, std: str) -> None:
    x = _inputs()
    conv = Convention.of(advantage=est, group_std=std, whiten_advantages="none", group_eps=1e-6)
    rq = _run(x, conv, Hyperparams(kl_coef=BETA))
    want = group_advantages_naive(
        _folded_scores(x, BETA), x["group_index"], x["mask"], estimator=est,
        unbiased_std=std == "unbiased", eps=1e-6,
    )  # fmt: skip
    torch.testing.assert_close(rq.advantages, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rq.returns, rq.advantages_raw, rtol=0, atol=0)
    torch.testing.assert_close(rq.advantages, rq.advantages_raw, rtol=0, atol=0)  # step 4 off


@pytest.mark.parametrize("est", ["grpo", "dr-grpo", "rloo"])
def test_group_estimator_to_go_equals_naive_with_penalty(est: str) -> None:
    x = _inputs(1)
    conv = Convention.of(advantage=est, group_kl="to_go", whiten_advantages="none", group_eps=1e-9)
    rq = _run(x, conv, Hyperparams(kl_coef=BETA))
    pen = torch.tensor([[-BETA * v for v in row] for row in _kl_loops(x)], dtype=F64)
    want = group_advantages_naive(
        x["scores"], x["group_index"], x["mask"], estimator=est, eps=1e-9, token_penalty=pen
    )
    torch.testing.assert_close(rq.advantages, want, rtol=1e-12, atol=1e-12)


def test_kl_in_loss_leaves_the_scores_alone_in_both_forms() -> None:
    x = _inputs(2)
    want = group_advantages_naive(x["scores"], x["group_index"], x["mask"], estimator="grpo")
    for form in ("fold", "to_go"):
        conv = Convention.of(advantage="grpo", kl_in="loss", group_kl=form, whiten_advantages="none")
        rq = _run(x, conv, Hyperparams(kl_coef=BETA))
        torch.testing.assert_close(rq.advantages, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("var", "eps_at", "form"), [("unbiased", "variance", "add"), ("population", "clamp", "clamp")]
)
def test_reinforce_pp_is_discounted_returns_whitened_by_step_4(var: str, eps_at: str, form: str) -> None:
    x = _inputs(3)
    conv = Convention.of(advantage="reinforce++", whiten_variance=var, whiten_eps_at=eps_at)
    hp = Hyperparams(kl_coef=BETA, gamma=0.9)
    rq = _run(x, conv, hp)
    m = x["mask"]
    want = reinforce_pp_advantages_naive(
        torch.where(m, rq.token_rewards, torch.zeros((), dtype=F64)), m, gamma=0.9,
        whiten_unbiased=var == "unbiased", whiten_eps=hp.whiten_eps, whiten_eps_form=form,
    )  # fmt: skip
    torch.testing.assert_close(rq.advantages, want, rtol=1e-10, atol=1e-12)
    # the returns are the discounted returns before the whitening: R_t = Σ_{k≥t} γ^{k−t} r_k (loops)
    r, ms = rq.token_rewards.tolist(), m.tolist()

    def to_go(i: int, t: int) -> float:
        return sum(0.9 ** (k - t) * r[i][k] for k in range(t, T) if ms[i][k]) if ms[i][t] else 0.0

    ret = [[to_go(i, t) for t in range(T)] for i in range(B)]
    torch.testing.assert_close(
        torch.where(m, rq.returns, 0.0), torch.tensor(ret, dtype=F64), rtol=1e-12, atol=1e-12
    )


def test_reinforce_pp_baseline_equals_naive() -> None:
    x = _inputs(4)
    conv = Convention.of(advantage="reinforce++-baseline", kl_in="loss", whiten_variance="population",
                      whiten_eps_at="clamp")  # fmt: skip
    rq = _run(x, conv, Hyperparams())
    want = group_advantages_naive(
        x["scores"], x["group_index"], x["mask"], estimator="reinforce++-baseline",
        whiten_unbiased=False, whiten_eps=1e-8, whiten_eps_form="clamp",
    )  # fmt: skip
    torch.testing.assert_close(rq.advantages, want, rtol=1e-10, atol=1e-12)


def test_group_shift_invariance_through_the_pipeline() -> None:
    """Adding c to every score of one group leaves GRPO's advantages unchanged (spec/ppo.md claim)."""
    x = _inputs(5)
    conv = Convention.of(advantage="grpo", whiten_advantages="none")
    a = _run(x, conv, Hyperparams(kl_coef=BETA)).advantages
    shifted = dict(x, scores=x["scores"] + 3.25 * (x["group_index"] == 9).to(F64))
    b = _run(shifted, conv, Hyperparams(kl_coef=BETA)).advantages
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    dr = _run(shifted, Convention.of(advantage="rloo", whiten_advantages="none"), Hyperparams()).advantages
    assert not torch.equal(dr, torch.zeros_like(dr))


def test_errors_are_one_clear_line() -> None:
    x = _inputs()
    with pytest.raises(ConventionError, match=r"advantage=grpo needs group_index \[B\]"):
        _run(x, Convention.of(advantage="grpo"), Hyperparams(), group_index=None)
    with pytest.raises(ConventionError, match="advantage=gae needs old_values"):
        _run(x, Convention(), Hyperparams())
    with pytest.raises(ConventionError, match="group_kl=to_go with whiten_rewards"):
        Convention.of(advantage="grpo", group_kl="to_go", whiten_rewards="masked")
    with pytest.raises(ConventionError, match="group_singleton: unknown name 'drop'"):
        Convention.of(group_singleton="drop")
    single = dict(x, group_index=torch.arange(B))
    with pytest.raises(Exception, match="have one response"):
        _run(single, Convention.of(advantage="rloo"), Hyperparams())


def test_data_parallel_group_estimator_is_refused() -> None:
    x = _inputs()
    with pytest.raises(ConventionError, match="per process"):
        rollout_quantities(
            scores=x["scores"], old_logprobs=x["old_logprobs"], ref_logprobs=x["ref_logprobs"],
            old_values=None, mask=x["mask"], hp=Hyperparams(), conv=Convention.of(advantage="grpo"),
            all_reduce=lambda t: t, group_index=x["group_index"],
        )  # fmt: skip


def test_update_without_a_critic_has_no_value_term() -> None:
    x = _inputs(6)
    conv = Convention.of(advantage="grpo", whiten_advantages="none")
    hp = Hyperparams(vf_coef=0.5)
    adv = _run(x, conv, hp).advantages
    uq = update_quantities(
        logprobs=x["logprobs"], values=None, old_logprobs=x["old_logprobs"], old_values=None,
        advantages=adv, returns=adv, mask=x["mask"], hp=hp, conv=conv,
    )  # fmt: skip
    pg = clipped_policy_loss(x["logprobs"], x["old_logprobs"], adv, x["mask"], clip_low=0.2)
    assert float(uq.vf_loss) == 0.0 and float(uq.vf_clipfrac) == 0.0
    torch.testing.assert_close(uq.loss, pg.loss, rtol=0, atol=0)
    with pytest.raises(ConventionError, match="advantage=gae needs values and old_values"):
        update_quantities(
            logprobs=x["logprobs"], values=None, old_logprobs=x["old_logprobs"], old_values=None,
            advantages=adv, returns=adv, mask=x["mask"], hp=hp, conv=Convention(),
        )  # fmt: skip


def test_new_keys_stay_out_of_the_default_dict() -> None:
    """The golden cases store ``Convention.to_dict()``: the new keys appear only when changed."""
    d = Convention().to_dict()
    assert not {"advantage", "group_std", "group_singleton", "group_kl", "group_eps"} & set(d)
    d2 = Convention.of(advantage="rloo", group_eps=1e-9).to_dict()
    assert d2["advantage"] == "rloo" and d2["group_eps"] == 1e-9
    assert Convention.from_dict(d2) == Convention.of(advantage="rloo", group_eps=1e-9)


class _TwoRanks:
    """A SUM all-reduce between two threads (each plays one rank): each call waits for the other
    rank's tensor of the same call and returns the sum (the collective's contract)."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2)
        self.slots: list[torch.Tensor | None] = [None, None]

    def of(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            a, b = self.slots
            assert a is not None and b is not None
            out = a + b
            self.barrier.wait()  # both have read before the next call overwrites
            return out

        return all_reduce


@pytest.mark.parametrize(
    "conv",
    [
        {"advantage": "flash-reinforce"},
        {"advantage": "grpo", "group_std_level": "batch"},
        {"advantage": "gpg"},
    ],
    ids=lambda c: "-".join(c.values()),
)
def test_batch_statistics_of_the_critic_free_estimators_go_through_the_all_reduce(
    conv: dict[str, str],
) -> None:
    """Two ranks (threads joined by a SUM all-reduce), each with whole groups, give each rank its rows
    of one process on the whole batch by the naive twin: the batch sums, counts and std are
    all-reduced and ``group_std_level`` reaches the core."""
    x = _inputs(3)
    x["scores"][0] = 0.0  # gpg's α = B/#{s ≠ 0} then differs between the batch and one rank's rows
    c = Convention.of(whiten_advantages="none", kl_in="loss", **conv)  # the group score is the score
    hp = Hyperparams(kl_coef=BETA)
    gi = x["group_index"]
    want = rollout_quantities_naive(
        scores=x["scores"], old_logprobs=x["old_logprobs"], ref_logprobs=x["ref_logprobs"],
        old_values=None, mask=x["mask"], hp=hp, conv=c, group_index=gi,
    ).advantages  # fmt: skip
    ranks = [torch.nonzero(gi != 9).flatten(), torch.nonzero(gi == 9).flatten()]  # whole groups per rank
    comm, got = _TwoRanks(), {}

    def run(r: int) -> None:
        try:
            _rank(r)
        except BaseException:
            comm.barrier.abort()  # the other rank stops waiting (BrokenBarrierError) instead of hanging
            raise

    def _rank(r: int) -> None:
        rows = ranks[r]
        y = {k: v[rows] for k, v in x.items()}
        got[r] = rollout_quantities(
            scores=y["scores"], old_logprobs=y["old_logprobs"], ref_logprobs=y["ref_logprobs"],
            old_values=None, mask=y["mask"], hp=hp, conv=c, all_reduce=comm.of(r),
            group_index=y["group_index"], groups_on_rank=True,
        ).advantages  # fmt: skip

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert set(got) == {0, 1}
    m = x["mask"]
    for r, rows in enumerate(ranks):
        err = torch.where(m[rows], got[r] - want[rows], 0.0).abs().max()
        assert float(err) <= 1e-12, (r, float(err))
    alone = _run({k: v[ranks[1]] for k, v in x.items()}, c, hp).advantages  # rank 1 without the collective
    assert float(torch.where(m[ranks[1]], alone - want[ranks[1]], 0.0).abs().max()) > 1e-6
