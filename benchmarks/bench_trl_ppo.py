"""TRL's PPOTrainer on the trl-parity setup, for a side-by-side with benchmarks/bench_train.py.

Runs in a SEPARATE virtual environment with ``trl==1.12.0`` (never in refppo's), e.g.::

    python3 -m venv /tmp/trl-venv
    # reuse refppo's CPU torch instead of downloading one (pip then sees torch as installed):
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/trl-venv/lib/python3.11/site-packages/zz.pth
    /tmp/trl-venv/bin/pip install trl==1.12.0        # or: pip install torch==2.13.0 first
    /tmp/trl-venv/bin/python benchmarks/bench_trl_ppo.py --iterations 8 --warmup 2

Setup (= benchmarks/configs/trl-parity.toml): GPT-2 policy, value and reward models, each vocab 512,
n_embd 128, 2 layers, 4 heads, 64 positions, random init; 64 prompts of 8 tokens per iteration
(the same prompts as refppo's, tokenized by the same tokenizer), 32 new tokens, temperature 0.7,
4 PPO epochs × 4 minibatches, AdamW lr 3e-6, fp32, CPU, 2 threads. Time per iteration from
``on_step_end`` callbacks; rollout time by wrapping TRL's ``batch_generation``, scoring time up to
the advantage whitening (wrapped ``masked_whiten``), response tokens counted (first EOS, else full
width, as refppo) in a wrapped ``truncate_response``. ``benchmarks/bench_train.py --trl`` runs this
script and refppo's benchmark alternately, one fresh process each, and prints them side by side.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import trl
    from datasets import Dataset
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    from refppo.train.tasks.words import WordsTask, build_tokenizer

    tok = build_tokenizer()
    n = args.warmup + args.iterations
    task = WordsTask(prompt_words=(6, 6))
    rng = random.Random(0)
    prompts = [tok(task.prompt(rng), add_special_tokens=False)["input_ids"] for _ in range(64 * n)]
    assert all(len(x) == 8 for x in prompts)
    ds = Dataset.from_dict({"input_ids": prompts})

    def cfg(labels: int | None = None) -> GPT2Config:
        kw: dict[str, Any] = {"num_labels": labels} if labels else {}
        return GPT2Config(vocab_size=512, n_embd=128, n_layer=2, n_head=4, n_positions=64,
                          pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, **kw)  # fmt: skip

    torch.manual_seed(0)
    policy = GPT2LMHeadModel(cfg())
    ref = copy.deepcopy(policy)
    reward = GPT2ForSequenceClassification(cfg(1))
    value = GPT2ForSequenceClassification(cfg(1))
    out = tempfile.mkdtemp(prefix="trl-bench-")
    conf = PPOConfig(
        output_dir=out, per_device_train_batch_size=64, gradient_accumulation_steps=1, num_mini_batches=4,
        num_ppo_epochs=4, learning_rate=3e-6, response_length=32, temperature=0.7, total_episodes=64 * n,
        missing_eos_penalty=None, stop_token="eos", local_rollout_forward_batch_size=64,
        num_sample_generations=0, report_to="none", use_cpu=True, bf16=False, fp16=False,
        save_strategy="no", logging_steps=1, seed=0, kl_coef=0.05, cliprange=0.2, vf_coef=0.1,
        cliprange_value=0.2, gamma=1.0, lam=0.95,
    )  # fmt: skip

    marks: list[float] = []
    gen: list[float] = []
    real_gen = trl_ppo.batch_generation

    gen_done: list[float] = []

    def timed_generation(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        r = real_gen(*a, **k)
        gen_done.append(time.perf_counter())
        gen.append(gen_done[-1] - t0)
        return r

    trl_ppo.batch_generation = timed_generation

    # scoring = end of generation -> end of the rollout phase. Its last call is the advantage
    # whitening (``masked_whiten(advantages, ~padding_mask)``; ``whiten_rewards`` is off), right
    # before the PPO epochs; it includes TRL's reward shaping and GAE (refppo's ``scoring`` is the
    # model passes only, ~1 ms more for GAE). update = iteration − rollout − scoring.
    scored: list[float] = []
    real_whiten = trl_ppo.masked_whiten

    def timed_whiten(*a: Any, **k: Any) -> Any:
        r = real_whiten(*a, **k)
        scored.append(time.perf_counter())
        return r

    trl_ppo.masked_whiten = timed_whiten
    tokens: list[tuple[float, float]] = []  # (response tokens, prompt + response tokens) per iteration
    real_truncate = trl_ppo.truncate_response

    def counting_truncate(stop: int, pad: int, responses: Any) -> Any:
        # refppo's rule: a response ends at its first EOS (kept), else at the full width
        eos = responses == stop
        width = torch.full_like(eos[:, 0], responses.shape[1], dtype=torch.long)
        first = torch.where(eos.any(1), eos.int().argmax(1) + 1, width)
        tokens.append((float(first.sum()), float(first.sum()) + 8.0 * responses.shape[0]))
        return real_truncate(stop, pad, responses)

    trl_ppo.truncate_response = counting_truncate

    class Clock(TrainerCallback):  # type: ignore[misc]  # transformers is untyped
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            marks.append(time.perf_counter())

        def on_step_end(self, *a: Any, **k: Any) -> None:
            marks.append(time.perf_counter())

    trainer = PPOTrainer(args=conf, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                         train_dataset=ds, value_model=value, callbacks=[Clock()])  # fmt: skip
    trainer.train()
    its = [b - a for a, b in itertools.pairwise(marks)]
    timed, tgen = its[args.warmup :], gen[args.warmup :]
    tscore = [b - a for a, b in zip(gen_done, scored, strict=True)][args.warmup :]
    ttok = tokens[args.warmup :]
    result = {
        "trl": trl.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "iterations_timed": len(timed),
        "per_iteration_s": its,
        "median_iteration_s": statistics.median(timed),
        "median_rollout_s": statistics.median(tgen),
        "median_score_and_update_s": statistics.median([i - g for i, g in zip(timed, tgen, strict=True)]),
        "median_scoring_s": statistics.median(tscore),
        "median_update_s": statistics.median(
            [i - g - s for i, g, s in zip(timed, tgen, tscore, strict=True)]
        ),
        "response_tokens_per_s": statistics.median([r / i for (r, _), i in zip(ttok, timed, strict=True)]),
        "total_tokens_per_s": statistics.median([a / i for (_, a), i in zip(ttok, timed, strict=True)]),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
