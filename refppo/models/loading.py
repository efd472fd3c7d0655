"""Loading the roles from a local model directory (never from a hub)."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from refppo.models.roles import Critic, RewardModel


def load_actor(path: str | os.PathLike[str]) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path)`` for any local model directory."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def load_reference(path: str | os.PathLike[str]) -> nn.Module:
    """The actor's initial weights from ``path``, frozen (:func:`make_reference`)."""
    ref = load_actor(path)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    out: nn.Module = ref
    return out


def load_critic(path: str | os.PathLike[str], *, seed: int = 0) -> Critic:
    """:meth:`Critic.from_pretrained`."""
    return Critic.from_pretrained(path, seed=seed)


def load_reward_model(path: str | os.PathLike[str]) -> RewardModel:
    """:meth:`RewardModel.from_pretrained`."""
    return RewardModel.from_pretrained(path)
