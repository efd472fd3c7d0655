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

Mixed staleness (``seam.staleness_min`` = j < k): row b is ``s_b = j + (b mod (k − j + 1))``
iterations old; for each s (largest first) the engine ← the policy s iterations old (snapshot
``k − s``, version ``max(0, it − s)``; the policy itself for s = 0) samples the rows with ``s_b = s``
from the same generator, and the batch is reassembled in row order (``policy_version`` per row).

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
from refppo.train.runtime import DTYPES
from refppo.train.update_config import Behaviour

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
        stale = self.cfg.row_staleness(prompt_ids.shape[0])
        if len(set(stale)) == 1:  # one policy for the whole batch
            src, version = self._policy(actor, stale[0], it)
            batch, lp = self._generate(src, prompt_ids, prompt_mask, rollout_cfg, generator)
            pv = torch.full((batch.batch_size,), version, dtype=torch.long, device=lp.device)
        else:
            batch, lp, pv = self._mixed(actor, stale, prompt_ids, prompt_mask, rollout_cfg, generator, it)
        if self.stale:  # the policy now (version it) joins; the oldest leaves
            oldest = self.stale.pop(0)
            self.versions.pop(0)
            _sync(oldest, actor)
            self.stale.append(oldest)
            self.versions.append(it)
        return batch, Behaviour(lp, pv, it)

    def _policy(self, actor: nn.Module, s: int, it: int) -> tuple[nn.Module, int]:
        """The policy ``s`` iterations old and its version: ``actor`` (version ``it``) for s = 0,
        else snapshot ``k − s`` (version ``max(0, it − s)``)."""
        if s == 0:
            return actor, it
        j = self.cfg.staleness - s
        return self.stale[j], self.versions[j]

    def _generate(
        self,
        src: nn.Module,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        cfg: RolloutConfig,
        gen: torch.Generator,
    ) -> tuple[SequenceBatch, Tensor]:
        """The engine, synced from ``src``, samples ``prompt_ids`` in its own dtype."""
        _sync(self.engine, src)
        with torch.autocast(device_type=prompt_ids.device.type, enabled=False):  # the engine's own dtype
            return generate_rollout_logprobs(
                self.engine, prompt_ids, prompt_mask, cfg, gen, processed=self.cfg.logprobs == "processed"
            )

    def _mixed(
        self,
        actor: nn.Module,
        stale: list[int],
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        cfg: RolloutConfig,
        gen: torch.Generator,
        it: int,
    ) -> tuple[SequenceBatch, Tensor, Tensor]:
        """Mixed staleness: the rows of each staleness ``s`` (oldest policy first) sampled together by
        the policy ``s`` iterations old, from the one generator; the batch reassembled in row order
        (responses are ``max_new_tokens`` wide), ``policy_version`` ``[B]`` per row."""
        B, dev = prompt_ids.shape[0], prompt_ids.device
        ids = torch.full((B, cfg.max_new_tokens), cfg.pad_token_id, dtype=torch.long, device=dev)
        mask = torch.zeros((B, cfg.max_new_tokens), dtype=torch.bool, device=dev)
        lp = torch.zeros((B, cfg.max_new_tokens), device=dev)
        pv = torch.zeros(B, dtype=torch.long, device=dev)
        for s in sorted(set(stale), reverse=True):
            rows = torch.tensor([b for b in range(B) if stale[b] == s], device=dev)
            src, version = self._policy(actor, s, it)
            part, part_lp = self._generate(src, prompt_ids[rows], prompt_mask[rows], cfg, gen)
            ids[rows], mask[rows], lp[rows], pv[rows] = (
                part.response_ids,
                part.response_mask,
                part_lp,
                version,
            )
        return SequenceBatch(prompt_ids, prompt_mask, ids, mask), lp, pv

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


__all__ = ["SNAPSHOT_PREFIX", "RolloutEngine", "sample", "seam_metrics"]
