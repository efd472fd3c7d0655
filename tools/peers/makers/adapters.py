"""Dumps built by ``refppo.capture.adapters`` from the peers' OWN containers (``tools/peers adapters``).

Unlike the other makers, these import refppo (the adapters are what is tested): the runner puts the
repository on ``PYTHONPATH``. Each case builds the peer's container by running the peer's code:

- verl 0.9.1 (``verl-openrlhf`` venv): a ``DataProto`` through ``ray_trainer.apply_kl_penalty`` (or,
  without KL in the reward, ``token_level_rewards = token_level_scores`` as ``RayPPOTrainer.fit``
  does) and ``ray_trainer.compute_advantage(GAE)``; then the update through
  ``verl/workers/utils/losses.py::ppo_loss`` and ``value_loss`` with verl's own ``ActorConfig`` /
  ``CriticConfig``, micro-batch by micro-batch with the global batch info the FSDP engine assigns
  (``dp_size``, ``batch_num_tokens``, ``global_batch_size``), the model output in verl's
  no-padding layout, ``backward`` on each micro-batch's loss (the gradient accumulates on the
  ``[B, T]`` leaves, as in ``forward_backward_batch``), metrics merged with ``Metric.append``.
- OpenRLHF 0.11.2 (same venv): an ``Experience`` as ``make_experience`` leaves it (``kl`` from
  ``compute_approx_kl``; ``base_action_log_probs`` dropped unless ``algo.kl.use_loss``), then
  ``RemoteExperienceMaker.compute_advantages_and_returns`` (the real method, on a stand-in ``self``
  holding ``args``/``kl_ctl``), then ``PolicyLoss``/``ValueLoss``/``aggregate_loss`` with
  ``backward``.
- TRL 1.12.0 (``trl`` venv): ``trace_ppo_step`` around one ``PPOTrainer.train`` of
  ``peers.makers.trl_ppo``'s tiny set-up.

Each case also writes a control: the same container with one field corrupted (at one valid
position), adapted again; the runner checks that the control mismatches at that quantity.
``v2=False`` (an oracle without dump v2) leaves out the gradients and the ``separate_critic``
sidecar key (``vf_coef = 0``: the v1 rule for a critic with its own optimizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

V2_KEYS = ("grad_logprobs", "grad_values", "micro_batch", "rank")


def _write(
    out: Path, name: str, tensors: dict[str, Any], hp: dict[str, Any], conv: dict[str, Any], v2: bool
) -> None:
    from refppo.dump.write import write_dump

    hp = dict(hp)
    if not v2:
        tensors = {k: v for k, v in tensors.items() if k not in V2_KEYS}
        for key in ("world_size", "micro_batches"):
            hp.pop(key, None)
        if hp.pop("separate_critic", False):
            hp["vf_coef"] = 0.0
    write_dump(out / f"{name}.safetensors", tensors, hparams=hp)
    (out / f"{name}.set.json").write_text(json.dumps(conv))


def save_case(
    out: Path,
    name: str,
    dump: dict[str, Any],
    controls: list[tuple[dict[str, Any], str]],
    side: tuple[Any, Any],
    v2: bool,
) -> dict[str, Any]:
    """Write the dump ``name`` and its controls ``name.control<i>`` (each: tensors, the quantity
    at which it must first diverge); returns what the runner needs."""
    hp, conv = side
    _write(out, name, dump, hp, conv, v2)
    for i, (control, _) in enumerate(controls):
        _write(out, f"{name}.control{i}", control, hp, conv, v2)
    return {"name": name, "controls": [q for _, q in controls], "keys": sorted(dump)}


def corrupt(t: Any, mask: Any) -> Any:
    """``t`` with 0.5 added at the last valid position of row 0."""
    c = t.detach().clone()
    last = int(mask[0].sum()) - 1
    c[0, last] += 0.5
    return c
