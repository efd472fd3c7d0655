"""The peers' rejection gates through ``refppo diff`` and ``--detect`` under the keys ``rollout_rs*``
(issue #22 item 2).

Each maker runs the peer's own installed code in its side venv (skipped with the reason without it):

- :mod:`peers.makers.areal_gates`: AReaL 1.0.4 ``ppo_actor_loss_fn`` with ``rejection_sampling``
  metric ``kl_k2`` (token), ``kl_k3`` (sequence, ``agg: max``), ``kl_k1`` (sequence, ``agg: sum``,
  a signed band), ``ratio`` (sequence, ``agg: max``); v2 dumps (``grad_logprobs`` by autograd);
- :mod:`peers.makers.openrlhf_gates`: OpenRLHF 0.11.2 ``PolicyLoss`` with the ``seq`` ratio gate
  (``is_correction_mode: mask``); v1 dumps.

Each dump must match under its preset plus its ``--set`` (max abs error printed and bounded), the
control (one gate key flipped) and the step without the gate must mismatch at ``pg_loss``, and
``--detect`` from the preset must list settings that re-check (the first three), a gated one
(``rollout_rs`` on) except on :data:`NO_GATE_LISTED`, on every v2 dump (:data:`V2_LISTS_NOTHING`
is empty). On ``areal_gates_sequence_ratio_max`` the generating setting itself (the row's
geometric-mean weight, the veto ``max_t π^prox/π^beh ≤ 3``) is among the listed ones, and its solved
threshold is reported as fixed only to an interval, never determined.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from _peers import REPO, TOOLS, require

from refppo.dump.load import Dump, load_dump, validate
from refppo.oracle.check.diagnose import check
from refppo.oracle.detect.detection import detect, setup_from_json

MAKERS: dict[str, tuple[str, str, str, int]] = {
    # unit: (venv, maker module, preset, cases)
    "areal": ("skyrl-areal", "areal_gates", "areal", 4),
    "openrlhf": ("verl-openrlhf", "openrlhf_gates", "openrlhf", 2),
}
V2_LISTS_NOTHING: set[str] = set()
"""v2 dumps on which ``--detect`` lists nothing (the v1 copy is then required to list; asserted
exactly, so a change shows here). Empty since the gates' walk multiplies the row's geometric-mean
weight too (:data:`refppo.oracle.detect.gates.BASE_WEIGHTS`): ``areal_gates_sequence_ratio_max``
(AReaL's sequence-level ratio veto, ``agg: max``, which weights each token by its row's geometric
mean) listed nothing on v2 before, as no walked weight times any gate reproduced its gradient."""
NO_GATE_LISTED: set[str] = set()
"""Dumps on which ``--detect`` lists no gated setting (asserted exactly, so a change shows here).
Empty since the batch's later detect merges: ``openrlhf_gates_seq_mask_0.8_1.25`` (a v1 dump: one
scalar, ``pg_loss``, fixes the policy term) listed only truncation caps solved exactly from
``pg_loss`` when the gate keys landed, and lists a gated setting beside them now."""
MAX_ERR = 1e-5


def _v1(dump: Dump) -> Dump:
    tensors = {k: v for k, v in dump.tensors.items() if not k.startswith("grad_")}
    hp = {k: v for k, v in dump.hparams.items() if k not in ("world_size", "micro_batches")}
    return validate(dump.path, tensors, hparams=hp)


def _made(tmp: Path, unit: str) -> tuple[list[str], str]:
    venv, module, preset, n_cases = MAKERS[unit]
    py = require(venv)
    code = f"import sys, pathlib; from peers.makers.{module} import make; make(pathlib.Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(TOOLS)}
    subprocess.run([str(py), "-c", code, str(tmp)], check=True, cwd=REPO, env=env, timeout=600)
    names = sorted(p.name.removesuffix(".set.json") for p in tmp.glob("*.set.json"))
    assert len(names) == n_cases, names
    return names, preset


def _flat(expected: Any, **upd: Any) -> dict[str, Any]:
    return {**{k: getattr(v, "value", v) for k, v in expected.convention_dict().items()}, **upd}


GATE_KEYS = (
    "rollout_is", "rollout_is_agg", "rollout_is_low", "rollout_is_high", "rollout_rs", "rollout_rs_stat",
    "rollout_rs_order", "rollout_rs_reduce", "rollout_rs_low", "rollout_rs_high",
)  # fmt: skip
"""The keys that fix the ratio veto's weight (an unbounded weight: ``rollout_is_mode`` is unread)."""


def _generating_listed_as_an_interval(dump: Dump, det: Any, conv: dict[str, Any]) -> None:
    """The generating setting (its gate keys, the unread ones at refppo's defaults) is listed, and
    each solved gate threshold is fixed only to an interval (never determined)."""
    from refppo.oracle.detect.evidence import evidence

    want = {k: conv.get(k, "proximal" if k == "rollout_rs_order" else None) for k in GATE_KEYS}
    assert any({k: e.get(k) for k in GATE_KEYS} == want for e in det.detected), want
    reps = [(c.representative, c.differing) for c in det.classes.classes]
    evs = {e.key: e for e in evidence(dump, det.undetermined, det.solved, reps)}
    assert 3.0 in det.solved["rollout_rs_high"], det.solved
    for k in ("rollout_rs_low", "rollout_rs_high"):
        if k in det.solved:
            assert evs[k].interval and not evs[k].determined, evs[k].text()
            assert "fixed only to the interval between two observed statistics" in evs[k].text()


@pytest.mark.parametrize("unit", list(MAKERS))
def test_the_peers_gates_match_their_keys_and_detect_lists_a_gate(
    tmp_path: Path, unit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(TOOLS))
    from peers.checks import dump_file
    from peers.detect import _setups

    names, preset = _made(tmp_path, unit)
    fallbacks, ungated = set(), set()
    for n in names:
        conv = json.loads((tmp_path / f"{n}.set.json").read_text())
        dump = load_dump(dump_file(tmp_path, n))
        expected, base = _setups(dump, preset, conv)
        res = check(dump, expected, explain_divergence=False)
        assert res.match, (n, res.first_divergence)
        assert ("grad_logprobs" in res.quantities) == (unit == "areal"), n
        err = max(q.max_abs_err for q in res.quantities.values())
        print(f"{n}: match, max abs error {err:.2e}")
        assert err < MAX_ERR, (n, err)
        flip = json.loads((tmp_path / f"{n}.control.json").read_text())
        for other in (_flat(expected, **flip), _flat(expected, rollout_rs=None)):
            ctl = check(dump, setup_from_json(expected, other), explain_divergence=False)
            assert not ctl.match and ctl.first_divergence == "pg_loss", (n, other, ctl.first_divergence)
        det = detect(dump, base, limit=100000)
        on = dump
        if not det.detected:
            fallbacks.add(n)
            on = _v1(dump)
            det = detect(on, _setups(on, preset, conv)[1], limit=100000)
        assert det.detected, n
        assert not any(e.get("rollout_rs") is None and e.get("rollout_is") is None for e in det.detected), n
        gated = [e for e in det.detected if e.get("rollout_rs") is not None]
        if not gated:
            ungated.add(n)
        for e in (gated or det.detected)[:3]:
            assert check(on, setup_from_json(base, e), explain_divergence=False).match, (n, e)
        if n == "areal_gates_sequence_ratio_max":
            _generating_listed_as_an_interval(on, det, conv)
    assert fallbacks == {n for n in names if n in V2_LISTS_NOTHING}, fallbacks
    assert ungated == {n for n in names if n in NO_GATE_LISTED}, ungated
