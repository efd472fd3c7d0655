"""Re-scoring a dump with the trainer's checkpoints (issue #11): a correct scoring pass matches,
each injected bug of a trainer's scoring pass is named and re-checked, the precision report."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rescore_helpers import (
    make_rows,
    save_actor,
    save_reward,
    save_token_critic,
    trainer_logprobs,
    trainer_scores,
    trainer_values,
    write_rows,
)

from refppo.dump.load import load_dump
from refppo.dump.tolerances import TOLERANCES
from refppo.models.tiny import Arch
from refppo.oracle.rescore.readouts import RescoreItem, precision_stats
from refppo.oracle.rescore.run import load_models, rescore_dump

ROWS = make_rows()


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Arch, Path]:
    arch: Arch = request.param
    tmp = tmp_path_factory.mktemp(arch)
    save_actor(tmp, arch)
    save_token_critic(tmp, arch)
    save_reward(tmp, arch)
    return arch, tmp


def _rescore(tmp: Path, role: str, dump_path: Path, key: str) -> RescoreItem:
    dirs = {"actor": "actor", "critic": "critic", "reward-model": "rm"}
    kw = {r.replace("-", "_"): (str(tmp / d) if r == role else None) for r, d in dirs.items()}
    models = load_models(kw["actor"], None, kw["critic"], kw["reward_model"])
    (item,) = rescore_dump(load_dump(dump_path), models, {role: key})
    return item


def test_correct_pass_matches_within_float32_tolerance(ckpt: tuple[Arch, Path]) -> None:
    arch, tmp = ckpt
    lp = trainer_logprobs(tmp / "actor", ROWS)
    vals = trainer_values(tmp / "critic", ROWS)
    sc = trainer_scores(tmp / "rm", ROWS)
    p = write_rows(tmp, ROWS, name="ok.safetensors", old_logprobs=lp, old_values=vals, scores=sc)
    tol = TOLERANCES[torch.float32]
    for role, key in (("actor", "old_logprobs"), ("critic", "old_values"), ("reward-model", "scores")):
        item = _rescore(tmp, role, p, key)
        assert item.ok, (arch, role, item.result)
        scale = float(load_dump(p).tensors[key].abs().max())
        assert item.result.max_abs_err <= tol.of(scale) and item.result.max_abs_err < 1e-4
        assert item.findings == []


@pytest.mark.parametrize(
    ("bug", "finding"),
    [
        ("no_temperature", "temperature_not_applied"),
        ("temperature_twice", "temperature_applied_twice"),
        ("labels_off_by_one", "labels_shifted_+1"),
        ("no_position_offset", "position_ids_ignore_left_padding"),
    ],
)
def test_actor_bug_is_named_and_rechecked(ckpt: tuple[Arch, Path], bug: str, finding: str) -> None:
    arch, tmp = ckpt
    lp = trainer_logprobs(tmp / "actor", ROWS, bug)
    p = write_rows(tmp, ROWS, name=f"{bug}.safetensors", old_logprobs=lp)
    item = _rescore(tmp, "actor", p, "old_logprobs")
    if arch == "llama" and bug == "no_position_offset":
        # Llama's rotary positions are relative: a constant shift per row changes the logits by
        # rounding only, so the dump matches (GPT-2's learned absolute positions: named below).
        assert item.ok and item.result.max_abs_err < 1e-5 and item.findings == []
        return
    assert not item.ok, (arch, bug)
    assert [f.name for f in item.findings] == [finding], (arch, bug, item.notes)
    chk = item.findings[0].check
    assert chk is not None and chk.ok and chk.max_abs_err < item.result.max_abs_err / 100
    if not finding.startswith("temperature"):
        # a named explanation that is not the temperature: no solved τ̂ beside it (issue #21)
        assert not any(n.startswith("temperature solved") for n in item.notes), item.notes


def test_dump_position_ids_name_the_bug(tmp_path: Path) -> None:
    """The dump carries the trainer's position_ids (arange): named from them, and re-checked."""
    save_actor(tmp_path, "gpt2")
    lp = trainer_logprobs(tmp_path / "actor", ROWS, "no_position_offset")
    S = ROWS["input_ids"].shape[1]
    pos = torch.arange(S).expand(ROWS["input_ids"].shape).clone()
    item = _rescore(
        tmp_path, "actor", write_rows(tmp_path, ROWS, old_logprobs=lp, position_ids=pos), "old_logprobs"
    )
    assert [f.name for f in item.findings] == ["position_ids_ignore_left_padding"], item.notes
    assert "dump's position_ids" in item.findings[0].text


def test_other_temperature_is_solved(ckpt: tuple[Arch, Path]) -> None:
    _, tmp = ckpt
    lp = trainer_logprobs(tmp / "actor", ROWS, tau=1.3)  # the sidecar says 0.7
    item = _rescore(
        tmp, "actor", write_rows(tmp, ROWS, name="tau.safetensors", old_logprobs=lp), "old_logprobs"
    )
    assert [f.name for f in item.findings] == ["temperature_other_value"], item.notes
    assert "τ=1.3" in item.findings[0].text


def test_critic_read_one_slot_late(ckpt: tuple[Arch, Path]) -> None:
    _, tmp = ckpt
    vals = trainer_values(tmp / "critic", ROWS, "critic_late")
    item = _rescore(
        tmp, "critic", write_rows(tmp, ROWS, name="late.safetensors", old_values=vals), "old_values"
    )
    assert not item.ok
    assert [f.name for f in item.findings] == ["critic_read_late"], item.notes


def test_dropout_on_while_scoring(tmp_path: Path) -> None:
    save_actor(tmp_path, "gpt2", dropout=0.1)
    torch.manual_seed(123)
    lp = trainer_logprobs(tmp_path / "actor", ROWS, "dropout")
    item = _rescore(tmp_path, "actor", write_rows(tmp_path, ROWS, old_logprobs=lp), "old_logprobs")
    assert not item.ok
    assert [f.name for f in item.findings] == ["dropout_active"], item.notes
    assert item.findings[0].check is None and "spread" in item.findings[0].text


def test_dropout_not_named_without_active_dropout(ckpt: tuple[Arch, Path]) -> None:
    """Noise added to a correct pass of a model WITHOUT dropout: nothing is named."""
    _, tmp = ckpt
    g = torch.Generator().manual_seed(5)
    lp = trainer_logprobs(tmp / "actor", ROWS) + 0.05 * torch.randn(ROWS["response_mask"].shape, generator=g)
    item = _rescore(
        tmp, "actor", write_rows(tmp, ROWS, name="noise.safetensors", old_logprobs=lp), "old_logprobs"
    )
    assert not item.ok and item.findings == []
    assert any("no active dropout" in n for n in item.notes)


def test_reward_pad_eos_confusion(tmp_path: Path) -> None:
    save_reward(tmp_path, "gpt2", pad_is_eos=True)
    sc = trainer_scores(tmp_path / "rm", ROWS, "pad_eos")
    item = _rescore(tmp_path, "reward-model", write_rows(tmp_path, ROWS, scores=sc), "scores")
    assert not item.ok
    assert [f.name for f in item.findings] == ["reward_pad_eos_confusion"], item.notes


def test_reward_read_one_position_early(ckpt: tuple[Arch, Path]) -> None:
    _, tmp = ckpt
    sc = trainer_scores(tmp / "rm", ROWS, "early")
    item = _rescore(tmp, "reward-model", write_rows(tmp, ROWS, name="early.safetensors", scores=sc), "scores")
    assert not item.ok
    assert [f.name for f in item.findings] == ["reward_read_early"], item.notes


def test_multi_turn_holes_rescored_on_the_trained_tokens(ckpt: tuple[Arch, Path]) -> None:
    """response_mask with a hole (tool output attended, not trained): the trainer's one pass over the
    whole sequence is matched on the trained tokens; without the temperature it is still named."""
    _, tmp = ckpt
    rows = {**ROWS, "response_mask": ROWS["response_mask"].clone()}
    rows["response_mask"][0, 2:4] = 0
    rows["response_mask"][3, 1:3] = 0
    for bug, names in ((None, []), ("no_temperature", ["temperature_not_applied"])):
        lp = trainer_logprobs(tmp / "actor", {**ROWS}, bug)  # the trainer attends every real token
        item = _rescore(
            tmp,
            "actor",
            write_rows(tmp, rows, name=f"holes{bug}.safetensors", old_logprobs=lp),
            "old_logprobs",
        )
        assert item.ok == (bug is None) and [f.name for f in item.findings] == names, item.notes
        assert item.precision["dump_vs_float32"]["tokens"] == int(rows["response_mask"].sum())


def test_precision_report_bf16_vs_fp32(ckpt: tuple[Arch, Path]) -> None:
    """A trainer scoring in bf16: statistics of Δ, recomputed here from the two passes."""
    _, tmp = ckpt
    lp16 = trainer_logprobs(tmp / "actor", ROWS, dtype=torch.bfloat16)
    lp32 = trainer_logprobs(tmp / "actor", ROWS)
    item = _rescore(
        tmp, "actor", write_rows(tmp, ROWS, name="bf16.safetensors", old_logprobs=lp16), "old_logprobs"
    )
    st = item.precision["dump_vs_float32"]
    m = ROWS["response_mask"].bool()
    d = (lp16 - lp32).double()[m]
    assert st["max_abs"] == pytest.approx(float(d.abs().max()), abs=1e-4)
    assert st["mean_abs"] == pytest.approx(float(d.abs().mean()), abs=1e-4)
    assert st["tokens"] == int(m.sum())
    assert 0.0 < st["max_abs"] < 0.5
    # a precision gap is statistics, never a named bug (no temperature/offset/position fits it)
    assert item.findings == [] and any("no single named explanation" in n for n in item.notes)
    # the bf16 re-score of the same rows is close to the bf16 dump; the fp32 one is not
    assert item.precision["dump_vs_bfloat16"]["max_abs"] < st["max_abs"]


def test_precision_stats_share_outside() -> None:
    d = torch.tensor([[0.0, 0.02, -0.02, 0.005]], dtype=torch.float64)
    st = precision_stats(d, torch.zeros_like(d), torch.ones_like(d, dtype=torch.bool), 0.01)
    assert st["share_outside"] == 0.5 and st["max_abs"] == pytest.approx(0.02)
    assert st["mean_abs"] == pytest.approx(0.045 / 4)


def _critic_rows_dump(tmp: Path, vals: torch.Tensor) -> Path:
    return write_rows(tmp, ROWS, name="critic.safetensors", old_values=vals)


def test_refppo_critic_and_sequence_classification_critic(tmp_path: Path) -> None:
    """Both other critic kinds: refppo's own (backbone + value_head.safetensors) and TRL's kind (a
    sequence classifier whose score head is read at every position); the trainer's pass by hand."""
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoModelForSequenceClassification

    from refppo.models.tiny import tiny_critic

    am, ids = ROWS["attention_mask"], ROWS["input_ids"]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    P = ids.shape[1] - ROWS["response_mask"].shape[1]
    tiny_critic("llama", 96, hidden=32, layers=2, heads=2).save_pretrained(tmp_path / "critic")
    backbone = AutoModel.from_pretrained(tmp_path / "critic").eval()
    head = load_file(str(tmp_path / "critic" / "value_head.safetensors"))
    with torch.no_grad():
        h = backbone(input_ids=ids, attention_mask=am, position_ids=pos).last_hidden_state
    v = (h @ head["weight"].T + head["bias"])[..., 0][:, P - 1 : P - 1 + 6]
    item = _rescore(tmp_path, "critic", _critic_rows_dump(tmp_path, v), "old_values")
    assert item.ok and item.result.max_abs_err < 1e-5, item.result

    save_reward(tmp_path / "seq", "gpt2")  # a sequence classifier with one label
    (tmp_path / "seq" / "rm").rename(tmp_path / "critic2")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "critic2").eval()
    with torch.no_grad():
        h = model.base_model(input_ids=ids, attention_mask=am, position_ids=pos).last_hidden_state
        v2 = model.score(h)[..., 0][:, P : P + 6]  # read one slot late
    models = load_models(None, None, str(tmp_path / "critic2"), None)
    (item2,) = rescore_dump(load_dump(_critic_rows_dump(tmp_path, v2)), models, {"critic": "old_values"})
    assert [f.name for f in item2.findings] == ["critic_read_late"], item2.notes


def test_ref_gets_the_temperature_too(tmp_path: Path) -> None:
    save_actor(tmp_path, "llama", name="ref")
    lp = trainer_logprobs(tmp_path / "ref", ROWS)
    models = load_models(None, str(tmp_path / "ref"), None, None)
    (item,) = rescore_dump(
        load_dump(write_rows(tmp_path, ROWS, ref_logprobs=lp)), models, {"ref": "ref_logprobs"}
    )
    assert item.ok and item.result.max_abs_err < 1e-5


def test_solve_temperature_recovers_tau() -> None:
    """The 1-D solve on synthetic logits, target written with torch.log_softmax directly."""
    from refppo.oracle.rescore.diagnose import solve_temperature

    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 7, 50, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, 50, (2, 7), generator=g)
    for tau in (0.3, 1.0, 1.7, 8.0):
        target = torch.log_softmax(z / tau, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        t_hat = solve_temperature(z, y, torch.ones(2, 7, dtype=torch.bool), target)
        assert t_hat == pytest.approx(tau, rel=1e-6)


def test_bf16_checkpoint_is_rescored_in_float32_by_default(tmp_path: Path) -> None:
    """transformers 5 loads a bf16 checkpoint in bf16; the re-score casts to float32 (``--dtype``)."""
    from transformers import AutoModelForCausalLM

    d = save_actor(tmp_path, "llama")
    AutoModelForCausalLM.from_pretrained(d).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    lp = trainer_logprobs(tmp_path / "bf16", ROWS)  # the trainer's pass in float32 on those weights
    dump = load_dump(write_rows(tmp_path, ROWS, old_logprobs=lp))
    (item,) = rescore_dump(
        dump, load_models(str(tmp_path / "bf16"), None, None, None), {"actor": "old_logprobs"}
    )
    assert item.ok and item.result.max_abs_err < 1e-5 and "dump_vs_float32" in item.precision
    (as_stored,) = rescore_dump(
        dump, load_models(str(tmp_path / "bf16"), None, None, None, "checkpoint"), {"actor": "old_logprobs"}
    )
    assert "dump_vs_bfloat16" in as_stored.precision and "dump_vs_float32" not in as_stored.precision
