"""Positions the re-score feeds a model must fit only where the model has a learned absolute
position table (rev2 NIT-2).

GPT-2's ``wpe`` has ``n_positions`` rows: a position past it is an IndexError deep inside the
model, so it is refused in one line, for the dump's ``position_ids`` and, without them, for the
positions refppo derives from ``attention_mask``. Llama and Qwen2 rotate by any position:
``max_position_embeddings`` is no limit there (their forward pass runs past it, checked here), so
such a dump is not refused. Models are built from tiny configs, random init, nothing downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rescore_helpers import VOCAB, make_rows, write_rows

from refppo.models import position_ids_from_mask, tiny_config
from refppo.oracle.load import DumpError, load_dump
from refppo.oracle.rescore import _check_ids_fit

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
