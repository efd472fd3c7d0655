"""The seam mode (``[seam]``, :class:`refppo.train.config.seam.SeamConfig`): the rollout made by an
engine that is not the trainer, as in every trainer that samples with vLLM or SGLang.

:class:`RolloutEngine` holds

* ``engine``: a copy of the policy with its own weights in ``seam.dtype`` (the inference engine);
  before each rollout its weights are loaded (cast) from the policy ``seam.staleness`` = k
  iterations old, as an asynchronous trainer's weight sync;
* ``stale``: the k policy snapshots of the last k iterations (versions ``it − k … it − 1``, the
  initial policy, version 0, standing in for those before the run), kept in the training dtype
  and saved in every checkpoint (:func:`refppo.train.checkpointing.models`, atomically with it).

Per iteration ``it`` (0-based; the policy before its update is version ``it``)::

    v = versions[0] if k else it              the rollout policy: max(0, it − k)
    engine ← snapshot v (cast to seam.dtype)
    batch, l^beh = generate_rollout_logprobs(engine, …)     (raw or processed: seam.logprobs)
    k > 0: drop the oldest snapshot, append the policy now (version it)

The trainer then scores the batch with its own policy (``old_logprobs``: the proximal policy, in
``model.dtype``), and the update reads ``rollout_logprobs = l^beh`` through
:func:`refppo.pipeline.step.update_quantities` (the ``rollout_correction`` stage under
``ppo.rollout_is*``): no correction formula lives here. :func:`seam_metrics` logs the gap.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from refppo.core.masked import masked_mean
from refppo.models.batch import SequenceBatch
from refppo.models.rollout import RolloutConfig, generate_rollout, generate_rollout_logprobs
from refppo.train.config.seam import SeamConfig
from refppo.train.update_config import Behaviour

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
"""``seam.dtype`` → torch dtype."""
SNAPSHOT_PREFIX = "seam_stale_"
"""Checkpoint name of snapshot ``j`` (oldest first): ``seam_stale_<j>.safetensors``."""


def _frozen_copy(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    out = copy.deepcopy(model)
    if dtype is not None:
        out.to(dtype)
    out.requires_grad_(False)
    out.eval()
    return out


def _sync(dst: nn.Module, src: nn.Module) -> None:
    """``dst``'s weights ← ``src``'s (cast to ``dst``'s dtype): a weight sync."""
    with torch.no_grad():
        dst.load_state_dict(src.state_dict())


class RolloutEngine:
    """The seam mode's rollout (module docstring) for the policy ``actor`` (unwrapped, not DDP)."""

    def __init__(self, cfg: SeamConfig, actor: nn.Module) -> None:
        self.cfg = cfg
        self.engine = _frozen_copy(actor, DTYPES[cfg.dtype])
        self.stale: list[nn.Module] = [_frozen_copy(actor) for _ in range(cfg.staleness)]
        self.versions: list[int] = [0] * cfg.staleness
        """The iteration (policy version) of each snapshot in ``stale``, oldest first."""

    def snapshots(self) -> dict[str, nn.Module]:
        """The checkpointed snapshots, by name (oldest first)."""
        return {f"{SNAPSHOT_PREFIX}{j}": m for j, m in enumerate(self.stale)}

    def rollout(
        self,
        actor: nn.Module,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        rollout_cfg: RolloutConfig,
        generator: torch.Generator,
        it: int,
    ) -> tuple[SequenceBatch, Behaviour]:
        """Iteration ``it``'s rollout by the engine (module docstring): the batch and its behaviour
        (``rollout_logprobs`` float32, ``policy_version`` ``[B]`` = the sampling policy's version)."""
        src, version = (self.stale[0], self.versions[0]) if self.stale else (actor, it)
        _sync(self.engine, src)
        with torch.autocast(device_type=prompt_ids.device.type, enabled=False):  # the engine's own dtype
            batch, lp = generate_rollout_logprobs(
                self.engine, prompt_ids, prompt_mask, rollout_cfg, generator,
                processed=self.cfg.logprobs == "processed",
            )  # fmt: skip
        if self.stale:  # the policy now (version it) joins; the oldest leaves
            oldest = self.stale.pop(0)
            self.versions.pop(0)
            _sync(oldest, actor)
            self.stale.append(oldest)
            self.versions.append(it)
        pv = torch.full((batch.batch_size,), version, dtype=torch.long, device=lp.device)
        return batch, Behaviour(lp, pv, it)

    def state_dict(self) -> dict[str, list[int]]:
        """What a checkpoint's ``state.json`` keeps besides the snapshots' weights."""
        return {"versions": list(self.versions)}

    def load_state_dict(self, state: dict[str, list[int]]) -> None:
        """``ValueError`` (one line) unless ``versions`` is a list of integers ≥ 0, oldest first, one
        per snapshot."""
        raw = state["versions"]
        ok = isinstance(raw, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in raw)
        if not ok or any(v < 0 for v in raw) or raw != sorted(raw):
            raise ValueError(f"'versions' must be a non-decreasing list of integers >= 0, got {raw!r}")
        versions = list(raw)
        if len(versions) != len(self.stale):
            raise ValueError(f"{len(versions)} snapshot versions for seam.staleness={len(self.stale)}")
        self.versions = versions


def sample(
    engine: RolloutEngine | None,
    actor: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    rollout_cfg: RolloutConfig,
    generator: torch.Generator,
    it: int,
) -> tuple[SequenceBatch, Behaviour | None]:
    """The trainer's skeleton step 2: the policy ``actor`` samples
    (:func:`refppo.models.rollout.generate_rollout`, no behaviour), or in the seam mode the rollout
    ``engine`` (:meth:`RolloutEngine.rollout`)."""
    if engine is not None:
        return engine.rollout(actor, prompt_ids, prompt_mask, rollout_cfg, generator, it)
    return generate_rollout(actor, prompt_ids, prompt_mask, rollout_cfg, generator), None


def seam_metrics(old_logprobs: Tensor, b: Behaviour, mask: Tensor) -> dict[str, float]:
    """Scalars of the seam over the valid tokens (``mask``), ``d = l^prox − l^beh``:
    ``seam_staleness`` = ``b.version`` − the rows' mean ``policy_version``; ``seam_kl`` = mean(−d),
    the k1 estimate of KL(π^beh‖π^prox) on tokens sampled from π^beh; ``seam_abs_log_ratio`` =
    mean |d|."""
    d = old_logprobs.double() - b.rollout_logprobs.double()
    return {
        "seam_staleness": float(b.version - b.policy_version.double().mean()),
        "seam_kl": float(masked_mean(-d, mask)),
        "seam_abs_log_ratio": float(masked_mean(d.abs(), mask)),
    }


__all__ = ["DTYPES", "SNAPSHOT_PREFIX", "RolloutEngine", "sample", "seam_metrics"]
