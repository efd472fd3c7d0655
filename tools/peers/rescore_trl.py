"""``refppo diff --actor --ref --critic --reward-model`` against TRL's OWN scoring pass.

``tools/peers rescore_trl`` (``tests/peers/test_peer_validation.py``). A ``files`` request of
:mod:`peers.harness` in the TRL side venv (refppo's capture on its path):

1. The peer's half (:func:`make`) runs TRL 1.12.0's ``PPOTrainer.train``
   (``trl/experimental/ppo/ppo_trainer.py``), unmodified, for one PPO iteration on the tiny offline
   set-up of :mod:`peers.makers.trl_ppo`, with the ``sys.settrace`` capture of
   ``refppo.capture.adapters.trl``. At the first line of the first micro-batch (the first line
   where the local ``mb_advantage`` exists: before its forward pass and optimizer step, so every
   model still holds its rollout weights; the adapter's capture point comes after
   ``optimizer.step()``) it also takes the locals ``query_responses`` and ``context_length`` and
   saves, with ``save_pretrained``, the policy (``model.policy``), ``ref_policy``, the value model
   (``model.value_model``, a ``GPT2ForSequenceClassification`` read at every position by TRL's
   ``get_reward``) and ``reward_model``. The dump gets ``input_ids = query_responses`` and
   ``attention_mask`` = (query tokens != pad) followed by the response mask, and the sidecar
   ``temperature`` = ``args.temperature``.
2. refppo's half runs ``refppo diff DUMP --actor --ref --critic --reward-model --json``: TRL's
   rollout ``logprobs`` (from ``generate``'s logits divided by ``temperature + 1e-7``),
   ``ref_logprobs`` (a teacher-forced ``forward`` with the same division), ``values``
   (``get_reward(value_model, ...)`` sliced ``[context_length − 1 : −1]``) and ``scores``
   (``get_reward(reward_model, ...)`` at the last token before the first pad of the truncated
   response) against refppo's re-scores.

Cases: ``full`` (no stop token) and ``ragged`` (stop at EOS, rows of different lengths, no
``missing_eos_penalty`` so that the scores are the reward model's own). Control per case: the
sidecar's temperature replaced by 1 — the actor's log-probs must then be named
``temperature_other_value`` with τ̂ solved back to TRL's temperature.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

from peers.checks import diff
from peers.harness import Case, Control, Report, Unit, parser, root_of, run_venvs, selected, workdir

CASES: dict[str, dict[str, Any]] = {
    "full": {"stop_token": None, "eos_boost": 0.0, "capture_epoch": 0, "config": {}},
    "ragged": {"stop_token": "eos", "eos_boost": 1.0, "capture_epoch": 0, "config": {}},
}
VENVS: dict[str, dict[str, Unit]] = {"trl": {"trl": Unit("trl", "peers.rescore_trl:make")}}
ROLES = ("actor", "ref", "critic", "rm")


def run_case(case: str, spec: dict[str, Any], out: Path) -> Path:
    """One TRL iteration; writes the dump (with the re-scoring keys) and the four checkpoints."""
    import torch

    from peers.makers.trl_ppo import run_trl
    from refppo.capture.adapters import trl as trl_adapter
    from refppo.dump.write import write_dump

    extra: dict[str, Any] = {}
    base = trl_adapter._Tracer

    class Capture(base):  # type: ignore[misc, valid-type]  # the adapter's tracer, extended below
        def local_trace(self, frame: types.FrameType, event: str, arg: Any) -> Any:
            loc = frame.f_locals
            if event == "line" and "models" not in extra and "mb_advantage" in loc:
                # the first micro-batch's first line: before its forward pass and optimizer step
                extra["models"] = True
                extra["query_responses"] = loc["query_responses"].detach().clone()
                extra["context_length"] = int(loc["context_length"])
                extra["temperature"] = float(loc["args"].temperature)
                extra["pad"] = int(loc["processing_class"].pad_token_id)
                models = (
                    loc["model"].policy,
                    loc["ref_policy"],
                    loc["model"].value_model,
                    loc["reward_model"],
                )
                for role, m in zip(ROLES, models, strict=True):
                    m.save_pretrained(out / case / role)
            return base.local_trace(self, frame, event, arg)

    adapter: Any = trl_adapter  # its module attribute is swapped for the run (mypy: a class name)
    adapter._Tracer = Capture  # capture_train_locals builds its tracer from this module name
    try:
        tensors, _side, _facts = run_trl(case, spec)
    finally:
        adapter._Tracer = base
    qr, P = extra["query_responses"], extra["context_length"]
    mask = tensors["response_mask"].bool()
    am = torch.cat([(qr[:, :P] != extra["pad"]).long(), mask.long()], dim=1)
    keep = ("response_mask", "old_logprobs", "ref_logprobs", "old_values", "scores")
    dump = {k: tensors[k] for k in keep}
    dump.update({"input_ids": qr, "attention_mask": am})
    path = out / f"trl_rescore_{case}.safetensors"
    write_dump(path, dump, hparams={"temperature": extra["temperature"]})
    return path


def make(out: Path) -> list[str]:
    """The peer's half: every case's dump and checkpoints under ``out``."""
    return [run_case(case, spec, out).name for case, spec in CASES.items()]


def check(out: Path, dump: str) -> Case:
    """The re-score of one dump (must match) and its temperature control (module docstring)."""
    path, d = out / dump, out / dump.removeprefix("trl_rescore_").removesuffix(".safetensors")
    flags = ("--actor", "--ref", "--critic", "--reward-model")
    models = [a for flag, role in zip(flags, ROLES, strict=True) for a in (flag, str(d / role))]
    r = diff(path, None, {}, models)
    rep = r.report.get("rescore", {})
    errors = {it["role"]: it["max_abs_err"] for it in rep.get("items", [])}
    notes = [f"temperature {rep.get('temperature')}"]
    for it in rep.get("items", []):
        notes.append(
            f"{it['role']:<13}{it['key']:<14} max_abs_err={it['max_abs_err']:.3e} tol={it['tol']:.1e}"
        )
        notes += [f"  ! {e['text']}" for e in it["explained_by"]]
    # control: the sidecar forgets the temperature; the actor's log-probs must then be named as
    # those of another temperature, solved back to TRL's 0.7
    Path(str(path) + ".json").write_text(json.dumps({"temperature": 1.0}))
    c = diff(path, None, {}, ["--actor", str(d / "actor")])
    items = c.report.get("rescore", {}).get("items", [])
    names = [e["name"] for it in items for e in it["explained_by"]]
    caught = c.rc == 1 and names == ["temperature_other_value"]
    note = items[0]["notes"][:1] if items else []
    ctl = Control("sidecar temperature 1", caught, f"exit {c.rc}, named {names}: {note}")
    return Case("trl", dump, r.rc == 0, errors, [ctl], {"temperature": rep.get("temperature")}, notes)


def main(argv: list[str] | None = None) -> int:
    args = parser("rescore_trl", __doc__, list(VENVS)).parse_args(argv)
    report = Report("rescore_trl")
    with workdir(args.keep) as work:
        for _, out, st in run_venvs(report, selected(args, VENVS), root_of(args), work, with_refppo=True):
            for dump in st["result"]:
                report.add(check(out, dump))
    return report.finish(args.json_out)
