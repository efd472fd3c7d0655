"""Positions the re-score feeds a model must fit only where the model has a learned absolute
position table (rev2 NIT-2).

GPT-2's ``wpe`` has ``n_positions`` rows: a position past it is an IndexError deep inside the
model, so it is refused in one line: the positions refppo derives from ``attention_mask`` (what
the re-score feeds) always, and the dump's ``position_ids`` when given (rev6 BUG-1). The
diagnosis skips its ``arange(P+T)`` hypothesis with a note when the table cannot hold it (rev6
BUG-2). OPT's table is shifted by ``offset`` = 2 (rev6 TEST-1). Llama and Qwen2 rotate by any position:
``max_position_embeddings`` is no limit there (their forward pass runs past it, checked here), so
such a dump is not refused. Models are built from tiny configs, random init, nothing downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rescore_helpers import VOCAB, make_rows, write_rows

from refppo.dump.load import load_dump
from refppo.errors import DumpError
from refppo.models.batch import position_ids_from_mask
from refppo.models.tiny import tiny_config
from refppo.oracle.rescore.readouts import _learned_positions
from refppo.oracle.rescore.run import _check_ids_fit, rescore_dump

ROWS = make_rows()  # [5, 11]: every row has 7 real tokens, so derived positions reach 6
ARANGE = torch.arange(11).expand(5, 11).clone()  # positions that ignore the left padding: up to 10


def _model(arch: str, n_pos: int) -> Any:
    from transformers import AutoModelForCausalLM, Qwen2Config

    if arch == "qwen2":
        cfg: Any = Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=n_pos,
        )
    else:
        cfg = tiny_config(arch, VOCAB, hidden=32, layers=1, heads=2, max_positions=n_pos)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _dump(tmp: Path, with_positions: bool) -> Any:
    extra = {"position_ids": ARANGE} if with_positions else {}
    return load_dump(write_rows(tmp, ROWS, **extra))


def test_gpt2_refuses_derived_positions_past_its_table(tmp_path: Path) -> None:
    assert int(position_ids_from_mask(ROWS["attention_mask"]).max()) == 6
    model = _model("gpt2", 6)
    with pytest.raises(IndexError):  # what the model itself does with position 6
        model(input_ids=ROWS["input_ids"], position_ids=position_ids_from_mask(ROWS["attention_mask"]))
    with pytest.raises(DumpError) as err:
        _check_ids_fit(_dump(tmp_path, False), "actor", model)
    msg = str(err.value)
    assert "attention_mask: real tokens give positions up to 6 in rows [0, 1, 2, 3, 4]" in msg, msg
    assert "--actor model's learned position table (transformer.wpe) has 6 positions" in msg, msg
    assert "\n" not in msg
    _check_ids_fit(_dump(tmp_path, False), "actor", _model("gpt2", 7))  # 0..6 fit: no refusal


def test_gpt2_refuses_dumped_position_ids_past_its_table(tmp_path: Path) -> None:
    with pytest.raises(DumpError, match=r"position_ids: positions up to 10 in rows \[0, 1, 2, 3, 4\]"):
        _check_ids_fit(_dump(tmp_path, True), "ref", _model("gpt2", 10))
    _check_ids_fit(_dump(tmp_path, True), "ref", _model("gpt2", 11))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rotary_models_are_not_refused_past_max_position_embeddings(tmp_path: Path, arch: str) -> None:
    model = _model(arch, 4)
    assert model.config.max_position_embeddings == 4
    with torch.no_grad():  # the model itself runs past it
        out = model(input_ids=ROWS["input_ids"], attention_mask=ROWS["attention_mask"], position_ids=ARANGE)
    assert bool(torch.isfinite(out.logits).all())
    _check_ids_fit(_dump(tmp_path, True), "actor", model)  # positions up to 10 > 4: not refused
    _check_ids_fit(_dump(tmp_path, False), "actor", model)


def test_gpt2_refuses_derived_positions_when_dumped_position_ids_fit(tmp_path: Path) -> None:
    """rev6 BUG-1: the dump's ids restart inside a row (up to 3) and fit the table; refppo's own
    (up to 6, what the re-score feeds) do not: one line, not the model's IndexError."""
    ours = position_ids_from_mask(ROWS["attention_mask"])
    dump = load_dump(write_rows(tmp_path, ROWS, position_ids=ours % 4))
    model = _model("gpt2", 6)
    for run in (
        lambda: _check_ids_fit(dump, "actor", model),
        lambda: rescore_dump(dump, {"actor": model}, {"actor": "old_logprobs"}, diagnose=False),
    ):
        with pytest.raises(DumpError) as err:
            run()
        msg = str(err.value)
        assert "attention_mask: real tokens give positions up to 6 in rows [0, 1, 2, 3, 4]" in msg, msg
        assert "(transformer.wpe) has 6 positions (0..5)" in msg, msg


@pytest.mark.parametrize("n_pos", [7, 10])
def test_diagnosis_skips_arange_positions_past_the_table(tmp_path: Path, n_pos: int) -> None:
    """rev6 BUG-2: every row's real tokens fit GPT-2's 7 (10) positions, arange(P+T) (up to 10)
    does not; the mismatching re-score (dumped log-probs 0) is diagnosed and that hypothesis skipped."""
    model = _model("gpt2", n_pos)
    with pytest.raises(IndexError):  # what the model itself does with arange(P+T)
        model(input_ids=ROWS["input_ids"], position_ids=ARANGE)
    (item,) = rescore_dump(_dump(tmp_path, False), {"actor": model}, {"actor": "old_logprobs"})
    assert not item.ok
    note = (
        "position hypothesis arange(P+T) not testable: positions up to 10, the model's learned "
        f"position table (transformer.wpe) has {n_pos}"
    )
    assert note in item.notes, item.notes
    assert not any(f.name.startswith("position_ids") for f in item.findings)


def test_diagnosis_tries_arange_positions_that_fit(tmp_path: Path) -> None:
    """The same rows under a table of 11 positions: arange(P+T) is tried, so no skip note."""
    (item,) = rescore_dump(_dump(tmp_path, False), {"actor": _model("gpt2", 11)}, {"actor": "old_logprobs"})
    assert not item.ok
    assert not any("not testable" in n and "position" in n for n in item.notes), item.notes


def _opt(n_pos: int) -> Any:
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        ffn_dim=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=n_pos,
        word_embed_proj_dim=16,
    )
    torch.manual_seed(0)
    return OPTForCausalLM(cfg).eval()


def test_opt_table_is_shifted_by_its_offset(tmp_path: Path) -> None:
    """rev6 TEST-1: OPT's ``embed_positions`` has ``max_position_embeddings + 2`` rows and adds 2
    to every position, so it holds positions 0..5 for 6; position 6 is the model's IndexError."""
    model = _opt(6)
    assert model.model.decoder.embed_positions.num_embeddings == 8
    assert _learned_positions(model) == ("model.decoder.embed_positions", 6)
    ids = ROWS["input_ids"][:1, :7]
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(7).clamp(max=5).unsqueeze(0))  # 0..5: runs
        with pytest.raises(IndexError):
            model(input_ids=ids, position_ids=torch.arange(7).unsqueeze(0))
    with pytest.raises(DumpError, match=r"\(model\.decoder\.embed_positions\) has 6 positions"):
        _check_ids_fit(_dump(tmp_path, False), "actor", model)  # derived positions reach 6
    _check_ids_fit(_dump(tmp_path, False), "actor", _opt(7))
