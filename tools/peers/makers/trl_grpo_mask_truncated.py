"""TRL GRPOTrainer with ``mask_truncated_completions=True`` (``trl-grpo`` venv: TRL 1.16.0).

``python tools/peers/makers/trl_grpo_mask_truncated.py OUT`` (the venv's python, ``PYTHONPATH=tools``)
writes ``OUT/trl_grpo_mask_truncated_<loss_type>.pt`` (+ sidecar, + ``.set.json``) for ``grpo``,
``bnpo``, ``dr_grpo`` and ``dapo``, and ``OUT/trl_grpo_mask_truncated_dapo_rows_dropped.pt``.

What TRL 1.16.0 does (``trl/trainer/grpo_trainer.py``):
``GRPOTrainer._generate_and_score_completions`` flags a completion truncated when its last id is
neither EOS nor padding, and zeroes its ``completion_mask`` (``completion_mask * (~is_truncated)``)
AFTER decoding; the rewards and the group advantages (the block run by
:func:`peers.makers.trl_grpo.trl_advantages`) are computed on every row; ``num_items_in_batch`` is the
zeroed mask's sum. ``GRPOTrainer._compute_loss`` (run unbound by :func:`peers.makers.trl_grpo.trl_loss`)
then aggregates over the zeroed mask: ``grpo`` ``Σ_b (Σ_t m'ℓ / max(Σ_t m', 1)) / B``, ``bnpo``
``Σ m'ℓ / max(Σ m', 1)``, ``dr_grpo`` ``Σ m'ℓ / (B·max_completion_length)``, ``dapo``
``Σ m'ℓ / num_items_in_batch``.

The dump holds the GENERATED tokens in ``response_mask`` (the truncated rows reach the limit ``T``),
``truncated`` [B] (1 on those rows), TRL's advantages on the generated tokens and TRL's loss
(``beta = 0.04``: the ``β·k3`` term included; ``pg_loss`` at ``beta = 0``) and its gradient
``grad_logprobs`` (autograd through ``_compute_loss``: 0 on the truncated rows; v2, one rank). ``.set.json``:
``truncated_rows=mask_in_loss`` and the ``loss_agg`` of the loss type; the controls
(``truncated_rows=keep``, and ``drop`` where ``N_seq`` is read) must not match. The
``_rows_dropped`` dump: the ``dapo`` case with its truncated rows removed (what a trainer that
drops the rows before the advantages would dump): TRL's advantages, computed with those rows in
their groups, do not match. Nothing from refppo is imported.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the package ``peers``

from peers.makers.common import HP, inputs, save
from peers.makers.trl_grpo import EPS_HIGH, T, _advantage_block, trl_advantages, trl_loss

B, N = 12, 4
# loss_type -> (beta, loss_agg, controls that must not match)
CASES: dict[str, tuple[float, str, list[dict[str, Any]]]] = {
    "grpo": (0.04, "seq-mean-token-mean", [{"truncated_rows": "keep"}, {"truncated_rows": "drop"}]),
    "bnpo": (0.0, "token-mean", [{"truncated_rows": "keep"}]),
    "dr_grpo": (0.0, "seq-mean-token-sum-norm", [{"truncated_rows": "keep"}, {"truncated_rows": "drop"}]),
    "dapo": (0.04, "token-mean", [{"truncated_rows": "keep"}]),
}
TRUNCATED_ROWS = (0, 5, 10)
"""Rows that reach the limit without EOS (full length); 5 and 10 are in other groups than 0."""


def _batch(seed: int) -> dict[str, Any]:
    """``inputs`` with rows :data:`TRUNCATED_ROWS` at full length (fresh log-probs there)."""
    import torch

    x = inputs(seed, B=B, T=T, dtype=torch.float64)
    full = inputs(seed + 1, B=B, T=T, dtype=torch.float64)  # row 0 of it is full length
    for r in TRUNCATED_ROWS:
        for k in ("response_mask", "old_logprobs", "ref_logprobs", "logprobs"):
            x[k][r] = full[k][0]
    for k in ("old_values", "values", "entropy"):
        x.pop(k)
    x["scores"] = x["scores"] / 4.0
    x["group_index"] = torch.arange(B, dtype=torch.int64) // N
    trunc = torch.zeros(B, dtype=torch.bool)
    trunc[list(TRUNCATED_ROWS)] = True
    x["truncated"] = trunc
    return x


def make(out: Path) -> list[str]:
    import torch

    from peers.stubs import StubFinder

    sys.meta_path.insert(0, StubFinder(("requests", "urllib3")))  # TRL's vLLM client only
    from trl import GRPOConfig  # type: ignore[import-not-found]  # trl venv only
    from trl.trainer import grpo_trainer  # type: ignore[import-not-found]  # trl venv only

    cls = grpo_trainer.GRPOTrainer
    code = _advantage_block(cls)
    made = []
    for i, (loss_type, (beta, agg, controls)) in enumerate(CASES.items()):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = GRPOConfig(
                output_dir=tmp, scale_rewards="group", loss_type=loss_type, beta=beta, epsilon_high=EPS_HIGH,
                num_generations=N, per_device_train_batch_size=B, report_to=[], use_cpu=True,
                mask_truncated_completions=True,
            )  # fmt: skip
        x = _batch(940 + i)
        m = x["response_mask"]
        adv = trl_advantages(grpo_trainer, code, x["scores"], cfg.scale_rewards, N)  # every row
        masked = dict(x, response_mask=m * (~x["truncated"]).unsqueeze(1).to(m.dtype))  # TRL's zeroing
        leaf = x["logprobs"].clone().requires_grad_(True)
        loss, _ = trl_loss(cls, masked, adv, cfg.loss_type, cfg.beta, leaf=leaf)
        (g_lp,) = torch.autograd.grad(loss, (leaf,))
        loss = loss.detach()
        dump: dict[str, Any] = dict(x)
        dump.update(
            advantages=torch.where(m.bool(), adv.unsqueeze(1) * m, 0.0 * m), loss=loss,
            grad_logprobs=torch.where(m.bool(), g_lp, 0.0),
        )  # fmt: skip
        if beta == 0.0:
            dump["pg_loss"] = loss.clone()
        hp = dict(HP, gamma=1.0, lam=1.0, kl_coef=beta, cliprange=cfg.epsilon, cliprange_high=EPS_HIGH)
        hp.update(world_size=1, micro_batches=1)
        if loss_type == "dr_grpo":
            hp["horizon"] = float(T)  # max_completion_length
        sets = {"advantage": "grpo", "loss_agg": agg, "truncated_rows": "mask_in_loss"}
        made.append(save(out, f"trl_grpo_mask_truncated_{loss_type}", dump, hp, sets, controls[0]))
        if loss_type == "dapo":  # the truncated rows removed from the dump (not from TRL's groups)
            keep = ~x["truncated"]
            dropped = {k: v[keep] for k, v in dump.items() if v.dim() >= 1}
            dropped["loss"] = dump["loss"]
            made.append(
                save(
                    out,
                    "trl_grpo_mask_truncated_dapo_rows_dropped",
                    dropped,
                    hp,
                    {**sets, "truncated_rows": "keep"},
                )
            )
    return made


if __name__ == "__main__":
    print(make(Path(sys.argv[1])))
