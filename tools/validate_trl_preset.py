#!/usr/bin/env python3
"""Show that ``refppo diff --preset trl`` reproduces TRL's OWN PPOTrainer step. Not part of CI.

Run by hand with the interpreter of a virtual environment holding ``trl==1.12.0`` (set up as in
``benchmarks/bench_trl_ppo.py``)::

    /work/peervenv/trl/bin/python tools/validate_trl_preset.py [--keep DIR]

(the venv is built by ``tools/build_peer_venvs.sh``; ``$REFPPO_PEERS_ROOT`` moves it).

It prints ``SKIPPED: trl not importable`` and exits 0 when ``trl`` cannot be imported.

What runs: TRL 1.12.0's ``trl/experimental/ppo/ppo_trainer.py::PPOTrainer.train`` (the ppov2
lineage; ``trl/trainer/ppo_trainer.py`` before 0.26), unmodified, for ONE PPO iteration on a tiny
offline setup: random-init GPT-2 policy / value / reward models (vocab 64, n_embd 32, 2 layers),
16 prompts of 8 tokens (refppo's words task and tokenizer), 12 new tokens, fp32, CPU,
``num_mini_batches = 1`` and ``gradient_accumulation_steps = 1`` (the minibatch is the whole batch).

How the tensors are captured (no TRL code is copied or restated): with the supported tracer
``refppo.capture.adapters.trl`` (``capture_train_locals`` + ``dump_from_locals``): ``sys.settrace`` on
the frame of ``PPOTrainer.train`` only, copying its locals at the first line of the chosen PPO epoch
(first minibatch, first micro-batch) where ``approxkl`` exists, and keeping the gradients of
``new_logprobs`` / ``vpred`` through ``retain_grad`` (dump v2 ``grad_logprobs`` / ``grad_values``).
TRL shuffles the batch with ``np.random.permutation``; the update tensors are put back into rollout
order.

Dump mapping (refppo ``spec/dump-format.md``):

==================  ==========================================================================
dump key            TRL 1.12.0 local of ``PPOTrainer.train``
==================  ==========================================================================
response_mask       ``~padding_mask`` (``padding_mask = idx > sequence_lengths``)
old_logprobs        ``logprobs`` (rollout; ``INVALID_LOGPROB = 1.0`` on padding, junk to refppo)
ref_logprobs        ``ref_logprobs`` (same sentinel)
old_values          ``values`` (zeroed beyond ``padding_mask_p1``; the score slot is a value position)
scores              ``scores`` (reward model score, ``missing_eos_penalty`` already subtracted)
logprobs / values   ``new_logprobs`` / ``vpred`` of the first minibatch, un-shuffled
kl                  ``kl``
token_rewards       ``rewards`` (score added at ``actual_end``, one slot past the last valid token)
advantages          ``advantages`` (after ``masked_whiten(advantages, ~padding_mask)``)
returns             ``returns``
pg_loss ... loss    ``pg_loss``, ``pg_clipfrac``, ``approxkl`` (-> ``approx_kl``), ``vf_loss``,
                    ``vf_clipfrac``, ``loss``
==================  ==========================================================================

Hyperparameters come from the run's ``PPOConfig`` (``kl_coef``, ``cliprange``, ``cliprange_value``,
``vf_coef``, ``gamma``, ``lam``; ``kl_estimator`` as a convention key). The dump is written with
``refppo.dump.write.write_dump`` and checked with ``refppo diff DUMP --preset trl --json`` (in-process when
refppo imports in this interpreter, else with ``--refppo-python``, default ``.venv/bin/python``).

Cases: ``full`` (no stop token: every row full width, k1, TRL defaults), ``ragged``
(``stop_token="eos"``, EOS made likely, ``missing_eos_penalty = 1``: right-padded rows of different
lengths, some without EOS), ``ragged_k3_epoch2`` (ragged, ``kl_estimator = "k3"``, non-default
γ, λ, β, ε, ε_v, vf_coef, two PPO epochs with a large learning rate, captured in the SECOND epoch so
that the ratio and the value prediction have moved and both clip branches are exercised),
``ragged_whiten_rewards`` (``whiten_rewards=True``: checked with ``--set whiten_rewards=masked_no_shift``).

Exit codes: 0 every case matches (or trl is not importable: SKIPPED), 1 a mismatch.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

B, T, PROMPT_LEN = 16, 12, 8

CASES: dict[str, dict[str, Any]] = {
    "full": {"stop_token": None, "eos_boost": 0.0, "capture_epoch": 0, "config": {}},
    "ragged": {
        "stop_token": "eos",
        "eos_boost": 1.0,
        "capture_epoch": 0,
        "config": {"missing_eos_penalty": 1.0},
    },
    "ragged_k3_epoch2": {
        "stop_token": "eos",
        "eos_boost": 1.0,
        "capture_epoch": 1,
        "config": {
            "missing_eos_penalty": 0.5,
            "kl_estimator": "k3",
            "gamma": 0.99,
            "lam": 0.9,
            "kl_coef": 0.1,
            "cliprange": 0.1,
            "cliprange_value": 0.02,
            "vf_coef": 0.5,
            "num_ppo_epochs": 2,
            "learning_rate": 3e-3,
        },
    },
    "ragged_whiten_rewards": {
        "stop_token": "eos",
        "eos_boost": 1.0,
        "capture_epoch": 0,
        "config": {"missing_eos_penalty": 1.0, "whiten_rewards": True, "gamma": 0.95, "lam": 0.9},
        # PPOConfig.whiten_rewards: masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)
        "set": {"whiten_rewards": "masked_no_shift"},
    },
}


def build_trainer(spec: dict[str, Any]) -> tuple[Any, Any]:
    """TRL's ``PPOTrainer`` (and its ``PPOConfig``) on the tiny offline set-up of case ``spec``."""
    import torch
    from datasets import Dataset  # type: ignore[import-not-found]  # trl venv only
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel
    from trl.experimental.ppo import PPOConfig, PPOTrainer  # type: ignore[import-not-found]  # trl venv only

    from refppo.train.tasks.words import WordsTask, build_tokenizer

    torch.set_num_threads(2)
    tok = build_tokenizer()
    task = WordsTask(prompt_words=(6, 6))
    rng = random.Random(0)
    prompts = [tok(task.prompt(rng), add_special_tokens=False)["input_ids"] for _ in range(B)]
    assert all(len(x) == PROMPT_LEN for x in prompts)
    ds = Dataset.from_dict({"input_ids": prompts})

    def cfg(labels: int | None = None, tied: bool = True) -> Any:
        kw: dict[str, Any] = {"num_labels": labels} if labels else {}
        return GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied,
                          pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, **kw)  # fmt: skip

    torch.manual_seed(0)
    policy = GPT2LMHeadModel(cfg(tied=False))
    with torch.no_grad():
        # Give the random policy a fixed logit offset per token: feature 0 of the final layer norm
        # is the constant 1 (weight 0, bias 1) and column 0 of the (untied) LM head holds the offsets.
        # The pad token is never sampled (a pad at position 0 would leave a row without a valid
        # token) and EOS is made likely when the case wants ragged rows.
        policy.transformer.ln_f.weight[0] = 0.0
        policy.transformer.ln_f.bias[0] = 1.0
        offset = torch.zeros(policy.lm_head.weight.shape[0])
        offset[tok.pad_token_id] = -30.0
        offset[tok.eos_token_id] = float(spec["eos_boost"])
        policy.lm_head.weight[:, 0] = offset
    ref = copy.deepcopy(policy)
    with torch.no_grad():  # a reference policy that differs from the policy, so that KL != 0
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reward = GPT2ForSequenceClassification(cfg(1))
    value = GPT2ForSequenceClassification(cfg(1))
    conf_kw: dict[str, Any] = {
        "per_device_train_batch_size": B, "gradient_accumulation_steps": 1, "num_mini_batches": 1,
        "num_ppo_epochs": 1, "learning_rate": 3e-6, "response_length": T, "temperature": 0.7,
        "total_episodes": B, "missing_eos_penalty": None, "stop_token": spec["stop_token"],
        "local_rollout_forward_batch_size": B, "num_sample_generations": 0, "report_to": "none",
        "use_cpu": True, "bf16": False, "fp16": False, "save_strategy": "no", "logging_steps": 1,
        "seed": 0,
    }  # fmt: skip
    conf_kw.update(spec["config"])
    out = tempfile.mkdtemp(prefix="trl-validate-")
    conf = PPOConfig(output_dir=out, **conf_kw)
    trainer = PPOTrainer(args=conf, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                         train_dataset=ds, value_model=value)  # fmt: skip
    return trainer, conf


def run_trl(case: str, spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Run one TRL PPO iteration; return (dump tensors, hparams, convention) and some facts."""
    from refppo.capture.adapters.trl import capture_train_locals, dump_from_locals, trl_hparams

    trainer, conf = build_trainer(spec)
    c = capture_train_locals(trainer, epoch=int(spec["capture_epoch"]))
    tensors = dump_from_locals(c)
    mask = tensors["response_mask"]
    lengths = mask.sum(1)
    if int(lengths.min()) < 1:
        raise RuntimeError(f"{case}: a row has no valid response token (lengths {lengths.tolist()})")
    hp, convention = trl_hparams(conf)
    convention.pop("whiten_rewards", None)  # checked with the case's --set (the preset outranks the sidecar)
    facts = {
        "response_lengths": lengths.tolist(),
        "rows_without_eos": int((~c["contain_eos_token"]).sum()),
        "scores": [round(float(s), 4) for s in c["scores"]],
        "pg_clipfrac": float(c["pg_clipfrac"]),
        "vf_clipfrac": float(c["vf_clipfrac"]),
        "approxkl": float(c["approxkl"]),
    }
    return tensors, {"hparams": hp, "convention": convention}, facts


def make(out: Path) -> dict[str, Any]:
    """Stage 1 (TRL's interpreter): run every case and write one dump + sidecar per case."""
    status: dict[str, Any] = {}
    for case, spec in CASES.items():
        tensors, side, facts = run_trl(case, spec)
        path = out / f"trl_{case}.safetensors"
        try:
            from refppo.dump.write import write_dump

            write_dump(path, tensors, hparams=side["hparams"], convention=side["convention"])
        except ImportError:  # refppo's extra deps missing here: plain safetensors/.pt + sidecar
            import torch

            path = path.with_suffix(".pt")
            torch.save({k: v.detach().contiguous() for k, v in tensors.items()}, str(path))
            Path(str(path) + ".json").write_text(json.dumps({**side["hparams"], **side["convention"]}))
        status[case] = {
            "dump": str(path),
            "kl_estimator": side["convention"]["kl_estimator"],
            "set": spec.get("set", {}),
            "facts": facts,
        }
    (out / "status.json").write_text(json.dumps(status, indent=2))
    return status


def diff(
    path: str, estimator: str, refppo_python: str, extra: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    """Stage 2: ``refppo diff PATH --preset trl --set kl_estimator=E --json``, in-process if refppo
    imports here. The preset's conventions outrank the sidecar's (``spec/dump-format.md``), so
    TRL's ``kl_estimator`` is passed with ``--set``, as for the other peers."""
    argv = [path, "--preset", "trl", "--set", f"kl_estimator={estimator}", "--json"]
    for k, v in (extra or {}).items():
        argv += ["--set", f"{k}={v}"]
    try:
        import contextlib
        import io

        from refppo.oracle.cli import main as diff_main
    except ImportError:
        proc = subprocess.run(
            [refppo_python, "-m", "refppo", "diff", *argv], capture_output=True, text=True, timeout=300
        )
        return proc.returncode, json.loads(proc.stdout)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = diff_main(argv)
    return rc, json.loads(buf.getvalue())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--keep", metavar="DIR", help="keep the dumps in DIR")
    ap.add_argument(
        "--refppo-python",
        default=str(REPO / ".venv" / "bin" / "python"),
        help="interpreter for `refppo diff` when refppo does not import in this one",
    )
    args = ap.parse_args()
    try:
        import trl  # type: ignore[import-not-found]  # trl venv only
        import trl.experimental.ppo  # type: ignore[import-not-found]  # trl venv only
    except Exception as exc:  # any import failure means: nothing to validate against
        print(f"SKIPPED: trl not importable ({type(exc).__name__}: {exc})")
        return 0
    sys.path.insert(0, str(REPO))
    print(f"TRL {trl.__version__}: trl/experimental/ppo/ppo_trainer.py::PPOTrainer.train")
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep) if args.keep else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        status = make(out)
        for case, st in status.items():
            rc, rep = diff(st["dump"], st["kl_estimator"], args.refppo_python, st.get("set"))
            worst = max((q["max_abs_err"] for q in rep["quantities"].values()), default=0.0)
            verdict = "MATCH" if rc == 0 else f"MISMATCH at {rep['first_divergence']}"
            print(f"trl {case:<22} {verdict}  ({len(rep['quantities'])} quantities, max abs err {worst:.2e})")
            print(f"    {json.dumps(st['facts'])}")
            conv = rep["convention"]
            print(f"    estimator={conv['kl_estimator']} hparams={json.dumps(rep['hparams'])}")
            for q, r in rep["quantities"].items():
                print(f"    {q:<14} max_abs_err={r['max_abs_err']:.3e} tol={r['tol']:.1e} ok={r['ok']}")
            if rc != 0:
                failures += 1
                for d in rep.get("diagnosis", []):
                    print(f"    ! {d}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
