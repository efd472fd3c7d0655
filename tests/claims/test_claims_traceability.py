"""spec/claims.md is machine-checked: every claim has a valid verdict and either test ids that
exist in the collected test suite or a stated reason why it cannot be tested.

Format of one claim (see spec/claims.md, "Format")::

    ### C-000-Q5-3 — short title
    - **Source:** 000 Q5 「…」
    - **Claim:** …
    - **Verdict:** holds | holds with a caveat | wrong
    - **Correction:** …                      (required unless the verdict is "holds")
    - **Tests:** `tests/path/file.py::test_name`, `…`
    - **Not testable:** reason               (instead of, or besides, Tests)
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLAIMS_MD = ROOT / "spec" / "claims.md"

VERDICTS = ("holds", "holds with a caveat", "wrong")
CLAIM_ID = re.compile(r"^C-(000-Q[1-8]|003-[1-5])-[0-9]+[a-z]?$")
HEADING = re.compile(r"^### (\S+)")
FIELD = re.compile(r"^- \*\*([A-Za-z ]+):\*\*\s*(.*)$")
TEST_ID = re.compile(r"`([^`]+)`")
KNOWN_FIELDS = ("Source", "Claim", "Verdict", "Correction", "Tests", "Not testable")


@dataclass
class Claim:
    cid: str
    line: int
    fields: dict[str, str] = field(default_factory=dict)

    def test_ids(self) -> list[str]:
        return TEST_ID.findall(self.fields.get("Tests", ""))


def parse_claims(text: str) -> tuple[list[Claim], list[str]]:
    """Claims in document order and format problems (unknown or repeated fields)."""
    claims: list[Claim] = []
    problems: list[str] = []
    current: Claim | None = None
    last_field: str | None = None
    for n, line in enumerate(text.splitlines(), start=1):
        h = HEADING.match(line)
        if h and h.group(1).startswith("C-"):
            current = Claim(h.group(1), n)
            claims.append(current)
            last_field = None
            continue
        if line.startswith("#"):
            current, last_field = None, None
            continue
        if current is None:
            continue
        f = FIELD.match(line)
        if f:
            name, value = f.group(1), f.group(2).strip()
            if name not in KNOWN_FIELDS:
                problems.append(f"{current.cid} (line {n}): unknown field {name!r}")
            elif name in current.fields:
                problems.append(f"{current.cid} (line {n}): field {name!r} given twice")
            current.fields[name] = value
            last_field = name
        elif last_field is not None and line.startswith("  ") and line.strip():
            current.fields[last_field] += " " + line.strip()  # continuation line
        elif not line.strip():
            last_field = None
    return claims, problems


def base_id(node_id: str) -> str:
    """``path::test[param]`` → ``path::test``."""
    return node_id.split("[", 1)[0]


_COLLECTED: dict[str, set[str]] = {}  # file -> node ids; one pytest run per new set of files


def collect(files: list[str]) -> set[str]:
    """Node ids that pytest collects from ``files`` (missing files are skipped): every
    parametrized case ``path::test[case]`` and every base id ``path::test``.

    Runs ``pytest --collect-only -q`` in a subprocess, once for the files not collected yet in this
    session; a file that fails to import contributes no ids.
    """
    present = sorted({f for f in files if (ROOT / f).is_file()})
    todo = [f for f in present if f not in _COLLECTED]
    if todo:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *todo],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        for f in todo:
            _COLLECTED[f] = set()
        for line in proc.stdout.splitlines():
            node = line.strip()
            if "::" in node and node.split("::", 1)[0] in _COLLECTED:
                _COLLECTED[node.split("::", 1)[0]].update({node, base_id(node)})
    return set().union(*(_COLLECTED[f] for f in present)) if present else set()


def check_claims(text: str, collected: set[str] | None = None) -> list[str]:
    """Every problem found in a claims document; ``collected`` None means: collect with pytest."""
    claims, problems = parse_claims(text)
    if not claims:
        return ["no claims found"]
    seen: set[str] = set()
    refs: list[tuple[Claim, str]] = []
    for c in claims:
        where = f"{c.cid} (line {c.line})"
        if not CLAIM_ID.match(c.cid):
            problems.append(f"{where}: malformed claim id")
        if c.cid in seen:
            problems.append(f"{where}: duplicate claim id")
        seen.add(c.cid)
        for name in ("Source", "Claim", "Verdict"):
            if not c.fields.get(name):
                problems.append(f"{where}: missing {name}")
        verdict = c.fields.get("Verdict", "")
        if verdict and verdict not in VERDICTS:
            problems.append(f"{where}: verdict {verdict!r} is not one of {VERDICTS}")
        if verdict in ("holds with a caveat", "wrong") and not c.fields.get("Correction"):
            problems.append(f"{where}: verdict {verdict!r} needs a Correction")
        ids = c.test_ids()
        if "Tests" in c.fields and not ids:
            problems.append(f"{where}: Tests field without a backticked test id")
        if not ids and not c.fields.get("Not testable"):
            problems.append(f"{where}: neither a test nor a not-testable reason")
        for tid in ids:
            if "::" not in tid or not tid.startswith("tests/"):
                problems.append(f"{where}: malformed test id {tid!r}")
            else:
                refs.append((c, tid))
    if collected is None:
        collected = collect([tid.split("::", 1)[0] for _, tid in refs])
    for c, tid in refs:  # a bare id names its base test; ``test[case]`` must be a collected case
        if "::" in tid and tid not in collected:
            problems.append(f"{c.cid} (line {c.line}): test {tid!r} does not exist in the collected suite")
    return problems


def test_claims_md_is_fully_traced() -> None:
    """spec/claims.md: valid verdicts, and every referenced test id is collected by pytest."""
    text = CLAIMS_MD.read_text(encoding="utf-8")
    claims, _ = parse_claims(text)
    assert len(claims) >= 40
    ids = {c.cid for c in claims}
    for q in range(1, 9):  # every question of note 000 and every section of note 003 is covered
        assert any(i.startswith(f"C-000-Q{q}-") for i in ids), f"no claim for 000 Q{q}"
    for s in range(1, 6):
        assert any(i.startswith(f"C-003-{s}-") for i in ids), f"no claim for 003 §{s}"
    problems = check_claims(text)
    assert problems == [], "\n".join(problems)


SYNTHETIC = """\
# Claims

### C-000-Q1-1 — fine
- **Source:** 000 Q1 「x」
- **Claim:** a claim with a real test.
- **Verdict:** holds
- **Tests:** `tests/claims/test_claims_003.py::test_s4_clip_truth_table[note1_Apos_r_above]`

### C-000-Q1-2 — bogus test id
- **Source:** 000 Q1 「x」
- **Claim:** a claim whose test does not exist.
- **Verdict:** holds
- **Tests:** `tests/claims/test_claims_003.py::test_this_does_not_exist`

### C-000-Q1-3 — no test at all
- **Source:** 000 Q1 「x」
- **Claim:** a claim with neither tests nor reason.
- **Verdict:** holds

### C-000-Q1-4 — bad verdict
- **Source:** 000 Q1 「x」
- **Claim:** a claim with an invented verdict.
- **Verdict:** mostly true
- **Not testable:** terminology.

### C-000-Q1-5 — wrong without correction, file missing
- **Source:** 000 Q1 「x」
- **Claim:** wrong, but says not what is right.
- **Verdict:** wrong
- **Tests:** `tests/claims/test_no_such_file.py::test_x`

### C-000-Q1-1 — duplicate
- **Source:** 000 Q1 「x」
- **Claim:** duplicate id.
- **Verdict:** holds
- **Not testable:** duplicate.
"""


def test_traceability_check_reports_bogus_ids_and_untested_claims() -> None:
    """The checker itself can fail: run it, collecting for real, on a synthetic claims text."""
    problems = check_claims(SYNTHETIC)
    text = "\n".join(problems)
    assert "test_this_does_not_exist" in text and "C-000-Q1-2" in text
    assert any("C-000-Q1-3" in p and "neither a test" in p for p in problems)
    assert any("C-000-Q1-4" in p and "mostly true" in p for p in problems)
    assert any("C-000-Q1-5" in p and "needs a Correction" in p for p in problems)
    assert any("C-000-Q1-5" in p and "test_no_such_file.py" in p for p in problems)
    assert any("duplicate claim id" in p for p in problems)
    assert not any(p.startswith("C-000-Q1-1 (line 3)") for p in problems)  # the good claim passes
    assert len(problems) == 6, text


def test_traceability_parametrized_ids_match_their_base_function() -> None:
    """A bare ``test_x`` in claims.md names the parametrized base test; ``test_x[case]`` names one
    row and must be a collected case (a renamed or misspelt row is reported)."""
    collected = {"tests/a/test_m.py::test_x", "tests/a/test_m.py::test_x[a]", "tests/a/test_m.py::test_x[b]"}
    claim = "### C-003-4-1 — p\n- **Source:** s\n- **Claim:** c\n- **Verdict:** holds\n- **Tests:** `{}`\n"
    assert check_claims(claim.format("tests/a/test_m.py::test_x[a]"), collected) == []
    assert check_claims(claim.format("tests/a/test_m.py::test_x"), collected) == []
    assert len(check_claims(claim.format("tests/a/test_m.py::test_x[nope]"), collected)) == 1
    assert len(check_claims(claim.format("tests/a/test_m.py::test_y"), collected)) == 1
    # for real: a row of the clip truth table that does not exist
    real = "tests/claims/test_claims_003.py::test_s4_clip_truth_table"
    assert check_claims(claim.format(f"{real}[note3_Aneg_r_below]")) == []
    problems = check_claims(claim.format(f"{real}[note3_Aneg_r_blow]"))
    assert len(problems) == 1 and "note3_Aneg_r_blow" in problems[0], problems
