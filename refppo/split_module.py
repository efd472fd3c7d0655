"""One namespace for a module whose code moved into smaller modules (``refppo.pipeline``,
``refppo.ppo``): the old module re-exports every name, and an assignment to one of its names
(``monkeypatch.setattr(refppo.pipeline, "ROW_BLOCK_ELEMENTS", 24)``, a test's spy on
``refppo.pipeline.gae``) is also made in each part that holds that name, where the moved functions
look it up at call time. Without it such a patch would change the re-exported copy only and be
silently lost (the moved functions read their own module's globals).

Reading is plain attribute access (the re-exports are the parts' very objects); a name no part
holds is set on the old module alone, as before the split.
"""

from __future__ import annotations

import sys
import types


class SplitModule(types.ModuleType):
    """A module type whose ``__setattr__`` forwards to its parts (``_split_parts``) holding the name."""

    def __setattr__(self, name: str, value: object) -> None:
        parts: tuple[types.ModuleType, ...] = self.__dict__.get("_split_parts", ())
        for part in parts:
            if name in vars(part):
                setattr(part, name, value)
        super().__setattr__(name, value)


def forward_assignments(name: str, *parts: types.ModuleType) -> None:
    """Make module ``name`` (already in ``sys.modules``: call it from its own body) a
    :class:`SplitModule` over ``parts``: ``setattr(module, n, v)`` also sets ``n`` in each part
    whose namespace holds ``n``."""
    module = sys.modules[name]
    module.__class__ = SplitModule
    object.__setattr__(module, "_split_parts", parts)
