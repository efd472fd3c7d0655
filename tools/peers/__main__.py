"""``python tools/peers VALIDATOR [options]`` (refppo's interpreter) and
``python tools/peers --peer-side OUT`` (a side venv's interpreter; :mod:`peers.peer_side`)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOLS, REPO = HERE.parent, HERE.parent.parent
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    del sys.path[0]  # run as a folder: import it as the package ``peers`` of tools/, not its modules
sys.path.insert(0, str(TOOLS))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--peer-side"] and len(argv) == 2:
        from peers.peer_side import main as peer_main

        return peer_main(Path(argv[1]))
    sys.path.insert(1, str(REPO))  # refppo's side: this checkout's refppo
    from peers import VALIDATORS

    if not argv or argv[0] not in VALIDATORS:
        names = ", ".join(VALIDATORS)
        print(f"usage: tools/peers VALIDATOR [options]; VALIDATOR is one of {names}", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(VALIDATORS[argv[0]])
    rc: int = module.main(argv[1:])
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
