"""Loading and validating dumps: every bad input is a one-line DumpError/RefPPOError, never a crash."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from oracle_helpers import HP, make_inputs, refppo_dump, save, setup_for

from refppo.dump.load import load_dump
from refppo.dump.write import sidecar_for, write_dump
from refppo.errors import DumpError, RefPPOError
from refppo.oracle.cli import main


def _good(tmp_path: Path, name: str = "step.safetensors") -> tuple[Path, dict[str, torch.Tensor]]:
    d = refppo_dump(make_inputs(), setup_for())
    return save(tmp_path, d, name=name), d


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".npz"])
def test_roundtrip_every_file_type(tmp_path: Path, suffix: str) -> None:
    path, d = _good(tmp_path, "step" + suffix)
    dump = load_dump(path)
    assert dump.B == 6 and dump.T == 12 and dump.dtype == torch.float64
    assert torch.equal(dump.tensors["advantages"], d["advantages"])
    assert dump.hparams == HP  # sidecar <dump>.json found automatically


def test_sidecar_without_dump_suffix_is_found(tmp_path: Path) -> None:
    path, _ = _good(tmp_path)
    sidecar_for(path).rename(tmp_path / "step.json")
    assert load_dump(path).hparams == HP


def _write_raw(tmp_path: Path, d: dict[str, torch.Tensor], hp: dict[str, object] | None = None) -> Path:
    path = tmp_path / "bad.safetensors"
    write_dump(path, d, hparams=HP if hp is None else hp)
    return path


def _bad_cases() -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    base = refppo_dump(make_inputs(), setup_for())
    cases: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}
    cases["missing"] = (
        "missing required key 'old_values'",  # the values given need it (optional without a critic)
        {k: v for k, v in base.items() if k != "old_values"},
    )
    cases["shape"] = ("values: expected shape [B, T] = [6, 12]", {**base, "values": base["values"][:, :5]})
    cases["B mismatch"] = ("scores: expected shape [B] = [6]", {**base, "scores": base["scores"][:4]})
    cases["dtype"] = (
        "old_logprobs: expected a floating-point tensor",
        {**base, "old_logprobs": torch.ones(6, 12).long()},
    )
    nan = base["old_logprobs"].clone()
    nan[1, 0] = float("nan")
    cases["nonfinite"] = (
        "old_logprobs: non-finite value at valid position [1, 0]",
        {**base, "old_logprobs": nan},
    )
    empty = base["response_mask"].clone()
    empty[2] = 0
    cases["empty row"] = ("rows [2] have no valid token", {**base, "response_mask": empty})
    cases["mask values"] = ("expected only 0/1", {**base, "response_mask": base["response_mask"] * 2})
    cases["scalar shape"] = (
        "pg_loss: expected a 0-dim scalar",
        {**base, "pg_loss": torch.zeros(3, dtype=torch.float64)},
    )
    cases["needs update"] = (
        "pg_loss is given but the update-step inputs ['logprobs']",
        {k: v for k, v in base.items() if k != "logprobs"},
    )
    return cases


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_dumps_are_refused_with_a_clear_message(tmp_path: Path, case: str) -> None:
    expected, d = _bad_cases()[case]
    with pytest.raises(DumpError, match=None) as err:
        load_dump(_write_raw(tmp_path, d))
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_padding_junk_is_accepted(tmp_path: Path) -> None:
    d = refppo_dump(make_inputs(), setup_for())
    m = d["response_mask"].bool()
    d["old_values"] = torch.where(m, d["old_values"], torch.full((), float("nan"), dtype=torch.float64))
    d["logprobs"] = torch.where(m, d["logprobs"], torch.full((), float("inf"), dtype=torch.float64))
    assert load_dump(_write_raw(tmp_path, d)).B == 6


def test_unknown_file_type(tmp_path: Path) -> None:
    p = tmp_path / "step.h5"
    p.write_bytes(b"x")
    with pytest.raises(DumpError, match="unknown file type"):
        load_dump(p)


def test_sidecar_with_unknown_key_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = _good(tmp_path)
    sidecar_for(path).write_text(json.dumps({**HP, "gama": 0.9}))
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'gama'" in err and err.count("\n") == 1


def test_missing_hparams_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = _good(tmp_path)
    sidecar_for(path).write_text(json.dumps({"gamma": 1.0}))
    assert main([str(path)]) == 2
    assert "missing hyperparameters" in capsys.readouterr().err


def test_bad_set_value_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = _good(tmp_path)
    assert main([str(path), "--set", "score_at=middle"]) == 2
    assert "score_at: unknown name 'middle'" in capsys.readouterr().err
    assert main([str(path), "--set", "gamma=1.5"]) == 2
    assert main([str(path), "--preset", "nope"]) == 2


class _Evil:
    """Unpickling this would create a marker file (via os.system)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    with path.open("wb") as f:
        pickle.dump({"response_mask": _Evil(marker)}, f)
    torch.save({"payload": _Evil(marker)}, tmp_path / "evil2.pt")  # the torch zip container too
    for p in (path, tmp_path / "evil2.pt"):
        with pytest.raises(DumpError, match="refused"):
            load_dump(p)
    assert not marker.exists()


def test_npz_with_object_arrays_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "obj.npz"
    np.savez(p, response_mask=np.array([object()], dtype=object))
    with pytest.raises(RefPPOError, match="without pickles"):
        load_dump(p)


def test_mask_with_interior_holes_is_accepted(tmp_path: Path) -> None:
    """Multi-turn masks (tool-output tokens zeroed between valid tokens) load as they are (refused
    with exit 2 before issue #11); the holes stay holes, the diff compares the valid tokens."""
    x = make_inputs(seed=3)
    m = x["response_mask"].clone()
    m[2] = 0
    m[2, 1:4] = 1  # 0 1 1 1 0 ...: leading and trailing zeros
    m[0, 3:6] = 0  # a full row with an interior hole
    x["response_mask"] = m
    s = setup_for("verl")
    path = save(tmp_path, refppo_dump(x, s), s)
    d = load_dump(path)
    assert d.tensors["response_mask"].tolist() == m.bool().tolist()
    assert main([str(path), "--preset", "verl"]) == 0


def _renamed(d: dict[str, torch.Tensor], renames: dict[str, str]) -> dict[str, torch.Tensor]:
    out = dict(d)
    for old, new in renames.items():
        out[new] = out.pop(old)
    return out


def _save_raw(tmp: Path, d: dict[str, torch.Tensor], name: str) -> Path:
    """A dump written without write_dump (which refuses misspelt keys): as a trainer of its own would."""
    from safetensors.torch import save_file

    path = tmp / name
    save_file({k: v.contiguous() for k, v in d.items()}, str(path))
    sidecar_for(path).write_text(json.dumps(HP))
    return path


def test_misnamed_key_gets_a_did_you_mean_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, d = _good(tmp_path)
    path = _save_raw(tmp_path, _renamed(d, {"old_logprobs": "old_log_prob"}), name="typo.safetensors")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "missing required keys ['old_logprobs']; did you mean 'old_log_prob' -> old_logprobs?" in err
    assert err.count("\n") == 1


def test_misnamed_output_key_is_refused_with_a_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # issue #21: a misspelt output was ignored, so the dump "matched" on fewer quantities; it is bad
    # input now (exit 2, one line naming it); a key that only loosely resembles one stays a hint
    _, d = _good(tmp_path)
    path = _save_raw(tmp_path, _renamed(d, {"advantages": "advantage"}), name="typo.safetensors")
    with pytest.raises(DumpError, match=r"unknown tensor key 'advantage' \(did you mean advantages\?\)"):
        load_dump(path)
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean advantages?" in err
    loose = _save_raw(tmp_path, {**d, "token_level_scores": d["kl"].clone()}, name="extra.safetensors")
    assert "ignored unknown tensor key 'token_level_scores' (did you mean token_rewards?)" in (
        load_dump(loose).key_notes()
    )


def test_verl_and_openrlhf_names_are_read_as_aliases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The names of spec/dump-format.md's verl and OpenRLHF tables: a dump written with them matches
    # exactly as the canonical one does, and each renaming is named in the report.
    _, d = _good(tmp_path)
    verl = {
        "old_logprobs": "old_log_probs",
        "ref_logprobs": "ref_log_prob",
        "token_rewards": "token_level_rewards",
    }
    verl |= {"pg_clipfrac": "actor/pg_clipfrac", "vf_loss": "critic/vf_loss", "values": "vpreds"}
    orl = {"response_mask": "action_mask", "old_logprobs": "action_log_probs"}
    orl |= {"ref_logprobs": "base_action_log_probs", "approx_kl": "ppo_kl"}
    for name, renames in (("verl", verl), ("openrlhf", orl)):
        path = save(tmp_path, _renamed(d, renames), name=f"{name}.safetensors")
        assert main([str(path)]) == 0, name
        out = capsys.readouterr().out
        for alias, key in renames.items():
            assert f"read key {key!r} as {alias}" in out
        assert "ignored unknown tensor key" not in out


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            {"old_log_probs": "old_logprobs"},
            "keys 'old_logprobs' and 'old_log_probs' (verl name of old_logprobs)",
        ),
        (
            {"action_log_probs": "old_logprobs", "old_log_probs": "old_logprobs"},
            "(OpenRLHF name of old_logprobs) and 'old_log_probs' (verl name",
        ),
    ],
    ids=["key-and-alias", "two-aliases"],
)
def test_two_names_for_one_quantity_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: dict[str, str], needle: str
) -> None:
    # An alias never silently shadows: two tensors for one quantity is bad input naming both.
    _, d = _good(tmp_path)
    d = {**d, **{alias: d[key].clone() for alias, key in extra.items()}}
    if "old_log_probs" in extra and "action_log_probs" in extra:
        del d["old_logprobs"]
    path = save(tmp_path, d, name="twice.safetensors")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "keep one of them" in err and err.count("\n") == 1


def test_overlay_keeps_the_sidecar_path(tmp_path: Path) -> None:
    """rev2 NIT-1: with ``overlay`` (``check_step(path, hparams=...)``) the sidecar file is read
    too; before, its path was lost: the report's ``hparams_file`` was null and a bad sidecar value
    was blamed on the dump."""
    from refppo.oracle.run import check_step

    path, _ = _good(tmp_path)
    side = sidecar_for(path)
    assert load_dump(path, overlay={"gamma": 0.99}).hparams_path == side
    assert check_step(path, hparams={"gamma": HP["gamma"]}).json()["dump"]["hparams_file"] == str(side)
    other = tmp_path / "hp.json"
    other.write_text(side.read_text())
    assert load_dump(path, other, overlay={"gamma": 0.99}).hparams_path == other
    side.write_text(json.dumps({**HP, "temperature": -1.0}))
    with pytest.raises(DumpError) as err:
        load_dump(path, overlay={"gamma": 0.99})
    assert str(err.value).startswith(f"{side}: temperature"), err.value
