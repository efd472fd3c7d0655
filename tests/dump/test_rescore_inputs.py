"""The re-scoring dump keys (input_ids, attention_mask, position_ids, sidecar temperature): each bad
input is one DumpError line naming the key; good ones split into prompt + response as the format says."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rescore_helpers import make_rows, write_rows

from refppo.dump.keys import INTEGER_KEYS
from refppo.dump.load import load_dump
from refppo.dump.sequences import sequence_batch
from refppo.errors import DumpError

ROWS = make_rows()


def _load(tmp: Path, **changes: Any) -> Any:
    rows = {**ROWS, **changes}
    rows = {k: v for k, v in rows.items() if v is not None}
    return load_dump(write_rows(tmp, rows))


def test_good_rows_split_into_prompt_and_response(tmp_path: Path) -> None:
    d = _load(tmp_path)
    assert {"input_ids", "attention_mask"} <= INTEGER_KEYS and "position_ids" in INTEGER_KEYS
    assert d.tensors["input_ids"].dtype == torch.long
    b = sequence_batch(d.tensors, d.mask)
    assert b.prompt_width == 5 and b.response_width == 6
    assert torch.equal(b.input_ids, ROWS["input_ids"])
    assert torch.equal(b.response_mask, ROWS["response_mask"].bool())
    # the prompt's real tokens sit at the right end: 1, 5, 3, 2, 4 of them
    assert b.prompt_mask.sum(dim=1).tolist() == [1, 5, 3, 2, 4]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"attention_mask": None}, "input_ids is given without attention_mask"),
        ({"input_ids": None}, "attention_mask is given without input_ids"),
        ({"input_ids": ROWS["input_ids"].float()}, "input_ids: expected an integer tensor"),
        (
            {"input_ids": ROWS["input_ids"][:, 5:], "attention_mask": ROWS["attention_mask"][:, 5:]},
            "leaves no prompt",
        ),
        ({"attention_mask": ROWS["attention_mask"][:, 1:]}, "attention_mask: expected shape [5, 11]"),
        ({"input_ids": ROWS["input_ids"][:3]}, "input_ids: expected shape [B, P+T] with B = 5"),
        ({"attention_mask": ROWS["attention_mask"] * 2}, "attention_mask: expected only 0/1"),
        ({"position_ids": torch.zeros(5, 10, dtype=torch.long)}, "position_ids: expected shape [5, 11]"),
        ({"input_ids": ROWS["input_ids"] - 50}, "input_ids: rows"),
    ],
)
def test_bad_sequences_one_line(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(DumpError) as e:
        _load(tmp_path, **changes)
    text = str(e.value)
    assert message in text and "\n" not in text and "step.safetensors" in text


def test_response_part_must_cover_response_mask_and_be_right_padded(tmp_path: Path) -> None:
    am = ROWS["attention_mask"].clone()
    am[3, -2] = 0  # row 3's 5th response token is in response_mask but not attended
    with pytest.raises(DumpError, match=r"attention_mask: rows \[3\]: a response_mask token is not attended"):
        _load(tmp_path, attention_mask=am)
    am = ROWS["attention_mask"].clone()
    am[1, -1] = 1  # row 1: response 1 1 0 0 0 1 in attention
    with pytest.raises(DumpError, match=r"rows \[1\]: the response part is not right-padded"):
        _load(tmp_path, attention_mask=am)


def test_attention_may_cover_more_than_response_mask(tmp_path: Path) -> None:
    """Multi-turn: tool-output tokens attended (attention 1) inside a hole of response_mask."""
    rm = ROWS["response_mask"].clone()
    rm[0, 2:4] = 0  # row 0 (6 tokens): 1 1 0 0 1 1
    d = _load(tmp_path, response_mask=rm)
    b = sequence_batch(d.tensors, d.mask)
    assert torch.equal(b.response_mask, ROWS["attention_mask"][:, 5:].bool())  # what the model reads
    assert torch.equal(d.mask, rm.bool())  # where the re-score is compared


def test_prompt_must_be_left_padded(tmp_path: Path) -> None:
    am = ROWS["attention_mask"].clone()
    am[0, 0] = 1  # a real token, then padding, then the prompt's last token
    with pytest.raises(DumpError, match=r"rows \[0\]: the prompt part is not left-padded"):
        _load(tmp_path, attention_mask=am)
    am = ROWS["attention_mask"].clone()
    am[0, 4] = 0  # row 0 has a 1-token prompt: now none
    with pytest.raises(DumpError, match=r"rows \[0\] have no real prompt token"):
        _load(tmp_path, attention_mask=am)


@pytest.mark.parametrize("bad", [0, -1.5, "hot", True, None])
def test_bad_temperature_in_sidecar(tmp_path: Path, bad: Any) -> None:
    p = write_rows(tmp_path, ROWS)
    side = p.with_name(p.name + ".json")
    side.write_text(json.dumps({"temperature": bad}))
    with pytest.raises(DumpError, match="temperature: expected a finite number > 0"):
        load_dump(p)
