"""Checkpoints, metrics, run directories and dumps: atomic writes and damage named in one line.

Tiny ``nn.Linear`` models keep these in milliseconds; the CLI-level checks (exit codes, kills)
are in ``tests/train/test_integrity.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from refppo.dump.write import sidecar_for, write_dump
from refppo.errors import RefPPOError
from refppo.train import checkpoint as ckpt
from refppo.train import rundir
from refppo.train.runlog import MetricsLog, load_metrics, read_metrics


def _parts(seed: int) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
    torch.manual_seed(seed)
    policy, critic = nn.Linear(4, 3), nn.Linear(4, 1)
    opts: dict[str, torch.optim.Optimizer] = {
        "policy": torch.optim.AdamW(policy.parameters(), lr=0.1),
        "critic": torch.optim.AdamW(critic.parameters(), lr=0.1),
    }
    for m, o in ((policy, opts["policy"]), (critic, opts["critic"])):  # an optimizer state to save
        m(torch.ones(2, 4)).sum().backward()
        o.step()
    return {"policy": policy, "critic": critic}, opts


def _save(root: Path, it: int, seed: int = 0) -> Path:
    models, opts = _parts(seed)
    ckpt.begin_checkpoint(root, it)
    rng = ckpt.rng_state(random.Random(1), torch.Generator().manual_seed(1))
    ckpt.save_checkpoint(root, it, models=models, optimizers=opts, rng=rng, state={"run_id": "x"})
    return ckpt.mark_complete(ckpt.staging_dir(root, it))


def _load(path: Path) -> ckpt.Checkpoint:
    models, opts = _parts(99)
    return ckpt.load_checkpoint(path, models=models, optimizers=opts)[0]


# ------------------------------------------------------------------------------------ checkpoints


def test_checkpoint_appears_only_complete(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    path = _save(root, 3)
    assert path == root / "iter_000003"
    assert sorted(p.name for p in root.iterdir()) == ["iter_000003"]  # no staging folder left
    manifest = json.loads((path / "COMPLETE").read_text())
    assert manifest["files"] == {p.name: p.stat().st_size for p in path.iterdir() if p.name != "COMPLETE"}
    assert set(manifest["files"]) == {
        "policy.safetensors",
        "critic.safetensors",
        "optim_policy.pt",
        "optim_critic.pt",
        "rng_rank0.pt",
        "state.json",
    }
    models, _ = _parts(0)
    loaded, opts = _parts(99)
    c, _ = ckpt.load_checkpoint(path, models=loaded, optimizers=opts)
    assert c.iteration == 3 and c.state["run_id"] == "x"
    for name in models:
        for a, b in zip(models[name].parameters(), loaded[name].parameters(), strict=True):
            assert torch.equal(a, b)


def test_a_save_that_dies_leaves_no_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "checkpoints"
    _save(root, 1)
    import safetensors.torch

    real = safetensors.torch.save_model

    def dies_after_writing(model: nn.Module, filename: str, **kw: object) -> None:
        real(model, filename)  # the file itself is complete: only the marker + rename make it count
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_model", dies_after_writing)
    with pytest.raises(KeyboardInterrupt):
        _save(root, 2)
    # the interrupted checkpoint exists only as a staging folder that nothing reads as a checkpoint
    assert [p.name for p in root.glob("iter_*")] == ["iter_000001"]
    assert ckpt.latest_checkpoint(root) == root / "iter_000001"
    monkeypatch.setattr(safetensors.torch, "save_model", real)
    assert _save(root, 2) == root / "iter_000002"  # the stale staging folder is replaced
    assert not list(root.glob(".tmp-*"))


def test_resaving_an_iteration_replaces_it(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    path = _save(root, 2, seed=0)
    before = (path / "policy.safetensors").read_bytes()
    _save(root, 2, seed=1)  # e.g. after --resume-fallback skipped a damaged iter_000002
    assert (path / "policy.safetensors").read_bytes() != before
    assert sorted(p.name for p in root.iterdir()) == ["iter_000002"]


def _flip(f: Path) -> None:
    """Replace the content by seeded random bytes of the same length (passes the size check; with
    seed 0 ``torch.load(weights_only=True)`` raises an UnpicklingError advising weights_only=False)."""
    f.write_bytes(random.Random(0).randbytes(f.stat().st_size))


CORRUPTIONS = {
    "truncated weights": (
        lambda p: (p / "policy.safetensors").write_bytes((p / "policy.safetensors").read_bytes()[:40]),
        r"policy\.safetensors is 40 bytes, COMPLETE recorded \d+ \(truncated",
    ),
    "garbage weights": (
        lambda p: _flip(p / "policy.safetensors"),
        r"policy\.safetensors is not a valid safetensors file",
    ),
    "garbage optimizer": (
        lambda p: _flip(p / "optim_policy.pt"),
        r"optim_policy\.pt is not a readable weights-only torch file \(UnpicklingError\)",
    ),
    "broken state.json": (
        lambda p: (p / "state.json").write_bytes(b"#" + (p / "state.json").read_bytes()[1:]),
        r"state\.json is not valid JSON \(Expecting value: line 1 column 1",
    ),
    "missing file": (lambda p: (p / "critic.safetensors").unlink(), r"critic\.safetensors is missing"),
    "missing rng": (lambda p: (p / "rng_rank0.pt").unlink(), r"rng_rank0\.pt is missing"),
    "old marker": (
        lambda p: (p / "COMPLETE").write_text("ok\n"),
        r"COMPLETE is not a refppo file manifest",
    ),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_damaged_checkpoint_is_one_line_naming_the_file(tmp_path: Path, kind: str) -> None:
    path = _save(tmp_path, 1)
    damage, message = CORRUPTIONS[kind]
    damage(path)
    with pytest.raises(ckpt.CheckpointError, match=message) as info:
        _load(path)
    text = str(info.value)
    assert "\n" not in text and str(path) in text
    assert "weights_only=False" not in text and "weights_only" not in text.replace("weights-only", "")
    # nothing chained: a traceback of this error cannot carry a pickle error's unsafe advice either
    e = info.value
    assert e.__cause__ is None and (e.__suppress_context__ or e.__context__ is None)


def test_incomplete_or_foreign_folders_are_not_checkpoints(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    (tmp_path / "iter_000005").mkdir()  # written by refppo before atomic saves, interrupted
    (tmp_path / ".tmp-iter_000006").mkdir()
    assert ckpt.complete_checkpoints(tmp_path) == [tmp_path / "iter_000001"]
    with pytest.raises(ckpt.CheckpointError, match="no COMPLETE marker"):
        _load(tmp_path / "iter_000005")


# ---------------------------------------------------------------------------------------- metrics


def _records(n: int) -> list[dict[str, object]]:
    return [{"iteration": i, "rollout/score": 0.5 * i} for i in range(1, n + 1)]


def test_a_torn_last_metrics_line_is_never_a_record(tmp_path: Path) -> None:
    f = tmp_path / "metrics.jsonl"
    log = MetricsLog(f)
    for r in _records(3):
        log.write(r)
    whole = f.read_bytes()
    f.write_bytes(whole + b'{"iteration": 4, "rollout/sc')  # a write cut short by kill -9
    m = load_metrics(f)
    assert [r["iteration"] for r in m.records] == [1, 2, 3] and m.torn == len(b'{"iteration": 4, "rollout/sc')
    with pytest.warns(UserWarning, match=r"ignored a torn last line \(28 bytes"):
        assert len(read_metrics(f)) == 3
    # a torn line that happens to parse is still torn: the newline is what commits a record
    f.write_bytes(whole + b'{"iteration": 4}')
    assert [r["iteration"] for r in load_metrics(f).records] == [1, 2, 3]


def test_damaged_metrics_line_names_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"iteration": 1}\n{"iteration": 2, oops}\n{"iteration": 3}\n')
    with pytest.raises(RefPPOError, match=r"metrics\.jsonl: line 2 is not a JSON record"):
        load_metrics(f)
    f.write_text('{"iteration": 1}\n[1, 2]\n')
    with pytest.raises(RefPPOError, match=r"line 2 is not a metrics record"):
        load_metrics(f)


def test_resume_truncates_metrics_to_the_checkpoint(tmp_path: Path) -> None:
    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in _records(5)) + '{"iteration": 6')
    log = MetricsLog(f, resume_from=3)
    assert [r["iteration"] for r in load_metrics(f).records] == [1, 2, 3]
    assert load_metrics(f).torn == 0
    assert any("torn last line" in n for n in log.notes)
    assert any("dropped 2 records after iteration 3" in n for n in log.notes)
    log.write({"iteration": 4})
    assert [r["iteration"] for r in load_metrics(f).records] == [1, 2, 3, 4]
    # a gap before the checkpoint is said, not hidden
    f.write_text("".join(json.dumps(r) + "\n" for r in _records(3)[1:]))
    assert any("WARNING" in n for n in MetricsLog(f, resume_from=3).notes)


# ------------------------------------------------------------------------------------- run dirs


def test_fresh_run_dir_rules(tmp_path: Path) -> None:
    rundir.check_fresh(tmp_path / "new", overwrite=False)  # missing: fine
    rundir.check_fresh(tmp_path, overwrite=False)  # empty: fine
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(rundir.RunDirError, match=r"is not empty \(notes\.txt\).*--overwrite"):
        rundir.check_fresh(tmp_path, overwrite=False)
    rundir.check_fresh(tmp_path, overwrite=True)  # nothing of refppo's to delete: allowed
    (tmp_path / "checkpoints").mkdir()  # refppo-looking, but no run.json: not known to be ours
    with pytest.raises(rundir.RunDirError, match=r"no run\.json.*deletes nothing"):
        rundir.check_fresh(tmp_path, overwrite=True)
    (tmp_path / "run.json").write_text("{}")  # present but not ours
    with pytest.raises(rundir.RunDirError, match="not a refppo run identity file"):
        rundir.check_fresh(tmp_path, overwrite=True)


def test_clear_run_deletes_refppos_entries_only(tmp_path: Path) -> None:
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("keep")
    out.mkdir()
    rundir.write_identity(out, rundir.new_identity("h"))
    for name in ("config.json", "metrics.jsonl", "plot.png", "notes.txt", ".tmp-metrics.jsonl-abc"):
        (out / name).write_text("x")
    (out / "checkpoints" / "iter_000001").mkdir(parents=True)
    (out / "checkpoints" / ".tmp-iter_000002").mkdir()
    (out / "checkpoints" / "mine.txt").write_text("keep")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1.host").write_text("x")
    (out / "data").symlink_to(elsewhere)  # a foreign link: kept, never followed
    rundir.check_fresh(out, overwrite=True)
    kept = rundir.clear_run(out)
    assert kept == ["checkpoints", "data", "notes.txt"]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["mine.txt"]
    assert (elsewhere / "precious.txt").read_text() == "keep"


def test_clear_run_unlinks_a_linked_checkpoints_folder_without_following_it(tmp_path: Path) -> None:
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (elsewhere / "iter_000001").mkdir(parents=True)
    out.mkdir()
    rundir.write_identity(out, rundir.new_identity("h"))
    (out / "checkpoints").symlink_to(elsewhere)
    assert rundir.clear_run(out) == []
    assert (elsewhere / "iter_000001").is_dir()


def test_config_hash_ignores_resumable_keys_only() -> None:
    a = {"run": {"iterations": 3, "seed": 0}, "ppo": {"cliprange": 0.2}}
    b = {"run": {"iterations": 9, "seed": 0}, "ppo": {"cliprange": 0.2}}
    c = {"run": {"iterations": 3, "seed": 1}, "ppo": {"cliprange": 0.2}}
    h = rundir.config_hash
    assert h(a, ["iterations"]) == h(b, ["iterations"])
    assert h(a, ["iterations"]) != h(c, ["iterations"])
    assert h(a, []) != h(b, [])


# ------------------------------------------------------------------------------------------ dumps


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".npz"])
def test_write_dump_that_dies_keeps_the_previous_pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    path = tmp_path / f"step{suffix}"
    write_dump(path, {"scores": torch.zeros(2)}, hparams={"gamma": 1.0})
    old_dump, old_side = path.read_bytes(), sidecar_for(path).read_bytes()

    import numpy as np
    import safetensors.torch

    def half_then_die(*args: object, **kw: object) -> None:
        target = args[0] if suffix == ".npz" else args[1]  # savez(file, **arrays); save*(data, file)
        Path(str(target)).write_bytes(b"partial")  # half a file, then the process dies
        raise KeyboardInterrupt

    if suffix == ".safetensors":
        monkeypatch.setattr(safetensors.torch, "save_file", half_then_die)
    elif suffix == ".pt":
        monkeypatch.setattr(torch, "save", half_then_die)
    else:
        monkeypatch.setattr(np, "savez", half_then_die)
    with pytest.raises(KeyboardInterrupt):
        write_dump(path, {"scores": torch.ones(2)}, hparams={"gamma": 0.5})
    assert path.read_bytes() == old_dump and sidecar_for(path).read_bytes() == old_side
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, sidecar_for(path).name]


def test_the_unsafe_advice_exists_and_is_not_passed_on(tmp_path: Path) -> None:
    """The raw error of the 'garbage optimizer' case does advise weights_only=False (so the check
    above is not vacuous); the CheckpointError does not."""
    path = _save(tmp_path, 1)
    _flip(path / "optim_policy.pt")
    with pytest.raises(Exception, match="weights_only") as raw:
        torch.load(path / "optim_policy.pt", weights_only=True)
    assert type(raw.value).__name__ == "UnpicklingError"
    with pytest.raises(ckpt.CheckpointError) as info:
        _load(path)
    assert "weights_only" not in str(info.value)


def test_resume_mismatch_reasons(tmp_path: Path) -> None:
    ident = rundir.RunIdentity("abc", "h1", "")
    config = {"run": {"iterations": 3}, "ppo": {"cliprange": 0.2}}
    ok = {"run_id": "abc", "config_hash": "h1", "config": config}
    args = (ident, config, "h1", ["iterations"], tmp_path)
    assert rundir.resume_mismatch(ok, *args) is None
    assert "belongs to another run" in str(rundir.resume_mismatch({**ok, "run_id": "zzz"}, *args))
    assert "no run id" in str(rundir.resume_mismatch({"config": config}, *args))
    changed = {**ok, "config": {"run": {"iterations": 1}, "ppo": {"cliprange": 0.1}}}
    assert rundir.resume_mismatch(changed, *args) == (
        "--resume with a different config (only run.iterations and logging may change): "
        "ppo.cliprange: 0.1 -> 0.2"
    )
    # same values for every key of today's config, but the saved config had one more: hashes differ
    assert "config hashes" in str(rundir.resume_mismatch({**ok, "config_hash": "h0"}, *args))


def test_a_damaged_rng_file_of_another_rank_is_found_by_every_rank(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    (path / "rng_rank1.pt").write_bytes((path / "rng_rank0.pt").read_bytes()[:10])  # not in the manifest
    with pytest.raises(ckpt.CheckpointError, match=r"rng_rank1\.pt is not a readable"):
        _load(path)  # rank 0 loading
