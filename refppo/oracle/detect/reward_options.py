"""The reward step's options, made cheaply: raw rewards shared by their whitening options, the
whitenings' batch moments computed once per raw reward, the value mask digested once.

One raw reward (the score_map and rewards stages of one ``(kl_in, score_at, score map, score clip,
score_slot_kl)``) is whitened by every reward-whitening option (``whiten_rewards`` × its variance ×
where its eps sits): :class:`RawRewards` makes the raw rewards once, on the first option read, and
evaluates each whitening through the reward_whitening stage within
:func:`refppo.core.moments_memo.remembered_moments` (a memo the raw rewards own): the stage's
``(μ, σ²)`` and ``Σ m·x²/D`` of that one tensor are computed once per variance, not once per
option; every other operation of the stage runs as before, so the outputs are the stage's, bit for
bit. The option's digest (:func:`reward_key`) reads the value mask's digest from
:func:`shared_digest` (one value mask per score slot for the whole walk): equal keys still mean
bit-identical rewards and masks. ``tests/oracle/detect/test_oracle_detect_moments.py``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor

from refppo.conventions import KLPlacement, ScorePosition, ScoreSlotKL
from refppo.core.moments_memo import Memo, remembered_moments
from refppo.oracle.detect.search import Search
from refppo.oracle.detect.states import KLState, RewardState, digest

MEMO = True
"""Whether the whitening options of one raw reward share its batch moments (False: each option
computes them, as before; the tests compare the two walks' reports)."""

_SHARED: dict[int, tuple[weakref.ref[Tensor], int, bytes]] = {}


def shared_digest(x: Tensor) -> bytes:
    """:func:`~refppo.oracle.detect.states.digest` of ``x``, computed once per tensor object (and
    in-place version): for a tensor the walk shares, such as a value mask."""
    hit = _SHARED.get(id(x))
    if hit is not None and hit[0]() is x and hit[1] == x._version:
        return hit[2]
    for k in [k for k, (ref, _, _) in _SHARED.items() if ref() is None]:
        del _SHARED[k]  # the dead tensors' entries (their ids may be reused)
    out = digest(x)
    _SHARED[id(x)] = (weakref.ref(x), x._version, out)
    return out


class RawRewards:
    """The score_map and rewards stages of one reward option (before the reward whitening), made on
    the first :meth:`whitened` state read and shared by the whitening options after it."""

    def __init__(
        self,
        s: Search,
        kl: KLState,
        kl_in: KLPlacement,
        score_at: ScorePosition,
        smap: tuple[float, float, float | None],
        slot: ScoreSlotKL,
    ) -> None:
        self.s, self.kl, self.kl_in, self.score_at, self.smap, self.slot = s, kl, kl_in, score_at, smap, slot
        self.made: tuple[Tensor, Tensor, Tensor] | None = None
        self.memo: Memo = {}
        """The batch moments of the raw rewards (:mod:`refppo.core.moments_memo`)."""

    def get(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(value mask, mapped scores, token_rewards_raw)``."""
        if self.made is None:
            s, kl, t = self.s, self.kl, self.s.t
            vm = s.value_mask(self.score_at)
            bias, scale, sc = self.smap
            smap: dict[str, Any] = {"score_bias": bias, "score_scale": scale, "score_clip": sc}
            scores = s.evaluate("score_map", {"scores": t["scores"]}, s.setting(**smap))["mapped_scores"]
            q = {"mapped_scores": scores, "kl": kl.kl, "mask": s.m, "value_mask": vm,
                 "old_logprobs": t["old_logprobs"], "ref_logprobs": t.get("ref_logprobs")}  # fmt: skip
            rew: dict[str, Any] = {"kl_in": self.kl_in.value, "score_at": self.score_at.value}
            if self.slot is ScoreSlotKL.KL:  # the slot's KL by the group's KL keys
                rew.update(score_slot_kl=self.slot.value, **kl.setting)
            raw = s.evaluate("rewards", q, s.setting(stage="rewards", **rew))["token_rewards_raw"]
            self.made = (vm, scores, raw)
        return self.made

    def whitened(self, wr: str, var: str, eps_at: str) -> Callable[[], RewardState]:
        """The option's state under reward whitening ``wr`` (``var``, ``eps_at``: read when on)."""

        def make() -> RewardState:
            vm, scores, raw = self.get()
            wkeys: dict[str, Any] = {"whiten_rewards": wr}
            fixed = None
            if wr != "none":  # the advantage whitening shares the two keys
                wkeys.update(whiten_variance=var, whiten_eps_at=eps_at)
                fixed = (var, eps_at)
            # each stage alone reads these keys: its setting holds no other group's (a checked
            # group_kl=to_go refuses a reward whitening only as a whole convention)
            st_w = self.s.setting(stage="reward_whitening", **wkeys)
            qw = {"token_rewards_raw": raw, "value_mask": vm}
            with remembered_moments(self.memo if MEMO else {}):
                r = self.s.evaluate("reward_whitening", qw, st_w)["token_rewards"]
            return RewardState(self.kl, self.kl_in, vm, scores, r, fixed)

        return make


def reward_key(st: RewardState) -> bytes:
    """The reward option's digest (the rewards' and the value mask's through :func:`shared_digest`:
    whitening options with one output tensor digest it once)."""
    return digest(st.kl.key, shared_digest(st.rewards), shared_digest(st.vm), st.kl_in.value, st.fixed_whiten)


__all__ = ["MEMO", "RawRewards", "reward_key", "shared_digest"]
