"""Facts stated twice agree (#12 item 9: README said Python >= 3.10, pyproject >= 3.11; #20 item 7)."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def test_readme_python_version_matches_pyproject() -> None:
    required = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    m = re.fullmatch(r">=\s*(\d+\.\d+)", required)
    assert m, f"requires-python {required!r} is not of the form '>=X.Y'"
    stated = re.findall(r"Python ≥ (\d+\.\d+)", (ROOT / "README.md").read_text())
    assert stated, "README.md no longer states the minimum Python version"
    assert set(stated) == {m.group(1)}, f"README says Python ≥ {stated}, pyproject {required!r}"


def test_ruff_and_mypy_target_the_minimum_python() -> None:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    minimum = doc["project"]["requires-python"].removeprefix(">=").strip()
    assert doc["tool"]["mypy"]["python_version"] == minimum
    assert doc["tool"]["ruff"]["target-version"] == "py" + minimum.replace(".", "")


# --- README.md (the user's manual) against the code, spec/ and benchmarks/RESULTS.md ------------

README = ROOT / "README.md"


def _diff(tmp: Path, tensors: dict[str, Any], hparams: dict[str, Any], *args: str) -> tuple[int, str, str]:
    """``refppo diff`` (the console script's entry point) on a dump of ``tensors`` with ``hparams``."""
    import contextlib
    import io

    from refppo.cli import main
    from refppo.dump.write import write_dump

    path = tmp / "d.safetensors"
    write_dump(path, tensors, hparams=hparams)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["diff", str(path), *args])
    return rc, out.getvalue(), err.getvalue()


def _rows(B: int = 4, T: int = 3) -> dict[str, Any]:
    import torch

    mask = torch.ones(B, T)
    mask[1, 2] = 0
    old = -torch.rand(B, T, dtype=torch.float64)
    return {"response_mask": mask, "old_logprobs": old, "ref_logprobs": old.clone()}


def _missing(err: str) -> list[str]:
    m = re.search(r"missing hyperparameters (\[[^\]]*\])", err)
    assert m, f"refppo diff no longer names the missing hyperparameters: {err!r}"
    names: list[str] = ast.literal_eval(m.group(1))
    return names


def test_required_sidecar_hyperparameters_agree(tmp_path: Path) -> None:
    """README's CI section, spec/dump-format.md and `refppo diff` name the same required keys."""
    import torch

    readme = re.search(r"sidecar needs (.*?)\*\*", README.read_text(), re.S)
    spec = re.search(
        r"^- required \(unless.*?\): (.*?);", (ROOT / "spec/dump-format.md").read_text(), re.S | re.M
    )
    assert readme and spec, "README.md or spec/dump-format.md no longer lists the required sidecar keys"
    t = _rows()
    t.update(old_values=torch.zeros(4, 3, dtype=torch.float64), scores=torch.ones(4, dtype=torch.float64))
    t["returns"] = torch.zeros(4, 3, dtype=torch.float64)
    rc, _, err = _diff(tmp_path, t, {})
    assert rc == 2
    code = _missing(err)
    assert re.findall(r"`(\w+)`", readme.group(1)) == code
    assert re.findall(r"`(\w+)`", spec.group(1)) == code


def test_readme_claim_on_critic_free_sidecars_holds(tmp_path: Path) -> None:
    """README: a critic-free dump without values needs neither gamma, lam, cliprange_value nor
    vf_coef (no stage reads them), and the report does not depend on them."""
    import torch

    text = " ".join(README.read_text().split())
    assert (
        "a critic-free dump without a critic's `values` needs neither `gamma` (except REINFORCE++), "
        "`lam`, `cliprange_value` nor `vf_coef`" in text
    )
    t = _rows()
    s = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)
    g = torch.tensor([0, 0, 1, 1])
    adv = torch.zeros(4, 3, dtype=torch.float64)
    for grp in (0, 1):  # GRPO by hand: (s − mean) / (std + 1e-6) within each group
        rows = (g == grp).nonzero().flatten()
        adv[rows] = ((s[rows] - s[rows].mean()) / (s[rows].std() + 1e-6))[:, None] * t["response_mask"][rows]
    t.update(scores=s, group_index=g, advantages=adv)
    args = ("--set", "advantage=grpo", "--set", "whiten_advantages=none")
    base = {"kl_coef": 0.0, "cliprange": 0.2}
    rc, _, err = _diff(tmp_path, t, {"kl_coef": 0.0}, *args)
    assert rc == 2 and _missing(err) == ["cliprange"], err
    reports = []
    for extra in ({}, {"gamma": 0.5, "lam": 0.1, "cliprange_value": 7.0, "vf_coef": 3.0}):
        rc, out, err = _diff(tmp_path, t, {**base, **extra}, *args)
        assert rc == 0, out + err
        # the lines naming the hyperparameters and their sources differ; nothing else may
        reports.append(re.sub(r"^(hparams:|\s*hyperparameters from).*$", "", out, flags=re.M))
    assert reports[0] == reports[1]


def test_readme_presets_are_the_oracles(tmp_path: Path) -> None:
    text = " ".join(README.read_text().split())
    m = re.search(r"Presets ((?:`[\w-]+`[,:] )+)", text)
    assert m, "README.md no longer lists the presets"
    import torch

    t = dict(
        _rows(), scores=torch.ones(4, dtype=torch.float64), advantages=torch.zeros(4, 3, dtype=torch.float64)
    )
    rc, _, err = _diff(tmp_path, t, {}, "--preset", "no-such-preset")
    known = re.search(r"valid presets are (\[[^\]]*\])", err)
    assert rc == 2 and known, err
    assert sorted(re.findall(r"`([\w-]+)`", m.group(1))) == sorted(ast.literal_eval(known.group(1)))


def test_readme_figures_are_those_of_benchmarks_results() -> None:
    """Every number of the README's performance table and demo figures is in benchmarks/RESULTS.md."""
    text = README.read_text()
    results = (ROOT / "benchmarks/RESULTS.md").read_text().replace("**", "")
    perf = text[text.index("## Performance") : text.index("## Layout")]
    demo = text[text.index("`refppo demo` warm-starts") : text.index("### Configuration")]
    figures = set(re.findall(r"(?<![\d.])[+-]?\d+\.\d+(?![\d.])", perf + demo))
    assert len(figures) > 15
    measured = [float(x) for x in re.findall(r"(?<![\d.])[+-]?\d+\.\d+(?![\d.])", results)]

    def stated(fig: str) -> bool:  # the README may round RESULTS.md's figure to its own decimals
        digits = len(fig.split(".")[1])
        return any(round(m, digits) == float(fig) for m in measured)

    missing = sorted(f for f in figures if not stated(f))
    assert not missing, f"README figures not in benchmarks/RESULTS.md: {missing}"


def test_readme_stays_a_manual() -> None:
    """#20 item 7: at most ~250 lines; history belongs in CHANGELOG.md and benchmarks/RESULTS.md."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines"
