"""``kl_metric_agg`` (issue #23 item 5): the logged KL metric (the dumped ``kl_loss``) aggregated unlike
the KL term of the loss (TRL GRPOTrainer 1.16.0: ``β·k3`` per token inside its per-sequence mean, the
logged ``kl`` a token mean; peer check: ``tests/peers/test_peer_trl_grpo_kl_metric.py``).

The ``kl_metric`` stage against its naive twin under properties, against the core's ``kl_loss``
called directly, a hand-worked example, and the loss left alone (the metric is logged, not optimised).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refppo.agg_conventions import MASK_AGGS
from refppo.core.objective import kl_loss
from refppo.pipeline.blocks import Evaluation
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.stages import BY_NAME

AGGS = [a.value for a in MASK_AGGS]
HP = Hyperparams(kl_coef=0.1, horizon=12.0)


def _conv(est: str, loss_agg: str, kl_agg: str | None, metric: str | None) -> Convention:
    return Convention().with_updates(
        {
            "kl_in": "loss",
            "kl_estimator": est,
            "loss_agg": loss_agg,
            "kl_loss_agg": kl_agg,
            "kl_metric_agg": metric,
        }
    )


def _stages(q: dict[str, torch.Tensor], conv: Convention, *, naive: bool = False, rows: int | None = None):
    ev = Evaluation(rows=rows)
    term = BY_NAME["kl_loss"].run(q, conv, HP, ev, naive=naive)["kl_loss"]
    metric = BY_NAME["kl_metric"].run({**q, "kl_loss": term}, conv, HP, ev, naive=naive)["kl_metric"]
    return term, metric


@st.composite
def batches(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    B, T = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    lengths = [draw(st.integers(1, T)) for _ in range(B)]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = torch.arange(T).expand(B, T) < torch.tensor(lengths).unsqueeze(1)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    ref = lp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    return {"logprobs": lp, "ref_logprobs": ref, "mask": mask}


@settings(max_examples=60, deadline=None)
@given(
    batches(),
    st.sampled_from(["k1", "k2", "k3", "abs"]),
    st.sampled_from(AGGS),
    st.sampled_from([None, *AGGS]),
    st.sampled_from([None, *AGGS]),
)
def test_kl_metric_matches_the_twin_and_the_core(
    q: dict[str, torch.Tensor], est: str, loss_agg: str, kl_agg: str | None, metric: str | None
) -> None:
    """Vectorized (whole batch and by row blocks) = naive twin; = the core's ``kl_loss`` under the
    metric's aggregation (else the term's); None: the term itself."""
    conv = _conv(est, loss_agg, kl_agg, metric)
    term, got = _stages(q, conv)
    _, twin = _stages(q, conv, naive=True)
    _, blocks = _stages(q, conv, rows=1)
    mode = metric or kl_agg or loss_agg
    direct = kl_loss(q["logprobs"], q["ref_logprobs"], q["mask"], est, mode, horizon=HP.horizon)
    assert abs(float(got) - float(twin)) <= 1e-10 * max(1.0, abs(float(twin)))
    assert abs(float(blocks) - float(got)) <= 1e-12 * max(1.0, abs(float(got)))
    assert abs(float(got) - float(direct)) <= 1e-12 * max(1.0, abs(float(direct)))
    if metric is None:
        assert got is term


def test_hand_worked_token_mean_metric_of_a_sequence_mean_term() -> None:
    """k1 per token 2 (row 0, one token) and 1, 1, 1 (row 1): the term under ``seq-mean-token-mean``
    is (2 + 1)/2 = 1.5, the logged token mean (2 + 3)/4 = 1.25."""
    mask = torch.tensor([[True, False, False], [True, True, True]])
    lp = torch.tensor([[2.0, 9.0, 9.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    q = {"logprobs": lp, "ref_logprobs": torch.zeros_like(lp), "mask": mask}
    term, metric = _stages(q, _conv("k1", "seq-mean-token-mean", None, "token-mean"))
    assert (float(term), float(metric)) == (1.5, 1.25)
    _, same = _stages(q, _conv("k1", "seq-mean-token-mean", None, None))
    assert float(same) == 1.5


def test_the_metric_leaves_the_loss_alone() -> None:
    """``total`` reads the term: the same ``loss`` with and without ``kl_metric_agg``."""
    mask = torch.tensor([[True, False], [True, True]])
    lp = torch.tensor([[-1.0, 0.0], [-0.5, -2.0]], dtype=torch.float64)
    q = {"logprobs": lp, "ref_logprobs": lp + 0.3, "mask": mask}
    zero = torch.zeros((), dtype=torch.float64)
    losses = []
    for metric in (None, "token-mean"):
        conv = _conv("k3", "seq-mean-token-mean", None, metric)
        term, _ = _stages(q, conv)
        tq = {"pg_loss": zero, "vf_loss": zero, "entropy_loss": zero, "kl_loss": term}
        losses.append(float(BY_NAME["total"].run(tq, conv, HP)["loss"]))
    assert (
        losses[0]
        == losses[1]
        == HP.kl_coef * float(_stages(q, _conv("k3", "seq-mean-token-mean", None, None))[0])
    )
