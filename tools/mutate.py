"""A small ``ast`` mutation tester for the vectorized functions of ``refppo/core`` and ``refppo/pipeline``.

Usage (from the repository root)::

    nice -n 5 .venv/bin/python tools/mutate.py                     # every module, report to stdout
    .venv/bin/python tools/mutate.py --list --module kl            # list kl.py's mutants, run nothing
    .venv/bin/python tools/mutate.py --module rollout --module kl --json out.json
    .venv/bin/python tools/mutate.py --module policy --only 12 --only 40 --show   # rerun two, show output

Scope: in ``refppo/core/*.py`` every function whose name does not end in ``_naive`` (the naive twins
and their helper ``logprobs._log_sum_exp`` are skipped), *including* the validation-only helpers
(``kl.check_kl_clamps``, ``masked._check_dim``, ``logprobs._prepare``) and ``grad.py``'s per-token
helpers (``_pg_token``, ``_vf_token``, ``_kl_token``: the closed-form gradient twin's formulas;
``group_naive.py`` holds only naive twins and is not listed) and ``_ties.py`` (``shares``, ``inside``,
``clamp``: the tie rules those helpers call, run against their own and grad's and gspo's tests); in
``refppo/pipeline/``'s modules (``rollout``, ``update``, ``blocks``, ``stages``, ``step``,
``groups``) the functions of :data:`mutate_scope.PIPELINE_FUNCS` (every stage function, the walk,
the stage table's key functions, the entry points ``rollout_quantities``/``update_quantities``);
in ``refppo/pipeline/settings.py`` and ``groups.py`` the ``__post_init__`` checks of
``Convention``, ``Hyperparams`` and the groups and their fields' numeric defaults (not the dict
(de)serialisation or ``stats``). The
numeric/bool default values of the in-scope functions' arguments are mutated too
(``unbiased=True``, ``vf_coef=0.0``, ...). Statements
inside ``raise`` (error-message formatting) and docstrings are never mutated.

Operators (one change per mutant): arithmetic swap (``+ −``, ``* /``, ``** → *``), a dropped right
term of ``+``/``−``, a dropped unary minus, comparison boundary (``< ↔ <=``) and negation
(``< → >=``), ``== ↔ !=``, ``is ↔ is not``, ``and ↔ or``, ``& ↔ |``, a dropped ``~``/``not``,
numeric constants (``0 ↔ 1``, ``c → c+1``, ``c → −c``; not ``−c`` for an axis index, see
:func:`_axis_constants`), ``True ↔ False``, ``torch.where`` branch
swap and mask inversion, a dropped ``torch.clamp`` bound, min/max swap (``torch.minimum ↔
maximum``, ``amin ↔ amax``, builtin ``min ↔ max``), ``.detach()`` removal, slice bounds ±1, a
dropped keyword argument (``**kwargs`` included; not ``what=``/``dtype=``/``device=`` or a
dataclass field) and a dropped dict-entry assignment
(``d["k"] = v`` → ``pass``).

Each mutant runs in a forked child of a parent that has imported torch, hypothesis and pytest but
not refppo: the child installs an import hook that loads the mutated module (compiled from the
mutated tree: same file name and line numbers), then runs ``pytest -x -q -p no:cacheprovider`` on
that module's test subset (:func:`subset`) with the Hypothesis ``ci`` profile (derandomized: the same
examples as CI) minus its shrink phase (a failure needs no minimal example here). Tests run fastest
first (their durations are measured on the unmutated code; a test that fails there is excluded and
listed in the report). A child that runs past its timeout (2 × the subset's baseline + 20 s) is
killed and counted as ``timeout`` (neither killed nor survived). ``--killed-in`` carries the killed
mutants of an earlier ``--json`` result (valid when tests were only added since); survivors listed
in ``tools/mutate_equivalent.json`` (key and one-line reason) are reported as equivalent and left
out of the score's denominator. A key names the file, the function, the mutated line's *text*, the
change and, for a repeated one, its occurrence (:meth:`Mutant.key`), never the line number, so an
edit elsewhere in the file leaves the entries valid; an entry that matches no mutant any more is
listed as stale in the report (and fails ``tests/structure/test_mutate_keys.py``).

Modules (every name stays importable from this one): ``mutate_scope.py`` (the modules, files and
test subsets), ``mutate_ops.py`` (:class:`Mutant`, the operators, the ``ast`` walker),
``mutate_run.py`` (the import hook, the forked child and one module's run); this file: the report
and the CLI.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

# the parts (tools/ is not a package: sibling modules; every name stays importable from here)
from mutate_ops import _ARITH as _ARITH
from mutate_ops import _BOUNDARY as _BOUNDARY
from mutate_ops import _KEEP_KWARGS as _KEEP_KWARGS
from mutate_ops import _MINMAX as _MINMAX
from mutate_ops import _NEGATE as _NEGATE
from mutate_ops import AXIS_FUNCS as AXIS_FUNCS
from mutate_ops import Alternative as Alternative
from mutate_ops import Mutant as Mutant
from mutate_ops import _attr_name as _attr_name
from mutate_ops import _axis_constants as _axis_constants
from mutate_ops import _binop_alternatives as _binop_alternatives
from mutate_ops import _call_alternatives as _call_alternatives
from mutate_ops import _clamp_alternatives as _clamp_alternatives
from mutate_ops import _const_alternatives as _const_alternatives
from mutate_ops import _Mutator as _Mutator
from mutate_ops import _short as _short
from mutate_ops import _slice_alternatives as _slice_alternatives
from mutate_ops import _with as _with
from mutate_ops import list_mutants as list_mutants
from mutate_ops import mutated_code as mutated_code
from mutate_run import ModuleResult as ModuleResult
from mutate_run import _child as _child
from mutate_run import _CodeLoader as _CodeLoader
from mutate_run import _OneModuleFinder as _OneModuleFinder
from mutate_run import _Plugin as _Plugin
from mutate_run import run_forked as run_forked
from mutate_run import run_module as run_module
from mutate_scope import CORE as CORE
from mutate_scope import DEFAULT_CLASSES as DEFAULT_CLASSES
from mutate_scope import EQUIVALENT as EQUIVALENT
from mutate_scope import EXTRA_TESTS as EXTRA_TESTS
from mutate_scope import GAP_TESTS as GAP_TESTS
from mutate_scope import MODULES as MODULES
from mutate_scope import NAIVE_HELPERS as NAIVE_HELPERS
from mutate_scope import PIPELINE_FUNCS as PIPELINE_FUNCS
from mutate_scope import PIPELINE_TESTS as PIPELINE_TESTS
from mutate_scope import ROOT as ROOT
from mutate_scope import TOP_LEVEL as TOP_LEVEL
from mutate_scope import module_name as module_name
from mutate_scope import module_path as module_path
from mutate_scope import subset as subset


def report(results: list[ModuleResult], wall: float, cpu: float, equivalent: dict[str, str]) -> str:
    """Markdown summary: totals per module, then every survivor (equivalent ones with the reason)."""
    lines = [
        "| module | mutants | killed | equivalent | survived | timeout | baseline s |",
        "|---|---|---|---|---|---|---|",
    ]
    tot = [0, 0, 0, 0, 0]
    for r in results:
        st = [m.status for m in r.mutants]
        eq = sum(s == "survived" and m.key() in equivalent for s, m in zip(st, r.mutants, strict=True))
        c = [len(st), st.count("killed"), eq, st.count("survived") - eq, st.count("timeout")]
        tot = [a + b for a, b in zip(tot, c, strict=True)]
        lines.append(f"| {r.module} | {' | '.join(map(str, c))} | {r.baseline_s:.1f} |")
    lines.append(f"| **total** | {' | '.join(map(str, tot))} | |")
    scored = tot[0] - tot[2] - tot[4]
    lines += [
        "",
        f"killed {tot[1]}/{tot[0] - tot[4]} = {100.0 * tot[1] / max(tot[0] - tot[4], 1):.1f}% of all "
        f"(timeouts excluded); {tot[1]}/{scored} = {100.0 * tot[1] / max(scored, 1):.1f}% of the "
        f"non-equivalent; wall {wall / 60:.1f} min, CPU {cpu / 60:.1f} min",
        "",
        "Survivors (not marked equivalent):",
    ]
    survivors = [m for r in results for m in r.mutants if m.status == "survived"]
    lines += [f"- {m.label()}" for m in survivors if m.key() not in equivalent]
    lines += ["", "Equivalent survivors:"]
    lines += [f"- {m.label()}: {equivalent[m.key()]}" for m in survivors if m.key() in equivalent]
    stale = stale_entries(equivalent, [r.module for r in results])
    if stale:
        lines += ["", "Stale entries of the equivalent list (no mutant of these modules has the key):"]
        lines += [f"- {k}" for k in stale]
    excluded = [f"- {r.module}: {t}" for r in results for t in r.excluded]
    if excluded:
        lines += ["", "Tests excluded (failing on the unmutated code):", *excluded]
    timeouts = [m for r in results for m in r.mutants if m.status == "timeout"]
    if timeouts:
        lines += ["", "Timeouts:"] + [f"- {m.label()}" for m in timeouts]
    return "\n".join(lines)


def stale_entries(equivalent: dict[str, str], modules: Sequence[str]) -> list[str]:
    """Keys of ``equivalent`` that name a file of ``modules`` but no current mutant of it."""
    files = {module_path(m).name: m for m in modules}
    keys = {mu.key() for m in modules for mu in list_mutants(m)}
    return [k for k in equivalent if k.split("::", 1)[0].split(":", 1)[0] in files and k not in keys]


def _load_equivalent(path: Path) -> dict[str, str]:
    """``key → reason`` from a JSON list of ``{"key": ..., "reason": ...}`` (missing file: none)."""
    if not path.exists():
        return {}
    return {e["key"]: e["reason"] for e in json.loads(path.read_text())}


def _load_killed(path: str | None) -> set[str]:
    if path is None:
        return set()
    data = json.loads(Path(path).read_text())
    return {Mutant(**m).key() for r in data for m in r["mutants"] if m["status"] == "killed"}


def _iter_modules(selected: list[str] | None) -> Iterator[str]:
    for mod in selected or MODULES:
        if mod not in MODULES:
            sys.exit(f"mutate: unknown module {mod!r}; valid: {', '.join(MODULES)}")
        yield mod


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--module", action="append", help=f"one of {', '.join(MODULES)} (repeatable; default all)")
    p.add_argument("--list", action="store_true", help="list the mutants and their subsets; run nothing")
    p.add_argument(
        "--only", action="append", type=int, help="run only these mutant indices (with one --module)"
    )
    p.add_argument("--show", action="store_true", help="print every mutant's pytest output tail")
    p.add_argument("--json", help="also write the results as JSON to this path")
    p.add_argument(
        "--killed-in",
        help="a previous --json result: its killed mutants are not rerun (valid when tests were only added)",
    )
    p.add_argument(
        "--equivalent",
        default=str(EQUIVALENT),
        help="JSON list of {key, reason}: survivors judged equivalent (default tools/mutate_equivalent.json)",
    )
    a = p.parse_args(argv)
    modules = list(_iter_modules(a.module))
    if a.list:
        for mod in modules:
            mutants = list_mutants(mod)
            print(f"== {mod}: {len(mutants)} mutants; tests {subset(mod)}")
            for mu in mutants:
                print(f"  {mu.label()}")
        return 0
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))  # test the tree this file sits in, whatever is installed
    os.environ.setdefault("HYPOTHESIS_PROFILE", "ci")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import hypothesis  # noqa: F401  # imported once in the parent, shared by every forked child
    import pytest  # noqa: F401
    import torch

    torch.set_num_threads(1)
    t0 = time.monotonic()
    only = set(a.only) if a.only else None
    carried = _load_killed(a.killed_in)
    results: list[ModuleResult] = []
    with tempfile.TemporaryDirectory(prefix="refppo-mutate-") as tmp:
        for mod in modules:
            results.append(run_module(mod, only, tmp, a.show, carried))
            if a.json:  # after every module, so an interrupted run keeps what it measured
                _write_json(a.json, results)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    text = report(
        results, time.monotonic() - t0, usage.ru_utime + usage.ru_stime, _load_equivalent(Path(a.equivalent))
    )
    print(text)
    return 0


def _write_json(path: str, results: list[ModuleResult]) -> None:
    data = [dict(asdict(r), mutants=[asdict(m) for m in r.mutants]) for r in results]
    tmp = path + ".tmp"
    Path(tmp).write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
