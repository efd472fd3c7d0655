"""The ``refppo`` command: one entry point, one subcommand per job.

=========== =========================================== ===============================
subcommand  what it does                                implemented in
=========== =========================================== ===============================
verify      every vectorized core step vs its naive     :mod:`refppo.verify.cli`
            twin on seeded batches (CPU, and CUDA)
diff        compare a trainer's dumped PPO step with    :mod:`refppo.oracle.cli`
            the reference (also tools/diff_against.py)
train       a PPO training run                          :mod:`refppo.train.cli`
demo        the main job of ``make demo``               :mod:`refppo.train.demo`
=========== =========================================== ===============================
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

_COMMANDS: dict[str, tuple[str, str]] = {
    "verify": ("refppo.verify.cli", "check every vectorized step against its naive twin"),
    "diff": ("refppo.oracle.cli", "diff a dumped PPO step from another trainer against the reference"),
    "train": ("refppo.train.cli", "run PPO training"),
    "demo": ("refppo.train.demo", "the end-to-end demo (what `make demo` runs)"),
}


def _usage() -> str:
    lines = ["usage: refppo <command> [options]   (refppo --version: the installed version)", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in _COMMANDS.items()]
    lines.append("\n`refppo <command> --help` describes each command's options.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to the subcommand's ``main(argv) -> int``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from refppo import __version__

        print(f"refppo {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in _COMMANDS:
        print(f"refppo: unknown command {name!r}; valid commands are {', '.join(_COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(_COMMANDS[name][0])
    entry: Callable[[list[str]], int] = module.main
    return entry(rest)


if __name__ == "__main__":
    raise SystemExit(main())
