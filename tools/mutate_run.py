"""Running the mutants of ``tools/mutate.py`` (split out of it): the import hook that loads a
mutated module in a forked child, the pytest plugin, the fork and its timeout, one module's run."""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

from mutate_ops import Mutant, list_mutants, mutated_code
from mutate_scope import module_name, module_path, subset

# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------


class _CodeLoader(importlib.abc.Loader):
    def __init__(self, code: CodeType) -> None:
        self.code = code

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        exec(self.code, module.__dict__)


class _OneModuleFinder(importlib.abc.MetaPathFinder):
    """Serves one module name from the given code; everything else imports normally."""

    def __init__(self, name: str, code: CodeType, path: str) -> None:
        self.name, self.code, self.path = name, code, path

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        return importlib.util.spec_from_file_location(fullname, self.path, loader=_CodeLoader(self.code))


class _Plugin:
    """pytest plugin: no shrinking, fastest tests first, ``exclude`` deselected, durations recorded."""

    def __init__(self, durations: dict[str, float], exclude: set[str]) -> None:
        self.durations = durations
        self.exclude = exclude
        self.measured: dict[str, float] = {}
        self.failed: list[str] = []

    def pytest_configure(self, config: Any) -> None:
        from hypothesis import Phase, settings

        base = os.environ.get("HYPOTHESIS_PROFILE", "ci")
        phases = [Phase.explicit, Phase.reuse, Phase.generate]
        settings.register_profile("mutation", parent=settings.get_profile(base), phases=phases)
        settings.load_profile("mutation")

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        dropped = [it for it in items if it.nodeid in self.exclude]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [it for it in items if it.nodeid not in self.exclude]
        items.sort(key=lambda it: self.durations.get(it.nodeid, 0.0))

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.measured[report.nodeid] = self.measured.get(report.nodeid, 0.0) + report.duration
        if report.failed and report.nodeid not in self.failed:
            self.failed.append(report.nodeid)


def _child(
    files: list[str],
    durations: dict[str, float],
    exclude: set[str],
    log: str,
    source: tuple[str, CodeType, str] | None,
) -> int:
    """Body of the forked child: install the mutant, run pytest, return its exit code.

    Without a mutant (the baseline) every test runs (no ``-x``) and the durations and failures are
    written to ``log + ".json"``.
    """
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if source is not None:
        sys.meta_path.insert(0, _OneModuleFinder(*source))
    import pytest

    plugin = _Plugin(durations, exclude)
    stop = ["-x"] if source is not None else []
    args = [*stop, "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *files]
    rc = int(pytest.main(args, plugins=[plugin]))
    if source is None:
        with open(log + ".json", "w") as f:
            json.dump({"durations": plugin.measured, "failed": plugin.failed}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    return rc


def run_forked(
    files: list[str],
    durations: dict[str, float],
    exclude: set[str],
    log: str,
    source: tuple[str, CodeType, str] | None,
    timeout: float,
) -> tuple[str, float]:
    """Run the subset in a forked child: ``("pass" | "fail" | "timeout", seconds)``."""
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            code = _child(files, durations, exclude, log, source)
        finally:
            os._exit(code)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t0 > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", time.monotonic() - t0
        time.sleep(0.05)
    rc = os.waitstatus_to_exitcode(status)
    return ("pass" if rc == 0 else "fail"), time.monotonic() - t0


@dataclass
class ModuleResult:
    """All mutants of one module with the baseline time."""

    module: str
    files: list[str]
    baseline_s: float
    excluded: list[str] = field(default_factory=list)
    """Tests of the subset that fail on the unmutated code (deselected for the mutants)."""
    mutants: list[Mutant] = field(default_factory=list)


def run_module(mod: str, only: set[int] | None, tmp: str, show: bool, carried: set[str]) -> ModuleResult:
    """Baseline the subset on the unmutated code, then run every (selected) mutant.

    Mutants whose :meth:`Mutant.key` is in ``carried`` (killed in an earlier run) are not rerun.
    """
    files = subset(mod)
    log = os.path.join(tmp, f"{mod}.log")
    status, base_s = run_forked(files, {}, set(), log, None, timeout=1800)
    base = json.loads(Path(log + ".json").read_text()) if Path(log + ".json").exists() else None
    if status != "pass" and not (base and base["failed"]):
        sys.exit(
            f"mutate: the unmutated {mod} subset did not run; see {log}:\n{Path(log).read_text()[-3000:]}"
        )
    assert base is not None
    durations: dict[str, float] = base["durations"]
    excluded: list[str] = base["failed"]
    print(f"== {mod}: baseline {base_s:.1f} s, files {files}", flush=True)
    for nodeid in excluded:  # a test that fails on the unmutated code cannot tell mutants apart
        print(f"  EXCLUDED (fails on the unmutated code): {nodeid}", flush=True)
    result = ModuleResult(mod, files, base_s, excluded)
    path = str(module_path(mod))
    for mu in list_mutants(mod):
        if only is not None and mu.index not in only:
            continue
        if mu.key() in carried:
            mu.status = "killed"
            result.mutants.append(mu)
            continue
        src = mutated_code(mod, mu.index)
        mlog = os.path.join(tmp, f"{mod}-{mu.index}.log")
        mutant = (module_name(mod), src, path)
        st, secs = run_forked(files, durations, set(excluded), mlog, mutant, 2.0 * base_s + 20.0)
        mu.status = {"pass": "survived", "fail": "killed", "timeout": "timeout"}[st]
        mu.seconds = secs
        result.mutants.append(mu)
        if mu.status != "killed" or show:
            print(f"  {mu.status:8s} {secs:6.1f}s {mu.label()}", flush=True)
            if show:
                print(Path(mlog).read_text()[-4000:], flush=True)
    return result
