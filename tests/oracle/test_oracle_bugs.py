"""Injected bugs are found at the right first divergence, with a fitting diagnosis.

Each buggy quantity is written here from the bug's definition with plain Python loops (see
oracle_helpers), never with the oracle's own re-enactment, so a wrong diagnosis fails the test.
The rest of each dump comes from the naive twins (``naive_dump``: token by token, not the code the
oracle recomputes with), so the clean dump's match is not the recompute agreeing with itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle_helpers import (
    HP,
    gae_loop,
    lengths_of,
    make_inputs,
    naive_dump,
    rows,
    save,
    setup_for,
    whiten_list,
)

from refppo.dump.load import load_dump
from refppo.oracle.check.diagnose import CheckResult, check

GAMMA, LAM, BETA = HP["gamma"], HP["lam"], HP["kl_coef"]


def _check(tmp_path: Path, d: dict[str, torch.Tensor], **conv: str) -> CheckResult:
    s = setup_for(conv=conv)
    return check(load_dump(save(tmp_path, d, s)), s)


def _text(res: CheckResult) -> str:
    return "\n".join(res.diagnosis)


def _base(**conv: str) -> tuple[dict[str, torch.Tensor], list[int]]:
    inp = make_inputs(B=6, T=12, seed=3)
    d = naive_dump(inp, setup_for(conv=conv))
    return d, lengths_of(inp["response_mask"])


def _whiten_rows(
    adv: list[list[float]], lengths: list[int], T: int, over_padding: bool = False
) -> torch.Tensor:
    flat = [a for row, n in zip(adv, lengths, strict=True) for a in (row if over_padding else row[:n])]
    mu, inv = whiten_list(flat)
    out = [
        [(row[t] - mu) * inv if t < n else 0.0 for t in range(T)] for row, n in zip(adv, lengths, strict=True)
    ]
    return torch.tensor(out, dtype=torch.float64)


def test_clean_dump_matches(tmp_path: Path) -> None:
    d, _ = _base()
    res = _check(tmp_path, d)
    assert res.match and res.first_divergence is None
    assert len(res.quantities) == 11  # every output key (kl_loss only exists with kl_in=loss)


def test_whitening_over_padding(tmp_path: Path) -> None:
    d, lengths = _base()
    T = d["response_mask"].shape[1]
    # raw advantages: the trainer's GAE is right (returns − old_values on valid tokens), 0 on padding
    raw = rows(torch.where(d["response_mask"].bool(), d["returns"] - d["old_values"], torch.zeros(())))
    d["advantages"] = _whiten_rows(raw, lengths, T, over_padding=True)
    for k in ("pg_loss", "pg_clipfrac", "loss"):
        d.pop(k)
    res = _check(tmp_path, d)
    assert res.first_divergence == "advantages"
    assert res.quantities["returns"].ok
    assert "whiten_over_padding" in _text(res)
    assert "affine change" in _text(res)  # a different mean and scale: dump = a·ref + b


def test_score_at_last_position_instead_of_last_valid(tmp_path: Path) -> None:
    d, lengths = _base()
    B, T = d["response_mask"].shape
    kl = rows(d["kl"])
    scores = d["scores"].tolist()
    r = [
        [(-BETA * kl[b][t] if t < lengths[b] else 0.0) + (scores[b] if t == T - 1 else 0.0) for t in range(T)]
        for b in range(B)
    ]
    d["token_rewards"] = torch.tensor(r, dtype=torch.float64)
    res = _check(tmp_path, d)
    assert res.first_divergence == "token_rewards"
    text = _text(res)
    assert "only at the last valid token" in text
    assert "score_at=last_position" in text


def test_kl_from_current_logprobs(tmp_path: Path) -> None:
    d, lengths = _base()
    B, T = d["response_mask"].shape
    lp, ref = rows(d["logprobs"]), rows(d["ref_logprobs"])
    d["kl"] = torch.tensor(
        [[lp[b][t] - ref[b][t] if t < lengths[b] else 0.0 for t in range(T)] for b in range(B)],
        dtype=torch.float64,
    )
    res = _check(tmp_path, d)
    assert res.first_divergence == "kl"
    assert "kl_from_current_logprobs" in _text(res)
    assert "differs everywhere" in _text(res)


def test_gae_bootstrapping_through_padding(tmp_path: Path) -> None:
    d, lengths = _base()
    B, T = d["response_mask"].shape
    r, v = rows(d["token_rewards"]), rows(d["old_values"])
    adv = []
    for b in range(B):
        n = lengths[b]
        boot = v[b][n] if n < T else 0.0  # the bug: V of the first padded slot (junk) bootstraps
        adv.append(gae_loop(r[b], v[b], n, GAMMA, LAM, boot) + [0.0] * (T - n))
    d["returns"] = torch.tensor(
        [[adv[b][t] + v[b][t] if t < lengths[b] else 0.0 for t in range(T)] for b in range(B)],
        dtype=torch.float64,
    )
    d["advantages"] = _whiten_rows(adv, lengths, T)
    for k in ("pg_loss", "pg_clipfrac", "vf_loss", "vf_clipfrac", "loss"):
        d.pop(k)
    res = _check(tmp_path, d)
    assert res.first_divergence == "advantages"
    assert not res.quantities["returns"].ok
    text = _text(res)
    assert "gae_bootstrap_from_padding" in text
    # the returns differ only in rows with padding; the first row is full length
    assert "rows" in text


def test_gae_plain_recursion_through_padding(tmp_path: Path) -> None:
    d, lengths = _base(whiten_advantages="none")
    B, T = d["response_mask"].shape
    r, v = rows(d["token_rewards"]), rows(d["old_values"])
    adv = []
    for b in range(B):  # the bug: recursion over all T positions, padded values not masked, rewards 0 there
        rr = [r[b][t] if t < lengths[b] else 0.0 for t in range(T)]
        full = gae_loop(rr, v[b], T, GAMMA, LAM, 0.0)
        adv.append([full[t] if t < lengths[b] else 0.0 for t in range(T)])
    d["advantages"] = torch.tensor(adv, dtype=torch.float64)
    for k in ("returns", "pg_loss", "pg_clipfrac", "loss"):
        d.pop(k)
    res = _check(tmp_path, d, whiten_advantages="none")
    assert res.first_divergence == "advantages"
    assert "(gae_through_padding)" in _text(res)
    assert "(gae_bootstrap_from_padding)" not in _text(res)


def test_gae_bootstrap_error_peaks_at_the_end(tmp_path: Path) -> None:
    d, lengths = _base(whiten_advantages="none")
    B, T = d["response_mask"].shape
    r, v = rows(d["token_rewards"]), rows(d["old_values"])
    adv = [
        gae_loop(r[b], v[b], lengths[b], GAMMA, LAM, v[b][lengths[b]] if lengths[b] < T else 0.0)
        for b in range(B)
    ]
    d["advantages"] = torch.tensor([a + [0.0] * (T - len(a)) for a in adv], dtype=torch.float64)
    for k in ("returns", "pg_loss", "pg_clipfrac", "loss"):
        d.pop(k)
    res = _check(tmp_path, d, whiten_advantages="none")
    assert res.first_divergence == "advantages"
    assert "peaks at the end of the sequence" in _text(res)
    assert f"in {sum(1 for n in lengths if n < T)} of {B} rows" in _text(res)


def test_unclipped_value_loss(tmp_path: Path) -> None:
    d, lengths = _base()
    B = d["response_mask"].shape[0]
    v, ret = rows(d["values"]), rows(d["returns"])
    terms = [0.5 * (v[b][t] - ret[b][t]) ** 2 for b in range(B) for t in range(lengths[b])]
    d["vf_loss"] = torch.tensor(sum(terms) / len(terms), dtype=torch.float64)
    for k in ("vf_clipfrac", "loss"):
        d.pop(k)
    res = _check(tmp_path, d)
    assert res.first_divergence == "vf_loss"
    assert "value_loss=unclipped" in _text(res)
    assert "with it every quantity in the dump matches" in _text(res)


@pytest.mark.parametrize("wrong", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_wrong_aggregation_mode(tmp_path: Path, wrong: str) -> None:
    d, lengths = _base()
    B = d["response_mask"].shape[0]
    lp, old, adv = rows(d["logprobs"]), rows(d["old_logprobs"]), rows(d["advantages"])
    eps = HP["cliprange"]
    per_seq = []
    for b in range(B):
        losses = []
        for t in range(lengths[b]):
            ratio = torch.tensor(lp[b][t] - old[b][t], dtype=torch.float64).exp().item()
            clipped = min(max(ratio, 1 - eps), 1 + eps)
            losses.append(max(-adv[b][t] * ratio, -adv[b][t] * clipped))
        per_seq.append(sum(losses) / (len(losses) if wrong == "seq-mean-token-mean" else 1))
    d["pg_loss"] = torch.tensor(sum(per_seq) / B, dtype=torch.float64)
    d.pop("loss")
    res = _check(tmp_path, d)
    assert res.first_divergence == "pg_loss"
    assert f"loss_agg={wrong}" in _text(res)
    assert "dump/reference" in _text(res)


def test_sign_flip_and_offset_are_described(tmp_path: Path) -> None:
    d, _ = _base()
    flipped = dict(d)
    flipped["kl"] = -d["kl"]
    res = _check(tmp_path, flipped)
    assert res.first_divergence == "kl" and "sign flip" in _text(res)
    shifted = dict(d)
    m = d["response_mask"].bool()
    shifted["kl"] = torch.where(m, torch.roll(d["kl"], 1, dims=1), torch.zeros((), dtype=torch.float64))
    shifted["kl"][:, 0] = d["kl"][:, 1]  # first column has no left neighbour; make it differ
    res = _check(tmp_path, shifted)
    assert res.first_divergence == "kl"
    assert "offset by one position: dump[t] = ref[t−1]" in _text(res)


def test_padding_only_difference_is_a_note_not_a_failure(tmp_path: Path) -> None:
    d, _ = _base()
    m = d["response_mask"].bool()
    d["advantages"] = torch.where(m, d["advantages"], torch.full((), 3.0, dtype=torch.float64))
    res = _check(tmp_path, d)
    assert res.match
    assert any("advantages: also differs at" in n and "padded" in n for n in res.diagnosis)
