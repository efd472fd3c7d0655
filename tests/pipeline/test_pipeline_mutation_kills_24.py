"""Killing tests for batch 24's pipeline mutation survivors (``tools/mutate.py``): the row subset
(:mod:`refppo.pipeline.row_subset`) of ``truncated_rows`` and of the rollout_rs drop mask, each
against a hand-worked vector."""

from __future__ import annotations

import pytest
import torch

from refppo.pipeline.blocks import Normalisers
from refppo.pipeline.row_subset import kept_rows, put_rows, take_rows, whole_normalisers
from refppo.pipeline.settings import Convention

KEEP = torch.tensor([True, False, True])
MASK = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])  # kept: 2 + 1
VMASK = torch.tensor([[True, False, False], [True, True, True], [True, True, False]])  # kept: 1 + 2


def _q() -> dict[str, object]:
    return {
        "mask": MASK,
        "value_mask": VMASK,
        "scores": torch.tensor([1.0, 2.0, 3.0]),  # [B]: a row quantity, cut too
        "coef": torch.tensor(0.5),  # 0-dim: passed as is
        "name": "x",
    }


def _select(
    q: dict[str, object], conv: Convention, norm: Normalisers
) -> tuple[dict[str, object], Normalisers]:
    """The rows in the loss as step._in_loss takes them: the subset and the whole batch's normalisers."""
    sub = take_rows(q, KEEP)
    return sub, whole_normalisers(sub, 3, conv, norm)


def test_take_rows_cuts_every_b_row_tensor_and_passes_the_rest() -> None:
    """Kills take_rows' `v.dim() >= 1` → `>= 0`/`>= 2`/`>= -1`/`> 1` (a 0-dim tensor has no
    shape[0]; a [B] tensor must be cut to the kept rows)."""
    sub, _ = _select(_q(), Convention.of(truncated_rows="drop"), Normalisers())
    assert sub["scores"].tolist() == [1.0, 3.0]
    assert sub["mask"].tolist() == [[True, True, False], [True, False, False]]
    assert float(sub["coef"]) == 0.5 and sub["name"] == "x"


def test_whole_normalisers_count_the_kept_tokens_when_local() -> None:
    """Local normalisers: token_count = 3 and value_token_count = 3 (the kept rows' tokens, not the
    batch's 6 + 1); drop leaves seq_count None. Kills `token_count is not None` → `is None`, the
    dropped ``token_count=``/``value_token_count=`` and `sub.get('value_mask') is not None` → `is None`."""
    _, norm = _select(_q(), Convention.of(truncated_rows="drop"), Normalisers())
    assert norm.token_count == 3.0
    assert norm.value_token_count == 3.0
    assert norm.seq_count is None


def test_whole_normalisers_keep_the_callers_counts() -> None:
    """A split step's counts (given) are kept as given: kills `vtc is None` → `is not None` and the
    `and` → `or` (each recounts the subset's 3 value tokens over the given 40)."""
    given = Normalisers(token_count=20.0, seq_count=7.0, value_token_count=40.0)
    _, norm = _select(_q(), Convention.of(truncated_rows="mask_in_loss"), given)
    assert (norm.token_count, norm.seq_count, norm.value_token_count) == (20.0, 7.0, 40.0)


def test_whole_normalisers_without_a_value_mask() -> None:
    """No value mask and local counts: value_token_count stays None (`is not None` → `is None`
    would count a missing mask); mask_in_loss counts every row of the batch: seq_count = 3."""
    q = {k: v for k, v in _q().items() if k != "value_mask"}
    _, norm = _select(q, Convention.of(truncated_rows="mask_in_loss"), Normalisers())
    assert norm.value_token_count is None
    assert norm.seq_count == 3.0 and norm.token_count == 3.0


def test_put_rows_fill_and_trailing_dims() -> None:
    """The default fill is 0 (kills `get(k, 0)` → `1`), ``fill`` of a key is used for that key only
    (kills a dropped or misread ``fill``), and a [B_in] row quantity comes back [B] (kills
    `v.shape[1:]` → `v.shape[-1:]`)."""
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out: dict[str, object] = {}
    put_rows(out, {"x": x, "r": x + 1, "v": torch.tensor([5.0, 7.0])}, KEEP, ("x", "r", "v"), fill={"r": 1.0})
    assert out["x"].tolist() == [[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]]
    assert out["r"].tolist() == [[2.0, 3.0], [1.0, 1.0], [4.0, 5.0]]
    assert out["v"].tolist() == [5.0, 0.0, 7.0]


def test_kept_rows_without_a_2d_mask_is_none() -> None:
    """No mask, or one that is not [B, T]: nothing to take out (kills `or` → `and`: None.dim())."""
    assert kept_rows({}) is None
    assert kept_rows({"mask": torch.tensor([True, False])}) is None
    assert kept_rows({"mask": MASK}) is None  # every row has a token
    rows = kept_rows({"mask": torch.tensor([[True, False], [False, False]])})
    assert rows is not None and rows.tolist() == [True, False]


def test_take_rows_cuts_b_row_vectors() -> None:
    """A [B] tensor is cut to the rows too (kills `v.dim() >= 1` → `>= 2`); a 0-dim one and a
    tensor of another length are passed as is."""
    q = {"mask": MASK, "scores": torch.tensor([1.0, 2.0, 3.0]), "c": torch.tensor(2.0), "w": torch.ones(5)}
    out = take_rows(q, KEEP)
    assert out["scores"].tolist() == [1.0, 3.0]
    assert out["mask"].shape == (2, 3)
    assert float(out["c"]) == 2.0 and out["w"].shape == (5,)


def test_put_rows_scatters_vectors_and_keeps_outs_own_rows() -> None:
    """put_rows on KEEP (rows 0, 2): a [n] vector comes back [B] with 0 on row 1 (kills `v.dim() >= 1`
    → `>= 2` and the zeros' `v.shape[1:]` → `v.shape[-1:]`); a [n, T] mask that ``out`` already holds
    [B, T] keeps ``out``'s row 1 (kills the `base.shape == (B, *v.shape[1:])` slice and comparison
    mutants and `base.dtype == v.dtype` → `!=`); a [B] base kept too (`v.shape[1:]` → `[-1:]`);
    a 0-dim value and a key not made are left alone."""
    out: dict[str, object] = {
        "mask": torch.tensor([[True, False], [True, True], [False, False]]),
        "w": torch.tensor([9.0, 8.0, 7.0]),
        "other": "kept",
    }
    sub = {
        "mask": torch.tensor([[False, True], [True, True]]),
        "adv": torch.tensor([1.5, -2.0]),
        "w": torch.tensor([1.0, 2.0]),
        "loss": torch.tensor(0.25),
        "other": "replaced?",
    }
    put_rows(out, sub, KEEP, made=("mask", "adv", "w", "loss", "absent"))
    assert out["mask"].tolist() == [[False, True], [True, True], [True, True]]
    assert out["adv"].tolist() == [1.5, 0.0, -2.0]
    assert out["w"].tolist() == [1.0, 8.0, 2.0]
    assert float(out["loss"]) == 0.25
    assert out["other"] == "kept" and "absent" not in out


def test_put_rows_does_not_carry_the_old_values_graph() -> None:
    """The kept rows of ``out``'s old value are copied detached (kills `base.detach()` → `base`)."""
    base = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], requires_grad=True)
    out: dict[str, object] = {"x": base}
    put_rows(out, {"x": torch.zeros(2, 2)}, KEEP, made=("x",))
    assert out["x"].tolist() == [[0.0, 0.0], [3.0, 4.0], [0.0, 0.0]]
    assert not out["x"].requires_grad


def test_recounts_table() -> None:
    """recounts by hand: ``kept`` recounts only under a correction weight, ``by_advantage`` only with
    CISPO, ``all`` never. Kills the six comparison/bool mutants of recounts."""
    from refppo.pipeline.update import recounts

    w = torch.ones(1, 2)
    cases = [
        ("vanilla", "all", None, False), ("vanilla", "all", w, False),
        ("vanilla", "kept", None, False), ("vanilla", "kept", w, True), ("cispo", "kept", w, True),
        ("vanilla", "by_advantage", w, False), ("cispo", "by_advantage", None, True),
        ("cispo", "all", w, False), ("cispo", "kept", None, False),
    ]  # fmt: skip
    for loss, counts, weight, want in cases:
        conv = Convention.of(policy_loss=loss, clipfrac_counts=counts)
        assert recounts(conv, weight) is want, (loss, counts, weight is not None)


def test_clip_band_by_hand() -> None:
    """(1 − ε_low, 1 + ε_high), ε_high defaulting to ε_low; CISPO with ε_low ≥ 1 (exactly 1 here):
    no lower bound; the vanilla loss keeps 1 − 1 = 0. Kills clip_band's constant/arith/compare
    mutants (binary fractions: exact)."""
    from refppo.pipeline.settings import Hyperparams
    from refppo.pipeline.update import clip_band

    van, cis = Convention.of(policy_loss="vanilla"), Convention.of(policy_loss="cispo")
    assert clip_band(van, Hyperparams(cliprange=0.25, cliprange_high=0.5)) == (0.75, 1.5)
    assert clip_band(van, Hyperparams(cliprange=0.25)) == (0.75, 1.25)
    assert clip_band(cis, Hyperparams(cliprange=0.25, cliprange_high=0.5)) == (0.75, 1.5)
    assert clip_band(cis, Hyperparams(cliprange=1.0, cliprange_high=0.5)) == (None, 1.5)
    assert clip_band(van, Hyperparams(cliprange=1.0, cliprange_high=0.5)) == (0.0, 1.5)


def _clip_q(weights: torch.Tensor | None) -> dict[str, object]:
    """ρ ≈ [2, 0.5, 1] (old 0), A = [−1, −1, 1]; band (0.75, 1.5)."""
    lp = torch.log(torch.tensor([[2.0, 0.5, 1.0]], dtype=torch.float64))
    return {
        "logprobs": lp, "old_logprobs": torch.zeros(1, 3, dtype=torch.float64),
        "advantages": torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64),
        "mask": torch.ones(1, 3, dtype=torch.bool), "is_weights": weights,
    }  # fmt: skip


def test_counted_clipfrac_by_hand() -> None:
    """Band (0.75, 1.5). vanilla+kept, weights [1, 0, 1]: the surrogate clips only token 1 (ρ 0.5,
    A < 0), whose weight is 0: 0/3 (CISPO's rule would count token 0: kills `is not CISPO` → `is`;
    no weight would count token 1: kills the dropped ``weight=``). cispo+by_advantage: token 1
    (ρ < 0.75, A < 0) only: 1/3. ``all``: the core's value as given (kills `not recounts` →
    `recounts`); the dropped ``band=``/``surrogate=``/``counts=`` fail to call."""
    from refppo.pipeline.settings import Hyperparams
    from refppo.pipeline.update import counted_clipfrac

    hp = Hyperparams(cliprange=0.25, cliprange_high=0.5)
    core = torch.tensor(-7.0, dtype=torch.float64)
    kept = Convention.of(policy_loss="vanilla", clipfrac_counts="kept")
    got = counted_clipfrac(_clip_q(torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64)), kept, hp, core)
    assert float(got) == 0.0
    by_adv = Convention.of(policy_loss="cispo", clipfrac_counts="by_advantage")
    assert float(counted_clipfrac(_clip_q(None), by_adv, hp, core)) == pytest.approx(1 / 3)
    assert float(counted_clipfrac(_clip_q(None), Convention.of(clipfrac_counts="all"), hp, core)) == -7.0


def test_policy_convention_refusals_by_hand() -> None:
    """PolicyConvention's checks: dual-clip c must be finite and > 1 (1.0, 0.5 and inf refused, 1.5
    taken: kills the `> 1.0` boundary/constant and `and` → `or` mutants); clipfrac_agg=row-mean
    only with vanilla and clipfrac_counts=all (each alone taken: kills the compare/bool mutants)."""
    from refppo.errors import ConventionError, HyperparameterError

    for c in (1.0, 0.5, float("inf")):
        with pytest.raises(HyperparameterError, match=r"^dual_clip: expected c > 1"):
            Convention.of(dual_clip=c)
    assert Convention.of(dual_clip=1.5).policy.dual_clip == 1.5
    Convention.of(clipfrac_agg="row-mean")
    Convention.of(clipfrac_counts="kept")
    Convention.of(policy_loss="cispo")
    with pytest.raises(ConventionError, match=r"^clipfrac_agg=row-mean with clipfrac_counts=kept"):
        Convention.of(clipfrac_agg="row-mean", clipfrac_counts="kept")
    with pytest.raises(ConventionError, match=r"^clipfrac_agg=row-mean: policy_loss=vanilla only"):
        Convention.of(clipfrac_agg="row-mean", policy_loss="cispo")


def test_gate_masks_takes_a_value_mask_with_an_empty_row() -> None:
    """drop_mask with verl's token gate e^x in [0.5, 2], x = l^beh − l^old = [[0, 1, 0], [0, −1, ·]]:
    the policy mask keeps [[1, 0, 1], [1, 0, 0]]; a value mask whose row 1 is empty (no value token,
    e.g. a critic-free row) is taken and narrowed to [[1, 0, 1], [0, 0, 0]]. Kills
    ``require_nonempty_rows=False`` → ``True`` and its dropped keyword (each refuses the empty row)."""
    from refppo.pipeline.correction import gate_masks

    m = torch.tensor([[True, True, True], [True, True, False]])
    z = torch.zeros(2, 3, dtype=torch.float64)
    beh = torch.tensor([[0.0, 1.0, 0.0], [0.0, -1.0, 7.5]], dtype=torch.float64)
    vm = torch.tensor([[True, True, True], [False, False, False]])
    gate = {"rollout_rs": "token", "rollout_rs_stat": "ratio", "rollout_rs_order": "behaviour",
            "rollout_rs_low": 0.5, "rollout_rs_high": 2.0}  # fmt: skip
    conv = Convention.of(**gate, rollout_rs_effect="drop_mask")
    q = {"mask": m, "value_mask": vm, "logprobs": z, "old_logprobs": z, "rollout_logprobs": beh}
    out = gate_masks(q, conv)
    assert out["mask"].tolist() == [[True, False, True], [True, False, False]]
    assert out["value_mask"].tolist() == [[True, False, True], [False, False, False]]


def test_scattered_passes_an_empty_ratio_and_scatters_a_full_one() -> None:
    """step._scattered: an empty ``ratio`` (no policy term in the walk) is passed as is (kills
    `numel() > 0` → `>= 0`: scattering 0 values onto 2 kept rows fails); a [2, 2] ratio comes back
    [3, 2] with 1 on the row out of the loss."""
    from refppo.pipeline.step import _UPDATE_OUT, _scattered

    out = {k: torch.tensor(0.0) for k in _UPDATE_OUT}
    out["ratio"] = torch.empty(0)
    assert _scattered(out, KEEP).ratio.numel() == 0
    out["ratio"] = torch.tensor([[2.0, 3.0], [4.0, 5.0]])
    assert _scattered(out, KEEP).ratio.tolist() == [[2.0, 3.0], [1.0, 1.0], [4.0, 5.0]]
