"""A member added to a convention enum reaches every walk by construction: the flat key parses it,
the diagnosis tries it as a candidate, and ``--detect``'s walk evaluates it through the whitening
stage — nothing but the enum is edited (a scratch copy of the package: ``Whitening`` gains ``foo``,
which the core's ``normalize`` computes as its generic ``(x − μ)·s(σ²)`` branch)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import refppo
    assert refppo.__file__.startswith(sys.argv[1]), refppo.__file__
    from oracle_helpers import make_inputs, refppo_dump, save, setup_for
    from refppo.conventions import Whitening
    from refppo.dump.load import load_dump
    from refppo.oracle.check import diagnose
    from refppo.oracle.check.alternatives import AFFECTS, ALTERNATIVES
    from refppo.oracle.detect.detection import detect
    from refppo.pipeline import rollout as pipeline_rollout
    from refppo.pipeline.settings import Convention

    foo = Whitening("foo")
    assert Convention.of(whiten_advantages="foo").whiten.advantages is foo
    assert foo in [a["whiten_advantages"] for a in ALTERNATIVES["whiten_advantages"]]
    assert "whiten_advantages" in AFFECTS["advantages"]

    made = setup_for("openrlhf", {"whiten_advantages": "none"})
    start = setup_for("openrlhf", {})
    dump = load_dump(save(Path(sys.argv[2]), refppo_dump(make_inputs(B=6, T=10, seed=2), made), start))

    tried = []
    real = diagnose._candidate
    def candidate(dump, first, prefix_ok, alt, bug=None):
        tried.append(alt.conv.whiten.advantages)
        return real(dump, first, prefix_ok, alt, bug)
    diagnose._candidate = candidate
    res = diagnose.check(dump, start)
    assert res.first_divergence == "advantages", res.first_divergence
    assert foo in tried, tried

    walked = []
    real_w = pipeline_rollout.whiten_advantages  # the whitening stage's body
    def whiten(adv_raw, mask, conv, hp, *rest):
        walked.append(conv.whiten.advantages)
        return real_w(adv_raw, mask, conv, hp, *rest)
    pipeline_rollout.whiten_advantages = whiten
    detect(dump, start)
    assert foo in walked, sorted(set(walked))
    print("ok")
    """
)


def test_a_new_enum_member_is_parsed_tried_and_walked(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    shutil.copytree(ROOT / "refppo", pkg / "refppo", ignore=shutil.ignore_patterns("__pycache__"))
    conv = pkg / "refppo" / "conventions.py"
    text = conv.read_text()
    anchor = '    SCALE = "scale"\n'
    assert anchor in text
    conv.write_text(text.replace(anchor, anchor + '    FOO = "foo"\n', 1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pkg), str(ROOT / "tests" / "helpers")])}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(pkg), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
