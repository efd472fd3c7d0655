"""``--detect`` walks ``truncated_rows`` (issue #23 item 5; :mod:`refppo.oracle.detect.in_loss`).

On a dump whose ``truncated`` flags some rows, a pipeline-made dump under ``mask_in_loss`` is listed
with ``mask_in_loss`` only and one under ``drop`` with ``drop`` only (``loss_agg=seq-mean-token-mean``:
there the row count ``N_seq`` tells the two apart, and the masked tokens tell both from ``keep``),
from refppo's defaults and from a checked ``--set truncated_rows=…`` (refused in one line before).
Where no row is flagged, every member is the same function: ``keep`` alone is walked and listed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs, refppo_dump, save, setup_for

from refppo.cli import main
from refppo.dump.load import load_dump
from refppo.oracle.check.grad import UpdateInputs, pipeline_grads
from refppo.oracle.detect.detection import detect
from refppo.oracle.detect.search import Search

FLAGS = [0, 1, 0, 0, 1, 0, 0, 0]
AGG = {"loss_agg": "seq-mean-token-mean"}


def _dump(tmp: Path, mode: str, flags: list[int] | None = FLAGS, name: str = "step.safetensors") -> Path:
    x = make_inputs(B=8, T=10, seed=5)
    if flags is not None:
        x["truncated"] = torch.tensor(flags, dtype=torch.bool)
    made = setup_for(None, {**AGG, "truncated_rows": mode})
    return save(tmp, refppo_dump(x, made), setup_for(None, {}), name)


def _listed(path: Path, conv: dict[str, str] | None = None) -> set[str]:
    found = detect(load_dump(path), setup_for(None, conv or {}))
    assert found.detected, found.unmatched
    return {c.get("truncated_rows", "keep") for c in found.detected}


@pytest.mark.parametrize("mode", ["mask_in_loss", "drop", "keep"])
def test_the_member_that_made_the_dump_is_listed_alone(tmp_path: Path, mode: str) -> None:
    assert _listed(_dump(tmp_path, mode)) == {mode}


@pytest.mark.parametrize("mode", ["mask_in_loss", "drop"])
def test_a_checked_member_is_walked_not_refused(tmp_path: Path, mode: str) -> None:
    """Before: ``--detect does not walk truncated_rows=… yet`` (detection.unwalkable)."""
    path = _dump(tmp_path, mode)
    assert _listed(path, {"truncated_rows": mode}) == {mode}
    assert _listed(path, {"truncated_rows": "drop" if mode == "mask_in_loss" else "mask_in_loss"}) == {mode}
    args = ["--set", f"truncated_rows={mode}", "--set", "loss_agg=seq-mean-token-mean"]
    assert main(["diff", str(path), "--detect", *args]) == 0  # the checked setting reproduces the dump


@pytest.mark.parametrize("flags", [None, [0] * 8], ids=["no flags", "none flagged"])
def test_without_truncated_rows_keep_alone_is_walked(
    tmp_path: Path, flags: list[int] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    tried: set[object] = set()
    real = Search.expand

    def expand(self: Search, *args: Any, **kw: Any) -> Any:
        tried.add(self.base.conv.get("truncated_rows"))
        return real(self, *args, **kw)

    monkeypatch.setattr(Search, "expand", expand)
    path = _dump(tmp_path, "keep", flags)
    assert _listed(path) == {"keep"}
    assert {getattr(v, "value", v) for v in tried} == {"keep"}


GRAD_CASES = [
    ("mask_in_loss", "token-mean", {"mask_in_loss", "drop"}),
    ("keep", "seq-mean-token-sum", {"keep"}),
    ("mask_in_loss", "seq-mean-token-mean", {"mask_in_loss"}),  # drop's policy step unmatched
]


@pytest.mark.parametrize(("mode", "agg", "listed"), GRAD_CASES, ids=[f"{c[0]}-{c[1]}" for c in GRAD_CASES])
def test_the_gradients_tell_the_members_apart(tmp_path: Path, mode: str, agg: str, listed: set[str]) -> None:
    """A dump of ``grad_logprobs``/``grad_values`` alone (no loss scalars). Under ``token-mean`` the
    gradients on the rows in the loss are the same for ``mask_in_loss`` and ``drop`` and differ
    from ``keep``'s. Under ``seq-mean-token-sum`` (``N_seq = B``) ``keep``'s equal ``mask_in_loss``'s
    on the rows in the loss: only its nonzero gradients on the truncated rows rule ``mask_in_loss`` out.
    Under ``seq-mean-token-mean`` ``drop`` reproduces no gradient (before: its unmatched policy step's
    explanation read the dump's rows past the rows in the loss, an IndexError)."""
    x = make_inputs(B=8, T=10, seed=5)
    x["truncated"] = torch.tensor(FLAGS, dtype=torch.bool)
    made = setup_for(None, {"truncated_rows": mode, "loss_agg": agg})
    full = refppo_dump(x, made)
    m = x["response_mask"].bool()
    inp = UpdateInputs(
        full["logprobs"], full["values"], full["old_logprobs"], full["old_values"], full["advantages"],
        full["returns"], m, m, None, None, None, x["truncated"],
    )  # fmt: skip
    grads = pipeline_grads(inp, made)
    assert bool((grads["grad_logprobs"][1] == 0).all()) == (mode != "keep")
    scalars = (
        "pg_loss",
        "vf_loss",
        "loss",
        "pg_clipfrac",
        "vf_clipfrac",
        "approx_kl",
        "entropy_loss",
        "kl_loss",
    )
    dump = {k: v for k, v in full.items() if k not in scalars}
    dump |= {"grad_logprobs": grads["grad_logprobs"], "grad_values": grads["grad_values"]}
    path = save(tmp_path, dump, setup_for(None, {}))
    assert _listed(path, {"loss_agg": agg}) == listed
    # the members ruled out (keep, whose gradient fails on the truncated rows) explain nothing
    assert detect(load_dump(path), setup_for(None, {"loss_agg": agg})).fitted == []
