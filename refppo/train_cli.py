"""Old import path of ``refppo train``'s command line: it lives in :mod:`refppo.train.cli`.

``python -m refppo.train_cli`` and ``from refppo.train_cli import main`` keep working.
"""

from __future__ import annotations

from refppo.train.cli import build_parser, main, resolve_config

__all__ = ["build_parser", "main", "resolve_config"]

if __name__ == "__main__":
    raise SystemExit(main())
