"""Issue #23 item 4: a β = 0 critic-free dump without ``ref_logprobs`` is checked; where a KL term
with β > 0 reads the reference, its absence is one line naming the key, the stage and the setting."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from oracle_helpers import naive_outputs

from refppo.errors import DumpError
from refppo.oracle.check.settings import Setup
from refppo.oracle.coverage import not_compared
from refppo.oracle.run import check_step
from refppo.pipeline.settings import Convention, Hyperparams

HP = {"gamma": 1.0, "lam": 1.0, "kl_coef": 0.0, "cliprange": 0.2, "cliprange_value": 0.2, "vf_coef": 0.1}


def _dump(kl_in: str = "reward") -> dict[str, Any]:
    """Outputs made by the naive twins WITH ``ref_logprobs`` (β = 0), then the reference dropped (and
    ``kl`` kept)."""
    g = torch.Generator().manual_seed(0)
    B, T = 6, 5
    m = torch.ones(B, T)
    m[1, 3:] = 0
    old = -torch.rand(B, T, generator=g, dtype=torch.float64)
    inp = {
        "response_mask": m, "old_logprobs": old, "ref_logprobs": old + 0.1,
        "scores": torch.randn(B, generator=g, dtype=torch.float64),
        "group_index": torch.tensor([0, 0, 0, 1, 1, 1]),
        "logprobs": old + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64),
    }  # fmt: skip
    setup = Setup(Convention.of(advantage="grpo", kl_in=kl_in), Hyperparams(**HP))
    out = naive_outputs(inp, setup)
    return {**{k: v for k, v in inp.items() if k != "ref_logprobs"}, **out}


@pytest.mark.parametrize("kl_in", ["reward", "loss"])
def test_beta_zero_without_reference_is_checked(kl_in: str) -> None:
    d = _dump(kl_in)
    side = {**HP, "advantage": "grpo", "kl_in": kl_in}
    o = check_step(d, hparams=side)
    assert o.match
    assert "kl" not in o.result.quantities and "pg_loss" in o.result.quantities
    assert not_compared(o.dump, o.result)["kl"] == "no ref_logprobs; β = 0: not read"
    assert "(no ref_logprobs; β = 0: not read)" in o.text()
    # control: another estimator must mismatch (the match is not vacuous)
    assert not check_step(d, hparams={**side, "advantage": "dr-grpo"}).match


@pytest.mark.parametrize("kl_in", ["reward", "loss"])
def test_beta_positive_without_reference_names_key_stage_and_setting(kl_in: str) -> None:
    d = _dump(kl_in)
    stage = "kl" if kl_in == "reward" else "kl_loss"
    with pytest.raises(DumpError) as exc:
        check_step(d, hparams={**HP, "kl_coef": 0.05, "advantage": "grpo", "kl_in": kl_in})
    msg = str(exc.value)
    assert "missing required key 'ref_logprobs' [B, T]" in msg
    assert f"read by the {stage} stage under kl_coef=0.05 (kl_in={kl_in})" in msg
    assert "\n" not in msg
