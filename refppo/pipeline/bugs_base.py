"""The :class:`Bug` record of :mod:`refppo.pipeline.bugs` (a known bug as a variant of the stage
table: the stage functions it replaces, the inputs it swaps, what it needs to run), shared by the
catalogue's modules (:mod:`refppo.pipeline.bugs`, :mod:`refppo.pipeline.bugs_rollout`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from refppo.conventions import AdvantageEstimator
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.stages import StageFn


@dataclass(frozen=True)
class Bug:
    """One known bug: its text, the stage functions it replaces and the inputs it swaps."""

    name: str
    text: str
    """What the bug does (one sentence, the diagnosis prints it)."""
    stages: Mapping[str, StageFn] = field(default_factory=dict)
    """Stage name → the function that replaces the stage's own."""
    inputs: Mapping[str, str] = field(default_factory=dict)
    """Quantity → the quantity read in its place, in :attr:`phase`."""
    phase: str = "rollout"
    """Where :attr:`inputs` are swapped (``rollout`` or ``update``)."""
    needs: tuple[str, ...] = ()
    """The dump keys it reads beyond the inputs every dump holds."""
    gae: bool = False
    """Needs ``advantage=gae``."""
    requires: Callable[[Convention, Hyperparams], str | None] | None = None
    """A refusal (one line) for a convention it cannot run under, else None."""

    def check(self, present: Collection[str], conv: Convention, hp: Hyperparams) -> None:
        """``ValueError`` when the inputs ``present`` or ``conv``/``hp`` cannot run this bug."""
        missing = [k for k in self.needs if k not in present]
        if missing:
            raise ValueError(f"the bug {self.name} needs {' and '.join(missing)}")
        if self.gae and conv.adv.estimator is not AdvantageEstimator.GAE:
            raise ValueError(f"the bug {self.name} needs GAE (advantage=gae)")
        why = self.requires(conv, hp) if self.requires is not None else None
        if why is not None:
            raise ValueError(f"the bug {self.name} needs {why}")

    def swap(self, q: Mapping[str, Any], phase: str) -> dict[str, Any]:
        """``q`` with this bug's :attr:`inputs` swapped in when ``phase`` is its own."""
        out = dict(q)
        if phase == self.phase:
            out.update({k: q[v] for k, v in self.inputs.items()})
        return out


__all__ = ["Bug"]
