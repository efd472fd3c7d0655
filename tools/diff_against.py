#!/usr/bin/env python3
"""Compare one dumped PPO step from another trainer with the refppo reference.

Usage:
    python tools/diff_against.py DUMP [--hparams FILE] [--preset NAME] [--set KEY=VALUE ...]
                                      [--detect] [--json]

A thin wrapper around :func:`refppo.oracle.cli.main` (also installed as ``refppo diff``).
The dump format is spec/dump-format.md; exit codes: 0 match, 1 mismatch, 2 bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from refppo.oracle.cli import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
