"""refppo.capture.recorder.StepRecorder on one process: the dump's gradients equal autograd of the pipeline's
loss on the whole step (computed here directly, not through the recorder), and misuse fails with one
clear line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from refppo.agg_conventions import MASK_AGGS
from refppo.capture.recorder import CaptureError, StepRecorder
from refppo.conventions import LossAgg
from refppo.pipeline.blocks import Normalisers
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import update_quantities

HP = Hyperparams(cliprange=0.2, cliprange_value=0.2, vf_coef=0.5, horizon=6.0)
LENGTHS = ([5, 2, 3], [1, 4])
"""Valid tokens per row of micro-batch 0 (T = 5) and 1 (T = 4): unequal token counts and widths."""


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """The whole step (5 rows, T = 6 with one all-padding column), float64, padding holds junk."""
    g = torch.Generator().manual_seed(seed)
    lengths = [n for part in LENGTHS for n in part]
    B, T = len(lengths), 6
    mask = torch.arange(T).expand(B, T) < torch.tensor(lengths).unsqueeze(1)

    def r(scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(B, T, generator=g, dtype=torch.float64)

    old = -1.0 + 0.3 * r()
    return {
        "response_mask": mask,
        "logprobs_init": old + 0.3 * r(),  # ratio far from 1: both clip regions occur
        "values_init": r(),
        "old_logprobs": old,
        "ref_logprobs": old + 0.1 * r(),
        "old_values": r(),
        "advantages": r(),
        "returns": r(),
        "scores": torch.randn(B, generator=g, dtype=torch.float64),
    }


def _loss(
    b: dict[str, torch.Tensor],
    rows: slice,
    lp: torch.Tensor,
    v: torch.Tensor,
    conv: Convention,
    norm: Normalisers | None,
    T: int,
) -> torch.Tensor:
    return update_quantities(
        logprobs=lp,
        values=v,
        old_logprobs=b["old_logprobs"][rows, :T],
        old_values=b["old_values"][rows, :T],
        advantages=b["advantages"][rows, :T],
        returns=b["returns"][rows, :T],
        mask=b["response_mask"][rows, :T],
        hp=HP,
        conv=conv,
        norm=norm,
    ).loss


def _reference(b: dict[str, torch.Tensor], conv: Convention) -> tuple[torch.Tensor, torch.Tensor]:
    """∂loss/∂logprobs and ∂loss/∂values of the whole step: one update_quantities call, autograd."""
    lp = b["logprobs_init"].clone().requires_grad_(True)
    v = b["values_init"].clone().requires_grad_(True)
    _loss(b, slice(None), lp, v, conv, None, 6).backward()
    assert lp.grad is not None and v.grad is not None
    return lp.grad, v.grad


def _run(b: dict[str, torch.Tensor], conv: Convention, path: Path, backward: bool = True) -> StepRecorder:
    """Two micro-batches, each trimmed to its own width, global normalisers, one recorder."""
    m = b["response_mask"]
    norm = Normalisers(
        token_count=float(m.sum()), seq_count=float(m.shape[0]), value_token_count=float(m.sum())
    )
    rec = StepRecorder(hparams=HP, conventions=conv, reduce="mean")
    start = 0
    for k, part in enumerate(LENGTHS):
        rows, T = slice(start, start + len(part)), max(part)
        start += len(part)
        lp = b["logprobs_init"][rows, :T].clone().requires_grad_(True)
        v = b["values_init"][rows, :T].clone().requires_grad_(True)
        loss = _loss(b, rows, lp, v, conv, norm, T)
        rec.record(
            micro_batch=k,
            logprobs=lp,
            values=v,
            response_mask=m[rows, :T],
            old_logprobs=b["old_logprobs"][rows, :T],
            ref_logprobs=b["ref_logprobs"][rows, :T],
            old_values=b["old_values"][rows, :T],
            scores=b["scores"][rows],
            advantages=b["advantages"][rows, :T],
            returns=b["returns"][rows, :T],
            loss=loss,
        )
        if backward:
            loss.backward()
    return rec


@pytest.mark.parametrize("agg", list(MASK_AGGS))
def test_recorder_gradient_equals_autograd_of_the_whole_step(tmp_path: Path, agg: LossAgg) -> None:
    b = _batch()
    conv = Convention.of(loss_agg=agg)
    path = tmp_path / "step.safetensors"
    side = _run(b, conv, path).write(path)
    assert side is not None
    d = load_file(str(path))
    want_lp, want_v = _reference(b, conv)
    # the dump is as wide as the widest micro-batch (5); the recorder pads micro-batch 1 (T = 4)
    assert d["grad_logprobs"].shape == (5, 5) and d["micro_batch"].tolist() == [0, 0, 0, 1, 1]
    assert d["rank"].tolist() == [0] * 5
    assert torch.equal(d["response_mask"].bool(), b["response_mask"][:, :5])
    assert torch.equal(d["old_logprobs"][3:, 4], torch.zeros(2))  # zero fill, not the batch's values
    err_lp = float((d["grad_logprobs"] - want_lp[:, :5]).abs().max())
    err_v = float((d["grad_values"] - want_v[:, :5]).abs().max())
    assert err_lp <= 1e-15 and err_v <= 1e-15, (agg, err_lp, err_v)
    assert float(want_lp.abs().max()) > 1e-3  # not two zero tensors
    meta = json.loads(side.read_text())
    assert (meta["world_size"], meta["micro_batches"], meta["separate_critic"]) == (1, 2, False)
    assert meta["loss_agg"] == agg.value and meta["vf_coef"] == 0.5
    whole = _loss(b, slice(None), b["logprobs_init"], b["values_init"], conv, None, 6)
    assert abs(float(d["loss"]) - float(whole)) <= 1e-12  # micro losses sum to the step's loss


def test_recorder_sees_a_per_micro_batch_normaliser(tmp_path: Path) -> None:
    """Control: local (per-micro-batch) token-mean normalisers give a different, caught gradient."""
    b = _batch()
    conv = Convention()
    rec = StepRecorder(hparams=HP, conventions=conv)
    start = 0
    for k, part in enumerate(LENGTHS):
        rows, T = slice(start, start + len(part)), max(part)
        start += len(part)
        lp = b["logprobs_init"][rows, :T].clone().requires_grad_(True)
        v = b["values_init"][rows, :T].clone().requires_grad_(True)
        rec.record(
            micro_batch=k,
            logprobs=lp,
            values=v,
            response_mask=b["response_mask"][rows, :T],
            old_logprobs=b["old_logprobs"][rows, :T],
            ref_logprobs=b["ref_logprobs"][rows, :T],
            old_values=b["old_values"][rows, :T],
            scores=b["scores"][rows],
        )
        (_loss(b, rows, lp, v, conv, None, T) / 2).backward()
    rec.write(tmp_path / "bug.safetensors")
    d = load_file(str(tmp_path / "bug.safetensors"))
    want, _ = _reference(b, conv)
    m = b["response_mask"][:, :5]
    got, ref = d["grad_logprobs"][m], want[:, :5][m]
    # micro-batch 0 has 10 of 15 tokens: factor 15/(2·10); micro-batch 1 has 5: 15/(2·5)
    assert torch.allclose(got[:10], 0.75 * ref[:10], rtol=1e-12, atol=0.0)
    assert torch.allclose(got[10:], 1.5 * ref[10:], rtol=1e-12, atol=0.0)
    assert not torch.allclose(got, ref)


def test_recorder_misuse_fails_with_one_line(tmp_path: Path) -> None:
    b = _batch()
    rec = _run(b, Convention(), tmp_path / "x.safetensors", backward=False)
    with pytest.raises(CaptureError, match="no gradient captured for logprobs of micro-batch 0"):
        rec.write(tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    with pytest.raises(CaptureError, match="already written"):
        rec.write(tmp_path / "x.safetensors")
    with pytest.raises(CaptureError, match="already written"):
        rec.record(
            response_mask=b["response_mask"],
            old_logprobs=b["old_logprobs"],
            ref_logprobs=b["ref_logprobs"],
            old_values=b["old_values"],
            scores=b["scores"],
        )
    fresh = StepRecorder(hparams=HP)
    kw = {k: b[k] for k in ("response_mask", "old_logprobs", "ref_logprobs", "old_values", "scores")}
    with pytest.raises(
        CaptureError, match=r"^record: unknown key 'advantage' \(did you mean advantages\?\)$"
    ):
        fresh.record(**kw, advantage=b["advantages"])
    with pytest.raises(
        CaptureError, match=r"unknown keys 'pgloss' \(did you mean pg_loss\?\), 'zzz'; valid keys"
    ):
        fresh.record(**kw, pgloss=0.5, zzz=1.0)
    with pytest.raises(CaptureError, match=r"old_values has shape \[5, 5\], expected \[5, 6\]"):
        fresh.record(**{**kw, "old_values": b["old_values"][:, :5]})
    with pytest.raises(CaptureError, match="nothing was recorded"):
        fresh.write(tmp_path / "y.safetensors")
    mixed = StepRecorder(hparams=HP)
    mixed.record(**kw, micro_batch=0, advantages=b["advantages"])
    with pytest.raises(CaptureError, match="micro_batch=0 was already recorded"):
        mixed.record(**kw, micro_batch=0)
    mixed.record(**kw, micro_batch=1)
    with pytest.raises(CaptureError, match=r"micro-batch 1 recorded keys .* but micro-batch 0"):
        mixed.write(tmp_path / "z.safetensors")
    gap = StepRecorder(hparams=HP)
    gap.record(**kw, micro_batch=1)
    with pytest.raises(CaptureError, match=r"micro_batch indices must be 0\.\.0 .*got \[1\]"):
        gap.write(tmp_path / "g.safetensors")
    with pytest.raises(CaptureError, match="reduce: expected 'mean' or 'sum'"):
        StepRecorder(reduce="avg")  # type: ignore[arg-type]  # the misuse under test


def test_recorder_refuses_what_it_would_otherwise_lose_or_truncate(tmp_path: Path) -> None:
    # each of these was accepted (float index truncated, 0.5 mask cast to 0, a detached logprobs
    # silently leaving the gradient unchecked) or crashed with a raw error (list mask, vector loss)
    b = _batch()
    kw = {k: b[k] for k in ("response_mask", "old_logprobs", "ref_logprobs", "old_values", "scores")}
    rec = StepRecorder(hparams=HP)
    with pytest.raises(CaptureError, match=r"micro_batch must be an int index, got 0\.7"):
        rec.record(**kw, micro_batch=0.7)  # type: ignore[arg-type]  # the wrong type under test
    with pytest.raises(CaptureError, match="response_mask must be a tensor, got list"):
        rec.record(**{**kw, "response_mask": b["response_mask"].tolist()})
    with pytest.raises(CaptureError, match="only 0/1"):
        rec.record(**{**kw, "response_mask": b["response_mask"].double() * 0.5})
    with pytest.raises(CaptureError, match=r"loss 'loss' must be one number, got .*shape \[3\]"):
        rec.record(**kw, loss=torch.ones(3))
    with pytest.raises(CaptureError, match="logprobs does not require grad"):
        rec.record(**kw, logprobs=b["logprobs_init"])
    no_grads = StepRecorder(hparams=HP, grads=False)  # an explicit dump without gradients
    no_grads.record(**kw, logprobs=b["logprobs_init"])
    no_grads.write(tmp_path / "ng.safetensors")
    assert (tmp_path / "ng.safetensors").exists()


def test_grads_false_writes_no_gradient_even_for_tensors_that_require_grad(tmp_path: Path) -> None:
    """``StepRecorder(grads=False)``: "a dump without gradients". It used to register the hook
    whenever the tensor required grad, so a backward put ``grad_logprobs`` into the dump anyway."""
    b = _batch()
    kw = {k: b[k] for k in ("response_mask", "old_logprobs", "ref_logprobs", "old_values", "scores")}
    lp = b["logprobs_init"].clone().requires_grad_(True)
    rec = StepRecorder(hparams=HP, grads=False)
    rec.record(**kw, logprobs=lp)
    (lp * b["response_mask"]).sum().backward()
    rec.write(tmp_path / "ng.safetensors")
    keys = set(load_file(str(tmp_path / "ng.safetensors")))
    assert "logprobs" in keys and "grad_logprobs" not in keys


def test_bad_conventions_fail_at_construction() -> None:
    """issue #21: a misspelt convention name or key failed only at diff time, far from the trainer."""
    with pytest.raises(CaptureError, match=r"^StepRecorder: loss_agg: unknown name 'token_mean'"):
        StepRecorder(hparams=HP, conventions={"loss_agg": "token_mean"})
    with pytest.raises(
        CaptureError, match=r"unknown sidecar key 'kl_estimater' \(did you mean kl_estimator\?\)"
    ):
        StepRecorder(hparams=HP, conventions={"kl_estimater": "k3"})
    with pytest.raises(CaptureError, match="gamma: expected a number in"):
        StepRecorder(hparams={"gamma": 1.5})
    StepRecorder(hparams=HP, conventions={"loss_agg": "token-mean", "score_clip": 5.0, "vf_mask": "value"})
