"""``truncated_rows`` in the update walk (issue #23 item 5; :mod:`refppo.pipeline.row_subset`): the
pipeline's losses and gradients under ``mask_in_loss``/``drop`` against the core called directly
(the per-token terms aggregated by :func:`refppo.core.masked.kept_rows_aggregate`), the naive walk,
the statistics over the rows in the loss, and the refusals (one line naming ``truncated``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refppo.agg_conventions import MASK_AGGS
from refppo.core.kl import token_kl
from refppo.core.masked import kept_rows_aggregate, masked_mean
from refppo.core.policy import clipped_policy_token_loss
from refppo.errors import ConventionError
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import update_grads, update_inputs, update_quantities, update_quantities_naive

HP = Hyperparams(kl_coef=0.1, ent_coef=0.01, cliprange=0.2, horizon=9.0)
AGGS = [a.value for a in MASK_AGGS]  # prompt-mean with truncated_rows: refused (test below)


@st.composite
def batches(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    B, T = draw(st.integers(2, 6)), draw(st.integers(1, 7))
    lengths = [draw(st.integers(1, T)) for _ in range(B)]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = torch.arange(T).expand(B, T) < torch.tensor(lengths).unsqueeze(1)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    flags = draw(st.lists(st.booleans(), min_size=B, max_size=B).filter(lambda f: not all(f)))

    def noise(s: float) -> torch.Tensor:
        return s * torch.randn(B, T, generator=g, dtype=torch.float64)

    return {
        "logprobs": old + noise(0.3), "old_logprobs": old, "ref_logprobs": old + noise(0.4),
        "advantages": noise(1.0), "returns": noise(1.0), "entropy": noise(1.0).abs(), "mask": mask,
        "truncated": torch.tensor(flags),
    }  # fmt: skip


def _conv(agg: str, rows: str) -> Convention:
    return Convention().with_updates(
        {"advantage": "grpo", "kl_in": "loss", "kl_estimator": "k3", "loss_agg": agg, "truncated_rows": rows}
    )


def _q(x: dict[str, torch.Tensor]) -> dict[str, object]:
    return update_inputs(
        logprobs=x["logprobs"], values=None, old_logprobs=x["old_logprobs"], old_values=None,
        advantages=x["advantages"], returns=x["returns"], mask=x["mask"], ref_logprobs=x["ref_logprobs"],
        entropy=x["entropy"], truncated=x["truncated"],
    )  # fmt: skip


def _uq(x: dict[str, torch.Tensor], conv: Convention) -> object:
    return update_quantities(
        logprobs=x["logprobs"], values=None, old_logprobs=x["old_logprobs"], old_values=None,
        advantages=x["advantages"], returns=x["returns"], mask=x["mask"], ref_logprobs=x["ref_logprobs"],
        entropy=x["entropy"], truncated=x["truncated"], hp=HP, conv=conv,
    )  # fmt: skip


def _core_loss(
    x: dict[str, torch.Tensor], lp: torch.Tensor, agg: str, count_rows: bool
) -> dict[str, torch.Tensor]:
    m, keep = x["mask"], ~x["truncated"]
    kw = {"count_rows": count_rows, "horizon": HP.horizon}
    pg = clipped_policy_token_loss(lp, x["old_logprobs"], x["advantages"], m, clip_low=HP.cliprange).per_token
    per_kl = token_kl(lp, x["ref_logprobs"], m, "k3")
    out = {
        "pg_loss": kept_rows_aggregate(pg, m, keep, agg, **kw),
        "kl_loss": kept_rows_aggregate(per_kl, m, keep, agg, **kw),
        "entropy_loss": kept_rows_aggregate(x["entropy"], m, keep, agg, **kw),
    }
    out["loss"] = out["pg_loss"] - HP.ent_coef * out["entropy_loss"] + HP.kl_coef * out["kl_loss"]
    return out


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(AGGS), st.sampled_from(["mask_in_loss", "drop"]))
def test_update_walk_is_the_core_aggregation_over_the_rows_in_the_loss(
    x: dict[str, torch.Tensor], agg: str, rows: str
) -> None:
    conv = _conv(agg, rows)
    uq = _uq(x, conv)
    want = _core_loss(x, x["logprobs"], agg, rows == "mask_in_loss")
    for k, v in want.items():
        torch.testing.assert_close(getattr(uq, k), v, rtol=1e-12, atol=1e-14, msg=k)
    naive = update_quantities_naive(_q(x), hp=HP, conv=conv)
    torch.testing.assert_close(naive.loss.to(torch.float64), uq.loss, rtol=1e-10, atol=1e-12)
    # the statistics are over the tokens in the loss (TRL: masked means over the zeroed mask)
    keep = ~x["truncated"]
    approx = masked_mean((x["old_logprobs"] - x["logprobs"])[keep], x["mask"][keep])
    torch.testing.assert_close(uq.approx_kl, approx, rtol=1e-12, atol=1e-14)
    assert bool((uq.ratio[x["truncated"]] == 1).all())


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(AGGS))
def test_gradient_is_the_core_aggregations_gradient(x: dict[str, torch.Tensor], agg: str) -> None:
    g = update_grads(
        _q(x) | {"values": torch.zeros_like(x["logprobs"])}, hp=HP, conv=_conv(agg, "mask_in_loss")
    )
    lp = x["logprobs"].clone().requires_grad_(True)
    (want,) = torch.autograd.grad(_core_loss(x, lp, agg, True)["loss"], lp)
    torch.testing.assert_close(g["grad_logprobs"], torch.where(x["mask"], want, 0.0), rtol=1e-12, atol=1e-14)
    assert not bool(g["grad_logprobs"][x["truncated"]].any())


def _fixed() -> dict[str, torch.Tensor]:
    """A fixed batch: B = 3, T = 4, lengths 4, 2, 3 (seeded draws)."""
    g = torch.Generator().manual_seed(23)
    mask = torch.arange(4).expand(3, 4) < torch.tensor([4, 2, 3]).unsqueeze(1)
    old = -torch.rand(3, 4, generator=g, dtype=torch.float64) * 3

    def noise(s: float) -> torch.Tensor:
        return s * torch.randn(3, 4, generator=g, dtype=torch.float64)

    return {
        "logprobs": old + noise(0.3), "old_logprobs": old, "ref_logprobs": old + noise(0.4),
        "advantages": noise(1.0), "returns": noise(1.0), "entropy": noise(1.0).abs(), "mask": mask,
        "truncated": torch.tensor([True, False, False]),
    }  # fmt: skip


def test_keep_ignores_the_flags_and_mask_in_loss_is_not_keep() -> None:
    x = _fixed()
    x["truncated"] = torch.tensor([True] + [False] * (x["mask"].shape[0] - 1))
    plain = dict(x, truncated=torch.zeros_like(x["truncated"]))
    conv = _conv("seq-mean-token-mean", "keep")
    assert float(_uq(x, conv).loss) == float(_uq(plain, conv).loss)
    assert float(_uq(x, _conv("seq-mean-token-mean", "mask_in_loss")).loss) != float(_uq(plain, conv).loss)


def test_refusals_name_truncated() -> None:
    x = _fixed()
    with pytest.raises(ConventionError, match=r"^truncated: truncated_rows=mask_in_loss reads the \[B\]"):
        _uq(dict(x, truncated=None), _conv("token-mean", "mask_in_loss"))  # type: ignore[arg-type]
    with pytest.raises(ConventionError, match=r"^truncated: every row is flagged"):
        _uq(dict(x, truncated=torch.ones_like(x["truncated"])), _conv("token-mean", "drop"))


def test_prompt_mean_with_rows_out_of_the_loss_is_refused_in_one_line() -> None:
    """No trainer masks rows out of a prompt-mean loss; the prompts' token counts over the rows in the
    loss are not defined, so the combination is refused naming both keys."""
    from refppo.errors import ConventionError
    from refppo.pipeline.row_subset import rows_in_loss
    from refppo.pipeline.settings import Convention

    m = torch.ones(3, 4, dtype=torch.bool)
    q = {"mask": m, "truncated": torch.tensor([True, False, False])}
    conv = Convention.of(truncated_rows="mask_in_loss", loss_agg="prompt-mean")
    with pytest.raises(ConventionError, match="truncated_rows=mask_in_loss with loss_agg=prompt-mean"):
        rows_in_loss(q, conv)
    assert rows_in_loss(q, Convention.of(truncated_rows="mask_in_loss")) is not None
