#!/usr/bin/env python3
"""Show that ``refppo diff --actor --ref --critic --reward-model`` reproduces TRL's OWN scoring pass.

Not part of CI. Run by hand with the interpreter of the TRL side venv (``tools/build_peer_venvs.sh``)::

    /work/peervenv/trl/bin/python tools/validate_rescore_trl.py [--keep DIR]

It prints ``SKIPPED: trl not importable`` and exits 0 when ``trl`` cannot be imported.

What runs: TRL 1.12.0's ``PPOTrainer.train`` (``trl/experimental/ppo/ppo_trainer.py``), unmodified,
for one PPO iteration on the tiny offline setup of ``tools/validate_trl_preset.py`` (whose run is
reused, with the ``sys.settrace`` capture of ``refppo.capture.adapters.trl``). At the first line
of the first micro-batch (the first line where the local ``mb_advantage`` exists: before its
forward pass and optimizer step, so every model still holds its rollout weights; the adapter's
capture point comes after ``optimizer.step()``) this script also takes the locals
``query_responses`` and ``context_length`` and saves, with ``save_pretrained``, the policy
(``model.policy``), ``ref_policy``, the value model (``model.value_model``, a
``GPT2ForSequenceClassification`` read at every position by TRL's ``get_reward``) and
``reward_model``. The dump gets ``input_ids = query_responses`` and ``attention_mask`` = (query
tokens != pad) followed by the response mask, and the sidecar ``temperature`` = ``args.temperature``.

What is compared (``refppo diff DUMP --actor --ref --critic --reward-model --json``): TRL's rollout
``logprobs`` (from ``generate``'s logits divided by ``temperature + 1e-7``), ``ref_logprobs``
(a teacher-forced ``forward`` with the same division), ``values`` (``get_reward(value_model, ...)``
sliced ``[context_length − 1 : −1]``) and ``scores`` (``get_reward(reward_model, ...)`` at the last
token before the first pad of the truncated response) against refppo's re-scores.
Cases: ``full`` (no stop token) and ``ragged`` (stop at EOS, rows of different lengths, no
``missing_eos_penalty`` so that the scores are the reward model's own).

Control per case: the sidecar's temperature replaced by 1 — the actor's log-probs must then be
named ``temperature_other_value`` with τ̂ solved back to TRL's temperature.

Exit codes: 0 every case re-scores within tolerance and every control is named (or trl is not
importable), 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CASES: dict[str, dict[str, Any]] = {
    "full": {"stop_token": None, "eos_boost": 0.0, "capture_epoch": 0, "config": {}},
    "ragged": {"stop_token": "eos", "eos_boost": 1.0, "capture_epoch": 0, "config": {}},
}


def _load_preset_tool() -> Any:
    spec = importlib.util.spec_from_file_location(
        "validate_trl_preset", REPO / "tools" / "validate_trl_preset.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_case(tool: Any, case: str, spec: dict[str, Any], out: Path) -> Path:
    """One TRL iteration; writes the dump (with the re-scoring keys) and the four checkpoints."""
    import torch

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
                for name, m in (
                    ("actor", loc["model"].policy),
                    ("ref", loc["ref_policy"]),
                    ("critic", loc["model"].value_model),
                    ("rm", loc["reward_model"]),
                ):
                    m.save_pretrained(out / case / name)
            return base.local_trace(self, frame, event, arg)

    adapter: Any = trl_adapter  # its module attribute is swapped for the run (mypy: a class name)
    adapter._Tracer = Capture  # capture_train_locals builds its tracer from this module name
    try:
        tensors, _side, _facts = tool.run_trl(case, spec)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--keep", metavar="DIR", help="keep the dumps and checkpoints in DIR")
    args = ap.parse_args()
    try:
        import trl  # type: ignore[import-not-found]  # trl venv only
        import trl.experimental.ppo  # type: ignore[import-not-found]  # trl venv only
    except Exception as exc:  # any import failure means: nothing to validate against
        print(f"SKIPPED: trl not importable ({type(exc).__name__}: {exc})")
        return 0
    sys.path.insert(0, str(REPO))
    from refppo.oracle.cli import main as diff_main

    tool = _load_preset_tool()
    print(f"TRL {trl.__version__}: PPOTrainer.train rollout scoring vs refppo's re-score")
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep) if args.keep else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for case, spec in CASES.items():
            path = run_case(tool, case, spec, out)
            d = out / case
            argv = [str(path), "--json", "--actor", str(d / "actor"), "--ref", str(d / "ref")]
            argv += ["--critic", str(d / "critic"), "--reward-model", str(d / "rm")]
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc = diff_main(argv)
            rep = json.loads(buf.getvalue())["rescore"]
            print(f"trl {case:<8} {'MATCH' if rc == 0 else 'MISMATCH'}  (temperature {rep['temperature']})")
            for it in rep["items"]:
                print(
                    f"    {it['role']:<13}{it['key']:<14} max_abs_err={it['max_abs_err']:.3e} "
                    f"tol={it['tol']:.1e} ok={it['ok']}"
                )
                for e in it["explained_by"]:
                    print(f"      ! {e['text']}")
            failures += rc != 0
            # control: the sidecar forgets the temperature; the actor's log-probs must then be
            # named as those of another temperature, solved back to TRL's 0.7
            Path(str(path) + ".json").write_text(json.dumps({"temperature": 1.0}))
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc_c = diff_main([str(path), "--json", "--actor", str(d / "actor")])
            (it,) = json.loads(buf.getvalue())["rescore"]["items"]
            names = [e["name"] for e in it["explained_by"]]
            ok_c = rc_c == 1 and names == ["temperature_other_value"]
            print(f"    control (sidecar temperature 1): exit {rc_c}, named {names}: {it['notes'][:1]}")
            failures += not ok_c
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
