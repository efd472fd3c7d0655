"""``refppo.capture.adapters`` against the peers' OWN installed code (``tools/peers adapters``).

For verl 0.9.1, OpenRLHF 0.11.2 and TRL 1.12.0 the peer's code builds its own container (a
``DataProto`` through ``apply_kl_penalty``/``compute_advantage`` and ``ppo_loss``/``value_loss``
over two micro-batches; an ``Experience`` through ``compute_advantages_and_returns`` and
``PolicyLoss``/``ValueLoss``; one ``PPOTrainer.train`` step), the adapter turns it into a dump, and
``refppo diff --preset <peer>`` must match; the same container with one field corrupted must
mismatch first at that field. Without the side venv the test is SKIPPED with the reason (a skip is
never a pass).

The behaviour log-probs (issue #22 item 1): verl's ``DataProto`` with ``rollout_log_probs`` and the
weights of verl's own ``rollout_corr_helper.compute_rollout_correction_and_add_to_batch`` (TIS at 2,
IcePop [0.5, 2]) in ``ppo_loss``; OpenRLHF's ``Experience.rollout_log_probs`` through ``PolicyLoss``'s
IS correction (token, clip [0.5, 1.5]); TRL 1.12.0 ``GRPOTrainer._compute_loss`` with vLLM's
``token_truncate`` ratio (TRL's own lines) and ``sampling_per_token_logps`` in its inputs
(``from_trl_grpo``, ``trl_grpo_hparams``). The adapter maps the field to ``rollout_logprobs`` and the
peer's config to ``rollout_is*``; a control sets the behaviour log-probs to the proximal ones (every
weight 1) and must first diverge at ``pg_loss``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _peers import REPO, TOOLS, cases_of, require, run
from peers.adapters import PEERS

VERSIONS = {"verl": "0.9.1", "openrlhf": "0.11.2", "trl": "1.12.0"}
MIN_CASES = {"verl": 5, "openrlhf": 3, "trl": 3}
CORRECTED = {"verl": 2, "openrlhf": 1, "trl": 1}
"""Cases whose container carries the engine's log-probs and the peer's correction."""


def test_a_missing_venv_is_reported_not_run(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(TOOLS / "peers"), "adapters", "--peers-root", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert out.returncode == 1, out.stdout + out.stderr  # nothing ran: never a pass
    assert out.stdout.count("SKIPPED") == 3 and "no case ran" in out.stdout, out.stdout


@pytest.mark.parametrize("peer", sorted(PEERS))
def test_adapter_dumps_from_the_peers_own_code_match_the_preset(peer: str, tmp_path: Path) -> None:
    require(PEERS[peer][0])
    proc, doc = run("adapters", "--peer", peer, tmp_path=tmp_path)
    assert not doc["failed"] and not doc["skipped"], (doc["failed"], proc.stdout[-2000:])
    assert doc["versions"][peer] == f"{PEERS[peer][1].dist} {VERSIONS[peer]}", doc["versions"]
    cases = cases_of(doc, peer)
    assert len(cases) >= MIN_CASES[peer], sorted(cases)
    for name, case in cases.items():
        info = case["info"]
        assert case["ok"], (name, info["first_divergence"], info["diagnosis"])
        # the dump compared the losses, not only the rollout quantities (a critic's where it has one)
        critic = "old_values" in info["keys"]
        need = {"advantages", "pg_loss"} | ({"returns", "vf_loss"} if critic else set())
        assert need <= set(info["quantities"]), (name, info["quantities"])
        assert case["controls"] and all(c["ok"] for c in case["controls"]), (name, case["controls"])
        if info["v2"] and "grad_logprobs" in info["keys"]:  # dump v2 oracle: the gradients are compared too
            grads = {"grad_logprobs", "grad_values"} if critic else {"grad_logprobs"}
            assert grads <= set(info["quantities"]), info["quantities"]
    corrected = {n: c for n, c in cases.items() if "rollout_logprobs" in c["info"]["keys"]}
    assert len(corrected) == CORRECTED[peer], sorted(corrected)
    for name, case in corrected.items():
        assert "--set rollout_is=token" in case["info"]["command"], (name, case["info"]["command"])
        labels = [c["label"] for c in case["controls"]]
        assert any(lab.startswith("pg_loss") for lab in labels), (name, labels)  # behaviour := proximal
    assert proc.returncode == 0, proc.stdout[-4000:]
