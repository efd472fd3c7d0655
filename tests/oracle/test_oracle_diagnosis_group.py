"""The single-key diagnosis names a one-key mistake in a critic-free dump (closing_d "left alone").

A dump made under a critic-free setting is checked under the same setting with ONE key changed
(the estimator, or one of ``group_std``, ``group_std_level``, ``group_eps``, ``group_singleton``,
``group_kl``); the diagnosis (no ``--detect``) must name the key and value the dump was made with
as the full explanation. A GAE dump is not re-run through the critic-free options.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from oracle_helpers import make_inputs, refppo_dump, save, setup_for

from refppo.dump.load import load_dump
from refppo.oracle.check.alternatives import GROUP_ALTERNATIVES
from refppo.oracle.check.diagnose import check

BASE = {"advantage": "grpo", "whiten_advantages": "none", "kl_in": "reward", "group_singleton": "error"}
GROUPS = torch.tensor([3, 1, 3, 1, 3, 1, 3, 1])  # two interleaved groups of 4
WITH_SINGLE = torch.tensor([3, 1, 3, 1, 3, 1, 3, 5])  # prompt 5 has one response

CASES: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    # name: (made with, checked with (both over BASE), the explanation the diagnosis must print)
    "std": ({"group_std": "population"}, {}, "group_std=population"),
    "std-passk": (
        {"advantage": "grpo-passk", "group_std": "population"},
        {"advantage": "grpo-passk"},
        "group_std=population",
    ),
    "level": ({"group_std_level": "batch"}, {}, "group_std_level=batch"),
    "level-centred": ({"group_std_level": "batch-centred"}, {}, "group_std_level=batch-centred"),
    "eps": ({"group_eps": 1e-4}, {}, "group_eps=0.0001"),
    "kl": ({"group_kl": "to_go"}, {}, "group_kl=to_go"),
    "estimator-rloo": ({"advantage": "rloo"}, {}, "advantage=rloo"),
    "estimator-grpo": ({}, {"advantage": "dr-grpo"}, "advantage=grpo"),
    "estimator-gpg": ({"advantage": "gpg"}, {"advantage": "opo"}, "advantage=gpg"),
    "singleton": ({"group_singleton": "zero"}, {"group_singleton": "score"}, "group_singleton=zero"),
}


def _inputs(groups: torch.Tensor) -> dict[str, torch.Tensor]:
    x = make_inputs(B=8, T=10, seed=11)
    for k in ("old_values", "values"):
        x.pop(k)
    x["group_index"] = groups.clone()
    return x


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_one_key_mistake_in_a_critic_free_dump_is_named(tmp_path: Path, case: str) -> None:
    made_with, checked_with, needle = CASES[case]
    made = setup_for(conv={**BASE, **made_with}, hp={"kl_coef": 0.1})
    groups = WITH_SINGLE if case == "singleton" else GROUPS
    dump = load_dump(save(tmp_path, refppo_dump(_inputs(groups), made), made))
    res = check(dump, setup_for(conv={**BASE, **checked_with}, hp={"kl_coef": 0.1}))
    assert not res.match
    text = "\n".join(res.diagnosis)
    assert f"explained by the convention {needle}" in text, text
    assert any(f["kind"] == "convention" and f["all_match"] for f in res.explained_by)


def test_a_gae_dump_is_not_rerun_through_the_critic_free_options(tmp_path: Path) -> None:
    made = setup_for(conv={"whiten_advantages": "none"})
    x = make_inputs(B=8, T=10, seed=11)
    x["group_index"] = GROUPS.clone()
    dump = load_dump(save(tmp_path, refppo_dump(x, made), made))
    res = check(dump, setup_for(conv={"whiten_advantages": "masked"}))
    assert res.first_divergence == "advantages"
    changed = {k for f in res.explained_by if f["kind"] == "convention" for k in f["change"]}
    assert changed == {"whiten_advantages"}, res.explained_by
    assert not changed & set(GROUP_ALTERNATIVES)
