"""GSPO's sequence-ratio surrogate by hand: the clip truth table (value and gradient per region),
the difference from the token ratio, and the convention's checks (refppo/core/gspo.py)."""

from __future__ import annotations

import math

import pytest
import torch

from refppo.conventions import PolicyLoss
from refppo.core.gspo import gspo_policy_grad_naive, gspo_policy_loss, gspo_policy_loss_naive
from refppo.core.policy import clipped_policy_loss
from refppo.errors import ConventionError, HyperparameterError, RefPPOError
from refppo.pipeline.settings import Convention

F64 = torch.float64
EPS_LO, EPS_HI = 0.2, 0.28  # asymmetric (clip-higher): the range is [0.8, 1.28]

# (region, A, s_b, per-token loss ℓ, ∂ℓ/∂l_t) with token-sum (w = 1); ℓ = max(−A·s, −A·clip(s)).
TRUTH_TABLE = [
    ("A>0, s<1-eps", 1.0, 0.5, -0.5, -0.5),  # −0.5 > −0.8: unclipped, ∂ = −A·s
    ("A>0, inside", 1.0, 1.1, -1.1, -1.1),
    ("A>0, s>1+eps_high", 1.0, 1.5, -1.28, 0.0),  # −1.28 > −1.5: clipped, no gradient
    ("A<0, s<1-eps", -1.0, 0.5, 0.8, 0.0),  # 0.8 > 0.5: clipped
    ("A<0, inside", -1.0, 1.1, 1.1, 1.1),
    ("A<0, s>1+eps_high", -1.0, 1.5, 1.5, 1.5),  # 1.5 > 1.28: unclipped (no dual-clip in GSPO)
    ("A=0", 0.0, 1.5, 0.0, 0.0),
]


def _row(s: float, n: int = 3) -> torch.Tensor:
    """Log-ratios of one row whose mean is ln s: ``[ln s + 0.05, ln s − 0.05, ln s]`` (n = 3)."""
    base = math.log(s)
    return torch.tensor([[base + 0.05, base - 0.05, base][:n]], dtype=F64)


@pytest.mark.parametrize(("region", "adv", "s", "loss", "grad"), TRUTH_TABLE, ids=[r[0] for r in TRUTH_TABLE])
def test_gspo_clip_truth_table(region: str, adv: float, s: float, loss: float, grad: float) -> None:
    d = _row(s)
    old = torch.full_like(d, -1.0)
    lp = old + d
    a, m = torch.full_like(d, adv), torch.ones_like(d, dtype=torch.bool)
    kw = {"clip_low": EPS_LO, "clip_high": EPS_HI, "agg": "token-sum"}
    x = lp.clone().requires_grad_(True)
    out = gspo_policy_loss(x, old, a, m, **kw)  # type: ignore[arg-type]  # kwargs dict
    out.loss.backward()
    # every token sees the sequence ratio s (not its own e^{d_t}): the same ℓ and ∂ on all three
    torch.testing.assert_close(out.ratio, torch.full_like(d, s), rtol=1e-14, atol=0.0)
    torch.testing.assert_close(out.per_token, torch.full_like(d, loss), rtol=1e-14, atol=1e-15)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.full_like(d, grad), rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(gspo_policy_grad_naive(lp, old, a, m, **kw), x.grad, rtol=1e-14, atol=1e-15)  # type: ignore[arg-type]  # kwargs
    naive = gspo_policy_loss_naive(lp, old, a, m, **kw)  # type: ignore[arg-type]  # kwargs
    assert naive.loss == pytest.approx(3 * loss, abs=1e-14)
    clipped = loss != -adv * s
    assert float(out.clipfrac) == naive.clipfrac == (1.0 if clipped else 0.0)


def test_gspo_log_ratio_max_blocks_the_gradient_beyond_kappa_and_passes_on_it() -> None:
    # κ = 0.25, A = −1: S = 0.3 > κ -> s = e^{0.25} ≈ 1.284 > 1.28 (unclipped for A < 0), but the clamp
    # of log s blocks: ∂ = 0. S = 0.25 exactly (all d = 0.25) sits on the bound: ∂ = −A·e^{0.25}.
    old = torch.zeros(2, 2, dtype=F64)
    lp = torch.tensor([[0.35, 0.25], [0.25, 0.25]], dtype=F64)  # row means 0.3 and 0.25
    a, m = torch.full_like(lp, -1.0), torch.ones_like(lp, dtype=torch.bool)
    x = lp.clone().requires_grad_(True)
    out = gspo_policy_loss(x, old, a, m, clip_high=EPS_HI, agg="token-sum", log_ratio_max=0.25)
    out.loss.backward()
    e = math.exp(0.25)
    torch.testing.assert_close(out.ratio, torch.full_like(lp, e), rtol=1e-15, atol=0.0)
    want = torch.tensor([[0.0, 0.0], [e, e]], dtype=F64)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, want, rtol=1e-15, atol=0.0)
    twin = gspo_policy_grad_naive(lp, old, a, m, clip_high=EPS_HI, agg="token-sum", log_ratio_max=0.25)
    torch.testing.assert_close(twin, want, rtol=1e-15, atol=0.0)


def test_gspo_tie_at_the_clip_boundary_gives_the_whole_gradient() -> None:
    # all d = 0: s = 1 exactly; with ε_high = 0 the bound is 1: L1 = L2 (tie, ½ each), the clamp passes
    # its bound, so ∂ = −A·s·w whole: A = 2, token-mean over 2 tokens -> −1 each.
    lp = torch.tensor([[-0.5, -1.25]], dtype=F64)
    a, m = torch.full_like(lp, 2.0), torch.ones_like(lp, dtype=torch.bool)
    x = lp.clone().requires_grad_(True)
    gspo_policy_loss(x, lp, a, m, clip_high=0.0).loss.backward()
    assert x.grad is not None and x.grad.tolist() == [[-1.0, -1.0]]
    assert gspo_policy_grad_naive(lp, lp, a, m, clip_high=0.0).tolist() == [[-1.0, -1.0]]


def test_gspo_clips_per_sequence_where_the_token_ratio_clips_per_token() -> None:
    # One row, A = +1, d = [0.4, −0.4], token-sum, ε = 0.2.
    # token ratio: ρ = [e^{0.4} ≈ 1.49 (clipped, ∂ 0), e^{−0.4} ≈ 0.67 (unclipped, ∂ = −0.67)];
    # GSPO: S = 0, s = 1 inside the range for both tokens: ∂ = [−1, −1].
    old = torch.zeros(1, 2, dtype=F64)
    lp = torch.tensor([[0.4, -0.4]], dtype=F64)
    a, m = torch.ones_like(lp), torch.ones_like(lp, dtype=torch.bool)
    x, y = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    clipped_policy_loss(x, old, a, m, agg="token-sum").loss.backward()
    gspo_policy_loss(y, old, a, m, agg="token-sum").loss.backward()
    assert x.grad is not None and y.grad is not None
    torch.testing.assert_close(
        x.grad, torch.tensor([[0.0, -math.exp(-0.4)]], dtype=F64), rtol=1e-15, atol=0.0
    )
    torch.testing.assert_close(y.grad, torch.tensor([[-1.0, -1.0]], dtype=F64), rtol=1e-15, atol=0.0)


def test_policy_loss_convention_names_and_checks() -> None:
    assert Convention.of(policy_loss="gspo").policy.loss is PolicyLoss.GSPO  # type: ignore[arg-type]  # str parsed
    assert "policy_loss" not in Convention().to_dict()  # at its default: golden dicts unchanged
    assert Convention.of(policy_loss="gspo").to_dict()["policy_loss"] == "gspo"  # type: ignore[arg-type]
    with pytest.raises(ConventionError, match=r"policy_loss: unknown name 'gpg'.*'vanilla', 'gspo'"):
        Convention.of(policy_loss="gpg")  # type: ignore[arg-type]  # str parsed
    with pytest.raises(ConventionError, match="dual_clip: policy_loss=gspo has no dual-clip"):
        Convention.of(policy_loss="gspo", dual_clip=3.0)  # type: ignore[arg-type]  # str parsed


# ---- from the survivors of tools/mutate.py --module gspo ------------------------------------------


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows (3 and 2 valid tokens) with hand-chosen log-ratios d."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 9.0]], dtype=F64)
    d = torch.tensor([[0.3, -0.1, 0.4], [-0.2, 0.5, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]], dtype=F64)
    return old + d, old, adv, mask


def test_gspo_approx_kl_metrics_by_hand() -> None:
    # valid d: 0.3, −0.1, 0.4, −0.2, 0.5 (N = 5): k1 = −Σd/N = −0.18; k2 = ½·Σd²/N = ½·0.55/5 = 0.055
    logp, old, adv, mask = _batch()
    out = gspo_policy_loss(logp, old, adv, mask)
    assert float(out.approx_kl) == pytest.approx(-0.18, abs=1e-12)
    assert float(out.approx_kl_k2) == pytest.approx(0.055, abs=1e-12)


def test_gspo_default_clip_is_0_2() -> None:
    # row 1: S = (0.3 − 0.1 + 0.4)/3 = 0.2, s = e^0.2 = 1.2214 > 1.2 → clipped at the default ε = 0.2
    # only (a wider ε leaves it unclipped): the default shows in the value
    logp, old, adv, mask = _batch()
    default = gspo_policy_loss(logp, old, adv, mask, agg="token-sum")
    assert torch.equal(
        default.loss, gspo_policy_loss(logp, old, adv, mask, clip_low=0.2, agg="token-sum").loss
    )
    assert not torch.equal(
        default.loss, gspo_policy_loss(logp, old, adv, mask, clip_low=0.3, agg="token-sum").loss
    )


@pytest.mark.parametrize("clip_low", [1.0 + 2**-20, 1.5])
def test_gspo_clip_low_above_one_is_refused(clip_low: float) -> None:
    """``clip_low`` = 1 is no lower bound (1 − 1 = 0 below every ratio); above 1 it is refused."""
    logp, old, adv, mask = _batch()
    with pytest.raises(HyperparameterError, match=r"clip_low: expected a number in \[0, 1\]"):
        gspo_policy_loss(logp, old, adv, mask, clip_low=clip_low)


@pytest.mark.parametrize("which", ["logp", "logp_old", "advantages"])
def test_gspo_mixed_dtypes_are_refused(which: str) -> None:
    logp, old, adv, mask = _batch()
    args = {"logp": logp, "logp_old": old, "advantages": adv}
    args[which] = args[which].float()
    with pytest.raises(RefPPOError, match="dtype"):
        gspo_policy_loss(args["logp"], args["logp_old"], args["advantages"], mask)


def test_gspo_sends_no_gradient_into_the_advantages() -> None:
    logp, old, adv, mask = _batch()
    adv = adv.clone().requires_grad_(True)
    lp = logp.clone().requires_grad_(True)
    gspo_policy_loss(lp, old, adv, mask).loss.backward()
    assert adv.grad is None  # the advantages are constants of the surrogate
    assert lp.grad is not None and float(lp.grad.abs().sum()) > 0.0
