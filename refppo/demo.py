"""``refppo demo``: the main job of ``make demo``. Until the trainer lands it runs ``refppo verify``."""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the process exit code."""
    from refppo import verify

    return verify.main(list(argv or []))
