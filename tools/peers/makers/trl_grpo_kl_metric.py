"""TRL GRPOTrainer's logged ``kl`` next to the KL term of its loss (``trl-grpo`` venv: TRL 1.16.0).

``python tools/peers/makers/trl_grpo_kl_metric.py OUT`` (the venv's python, ``PYTHONPATH=tools``)
writes ``OUT/trl_grpo_kl_metric.pt`` and its sidecar. TRL's own
``trl/trainer/grpo_trainer.py::GRPOTrainer._compute_loss`` (on the stand-in ``self`` of
:func:`peers.makers.trl_grpo.trl_loss`), ``loss_type="grpo"``, ``beta = 0.04``, on ragged float64
rows: it adds ``beta·per_token_kl`` (k3) to each token's loss before the per-sequence mean, and logs
``self._metrics["train"]["kl"]`` = ``global_masked_mean(per_token_kl)``, a token mean. The dump's
``loss`` is the loss, its ``kl_loss`` the logged ``kl``; the advantages are TRL's own
(``scale_rewards="group"``, :func:`peers.makers.trl_grpo.trl_advantages`). Nothing from refppo is
imported.
"""

from __future__ import annotations

import collections
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the package ``peers``

from peers.makers.common import HP, inputs, save
from peers.makers.trl_grpo import EPS_HIGH, _advantage_block, trl_advantages, trl_loss

B, T, N, BETA, SEED = 12, 10, 4, 0.04, 931
SETS = {"advantage": "grpo", "loss_agg": "seq-mean-token-mean", "kl_metric_agg": "token-mean"}
CONTROL = {"kl_metric_agg": "none"}
"""Without the logged metric's own aggregation the dump's ``kl_loss`` must not match."""


def make(out: Path) -> list[str]:
    """The one dump of the module docstring."""
    import torch

    from peers.stubs import StubFinder

    sys.meta_path.insert(0, StubFinder(("requests", "urllib3")))  # TRL's vLLM client only
    from trl import GRPOConfig  # type: ignore[import-not-found]  # trl venv only
    from trl.trainer import grpo_trainer  # type: ignore[import-not-found]  # trl venv only

    x = inputs(SEED, B=B, T=T, dtype=torch.float64)
    for k in ("old_values", "values", "entropy"):
        x.pop(k)
    x["scores"] = x["scores"] / 4.0
    x["group_index"] = torch.arange(B, dtype=torch.int64) // N
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(
            output_dir=tmp, scale_rewards="group", loss_type="grpo", beta=BETA, epsilon_high=EPS_HIGH,
            num_generations=N, per_device_train_batch_size=B, report_to=[], use_cpu=True,
        )  # fmt: skip
    cls = grpo_trainer.GRPOTrainer
    adv = trl_advantages(grpo_trainer, _advantage_block(cls), x["scores"], cfg.scale_rewards, N)
    metrics: dict[str, Any] = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    loss = trl_loss(cls, x, adv, cfg.loss_type, cfg.beta, metrics)
    m = x["response_mask"]
    dump: dict[str, Any] = dict(x)
    dump.update(
        advantages=torch.where(m.bool(), adv.unsqueeze(1) * m, 0.0 * m),
        loss=loss,
        kl_loss=torch.tensor(metrics["train"]["kl"][-1], dtype=torch.float64),
    )
    hp = dict(HP, gamma=1.0, lam=1.0, kl_coef=BETA, cliprange=cfg.epsilon, cliprange_high=EPS_HIGH)
    return [save(out, "trl_grpo_kl_metric", dump, hp, SETS, CONTROL)]


if __name__ == "__main__":
    print(make(Path(sys.argv[1])))
