"""refppo.capture on 2 gloo ranks × 2 micro-batches of unequal token counts (issue 10, "Done when").

The worker (tests/train/_capture_trainer.py) runs one optimizer step per case under DDP and dumps it
through ``refppo.capture.recorder.StepRecorder``. Each dump is checked two ways:

1. independently of refppo's capture and oracle code: the gradients against autograd of
   ``refppo.pipeline.step.update_quantities`` called here on the WHOLE step (8 rows, global normalisers
   by construction), times the factor each bug predicts per micro-batch / rank, or the closed form
   the bug computes (clip straight-through, advantages in the graph, the padding slot);
2. by the oracle (``refppo diff``, in process): every ``loss_agg`` mode matches (exit 0); each bug
   mismatches at ``grad_logprobs``/``grad_values`` (exit 1) and is named, with the micro-batch or
   rank it hits.

Teardown as tests/train/test_ddp.py (FileStore rendezvous, barrier + destroy, ``os._exit``; every rank
killed as soon as one fails, with every rank's output in the assertion).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
import _capture_trainer as ct  # the worker script beside this test
import test_ddp as ddp  # the shared spawn/teardown helper

from refppo.agg_conventions import MASK_AGGS
from refppo.conventions import LossAgg
from refppo.oracle.cli import main as refppo_diff
from refppo.pipeline.settings import Convention
from refppo.pipeline.step import update_quantities

pytestmark = pytest.mark.e2e

TOL = 1e-12
"""Absolute tolerance on float64 gradients of size ~0.01–0.3: DDP's all-reduce and the
micro-batch split only change the summation order (measured ≤ 1e-16); any normaliser error
moves them by a factor."""


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("capture_ddp")
    out = tmp / "dumps"
    out.mkdir()
    assert ddp.WORLD == ct.WORLD
    ddp._spawn_workers(tmp, out, script=ct.__file__)
    return out


def _reference(agg: str) -> dict[str, torch.Tensor]:
    """Autograd of update_quantities on the whole step (here, not through refppo.capture)."""
    policy, critic, b = ct.setup()
    conv = Convention.of(loss_agg=LossAgg(agg))
    q = ct.quantities(b, conv)
    with torch.no_grad():
        lp0, v0 = policy(b.ids), critic(b.ids)
    lp, v = lp0.clone().requires_grad_(True), v0.clone().requires_grad_(True)
    uq = update_quantities(
        logprobs=lp, values=v, old_logprobs=b.old_logprobs, old_values=b.old_values, advantages=q.advantages,
        returns=q.returns, mask=b.mask, value_mask_=q.value_mask, ref_logprobs=b.ref_logprobs,
        hp=ct.HP, conv=conv,
    )  # fmt: skip
    grads = torch.autograd.grad(uq.loss, [lp, v])
    zero = torch.zeros((), dtype=torch.float64)
    return {
        "grad_logprobs": torch.where(b.mask, grads[0], zero),
        "grad_values": torch.where(q.value_mask, grads[1], zero),
        "lp": lp0,
        "adv": q.advantages,
        "old": b.old_logprobs,
        "mask": b.mask,
        "vmask": q.value_mask,
        "scores": b.scores,
        "loss": uq.loss.detach(),
    }


def _load(dumps: Path, name: str, bug: str | None) -> dict[str, torch.Tensor]:
    d = load_file(str(dumps / f"{name}.safetensors"))
    _, _, b = ct.setup()
    groups = [g for rank in ct.micro_rows(bug) for g in rank]
    rows = [row for g in groups for row in g[2]]
    assert rows == list(range(8))  # rank-major, micro-batch order: the global row order
    assert d["rank"].tolist() == [g[0] for g in groups for _ in g[2]]
    assert d["micro_batch"].tolist() == [g[1] for g in groups for _ in g[2]]
    assert torch.equal(d["scores"], b.scores) and torch.equal(d["response_mask"].bool(), b.mask)
    return d


def _diff(path: Path) -> tuple[int, dict[str, object]]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = refppo_diff([str(path), "--json"])
    return code, json.loads(buf.getvalue())


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("agg", [a.value for a in MASK_AGGS])
def test_capture_ddp_correct_step_matches(dumps: Path, agg: str) -> None:
    d = _load(dumps, f"ok-{agg}", None)
    ref = _reference(agg)
    assert float(ref["grad_logprobs"].abs().max()) > 1e-2 and float(ref["grad_values"].abs().max()) > 1e-2
    for key in ("grad_logprobs", "grad_values"):
        assert _err(d[key], ref[key]) <= TOL, (agg, key, _err(d[key], ref[key]))
    assert abs(float(d["loss"]) - float(ref["loss"])) <= TOL  # Σ ranks Σ micro-batches, ×1/W
    side = json.loads((dumps / f"ok-{agg}.safetensors.json").read_text())
    assert (side["world_size"], side["micro_batches"], side["loss_agg"]) == (2, 2, agg)
    code, rep = _diff(dumps / f"ok-{agg}.safetensors")
    assert code == 0, rep["diagnosis"]
    assert {"grad_logprobs", "grad_values"} <= set(rep["quantities"])  # type: ignore[arg-type]


def _groups(bug: str | None) -> list[tuple[int, int, list[int]]]:
    return [(r, k, rows) for rank in ct.micro_rows(bug) for r, k, rows, _ in rank]


def _per_group(d: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], bug: str, factor: object) -> None:
    """``d == factor(rows) · ref`` on each micro-batch's rows, for both gradients."""
    for _, _, rows in _groups(bug):
        idx = torch.tensor(rows)
        f = float(factor(idx))  # type: ignore[operator]
        for key in ("grad_logprobs", "grad_values"):
            assert _err(d[key][idx], f * ref[key][idx]) <= TOL, (bug, rows, key, f)


EXPLAINED = {
    "token_mean_per_micro": "local_normaliser",
    "seq_count_per_micro": "local_normaliser",
    "ddp_sum": "factor_W",
    "missing_accumulation": "factor_K",
    "advantages_not_detached": "advantages_not_detached",
    "clipped_region_gradient": "clip_not_in_gradient",
    "padding_leak": "padding_leak",
}
"""The oracle's name (``explained_by[].bug`` of ``refppo diff --json``) for each injected bug."""


@pytest.mark.parametrize("bug", ct.BUGS)
def test_capture_ddp_injected_bug_is_caught_and_named(dumps: Path, bug: str) -> None:
    agg = "seq-mean-token-mean" if bug == "seq_count_per_micro" else "token-mean"
    d = _load(dumps, bug, bug)
    ref = _reference(agg)
    n_tok, W = float(ref["mask"].sum()), ct.WORLD
    K = len(ct.lengths(bug)[0])
    # 1. independent of refppo.capture / refppo.oracle: the gradient each bug predicts
    if bug == "token_mean_per_micro":
        _per_group(d, ref, bug, lambda idx: n_tok / (W * K * float(ref["mask"][idx].sum())))
    elif bug == "seq_count_per_micro":
        _per_group(d, ref, bug, lambda idx: 8.0 / (W * K * len(idx)))
    elif bug in ("ddp_sum", "missing_accumulation"):
        _per_group(d, ref, bug, lambda idx: W if bug == "ddp_sum" else K)
    elif bug == "advantages_not_detached":
        assert _err(d["grad_logprobs"], ref["grad_logprobs"]) <= TOL
        # A = R − V: ∂J/∂V gains −∂pg/∂A = ρ_chosen/N (token-mean; ρ_chosen the branch max() picks)
        ratio = torch.exp(ref["lp"] - ref["old"])
        cut = ratio.clamp(1 - ct.HP.cliprange, 1 + ct.HP.cliprange)
        chosen = torch.where(-ref["adv"] * ratio >= -ref["adv"] * cut, ratio, cut)
        want = ref["grad_values"] - torch.where(ref["mask"], -chosen / n_tok, torch.zeros(()))
        assert _err(d["grad_values"], want) <= TOL and _err(want, ref["grad_values"]) > 1e-3
    elif bug == "clipped_region_gradient":
        ratio = torch.exp(ref["lp"] - ref["old"])
        unclipped = torch.where(ref["mask"], -ref["adv"] * ratio / n_tok, torch.zeros(()))  # ∂(−A·ρ/N)/∂logp
        clipped = (ref["grad_logprobs"] == 0) & ref["mask"] & (ref["adv"] != 0)
        assert int(clipped.sum()) >= 3  # the case exercises the clip
        assert (
            _err(d["grad_logprobs"], unclipped) <= TOL and _err(d["grad_values"], ref["grad_values"]) <= TOL
        )
    elif bug == "padding_leak":
        leak_rows = torch.tensor(_groups(bug)[2][2])  # rank 1, micro-batch 0
        for key, m in (("grad_logprobs", ref["mask"]), ("grad_values", ref["vmask"])):
            assert _err(torch.where(m, d[key], 0.0), ref[key]) <= TOL  # valid positions exact
            pad = torch.where(m, 0.0, d[key]).abs() > 0
            assert set(pad.any(dim=1).nonzero().flatten().tolist()) <= set(leak_rows.tolist())
        assert bool((torch.where(ref["vmask"], 0.0, d["grad_values"]).abs() > 1e-3).any())
    # 2. the oracle: a mismatch at the gradients, named, with the micro-batch / rank it hits
    code, rep = _diff(dumps / f"{bug}.safetensors")
    diag = "\n".join(rep["diagnosis"])  # type: ignore[arg-type]
    assert code == 1, diag
    q = rep["quantities"]
    assert not (q["grad_logprobs"]["ok"] and q["grad_values"]["ok"]), diag  # type: ignore[index]
    named = [e["bug"] for e in rep["explained_by"]]  # type: ignore[attr-defined, union-attr]
    assert EXPLAINED[bug] in [n.split(" ")[0] for n in named], diag  # W = K = 2 is named "factor_W = K"
    if bug == "token_mean_per_micro":
        assert (
            "micro-batch 0 of rank 0: factor 1.4" in diag and "micro-batch 0 of rank 1: factor 1.75" in diag
        )
    if bug == "seq_count_per_micro":
        assert (
            "micro-batch 0 of rank 0: factor 2" in diag and "micro-batch 1 of rank 0: factor 0.6667" in diag
        )
    if bug == "padding_leak":
        assert (
            "micro-batch 0 of rank 1" in diag
            and "micro-batch 0 of rank 0" not in diag.split("padding leak")[1]
        )
