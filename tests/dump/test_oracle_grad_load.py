"""Dump v2 loader: every bad step key is one line naming the file and the key, exit 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from grad_helpers import TWO_RANKS_TWO_MB, save_step, step_dump

from refppo.dump.keys import INTEGER_KEYS
from refppo.dump.load import load_dump
from refppo.errors import DumpError
from refppo.oracle.cli import main


def _edit(d: dict[str, torch.Tensor], case: str) -> dict[str, Any]:
    """The tensor edit and sidecar extras of one bad case."""
    extra: dict[str, Any] = {}
    if case == "float micro_batch":
        d["micro_batch"] = d["micro_batch"].to(torch.float32)
    elif case == "bool rank":
        d["rank"] = d["rank"] > 0
    elif case == "rank shape":
        d["rank"] = d["rank"].unsqueeze(1)
    elif case == "rank out of range":
        d["rank"][3] = 2
    elif case == "negative micro_batch":
        d["micro_batch"][0] = -1
    elif case == "grad shape":
        d["grad_values"] = d["grad_values"][:, :5]
    elif case == "integer grad":
        d["grad_logprobs"] = d["grad_logprobs"].to(torch.int64)
    elif case == "grad without logprobs":
        d.pop("logprobs")
    elif case == "world_size zero":
        extra["world_size"] = 0
    elif case == "world_size string":
        extra["world_size"] = "2"
    elif case == "micro_batches bool":
        extra["micro_batches"] = True
    elif case == "separate_critic string":
        extra["separate_critic"] = "yes"
    elif case == "rank missing":
        d.pop("rank")
    return extra


CASES = {
    "float micro_batch": "micro_batch: expected an integer tensor",
    "bool rank": "rank: expected an integer tensor",
    "rank shape": "rank: expected shape [B] = [8]",
    "rank out of range": "rank: row 3 holds 2, outside [0, world_size=2)",
    "negative micro_batch": "micro_batch: row 0 holds -1, outside [0, micro_batches=2)",
    "grad shape": "grad_values: expected shape [B, T] = [8, 10]",
    "integer grad": "grad_logprobs: expected a floating-point tensor",
    "grad without logprobs": "grad_logprobs is given but the update-step inputs ['logprobs']",
    "world_size zero": "world_size: expected a positive integer, got 0",
    "world_size string": "world_size: expected a positive integer, got '2'",
    "micro_batches bool": "micro_batches: expected a positive integer, got True",
    "separate_critic string": "separate_critic: expected true or false, got 'yes'",
    "rank missing": "rank: missing while the sidecar says world_size=2",
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_step_keys_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    d = step_dump()
    extra = _edit(d, case)
    path = save_step(tmp_path, d, None, TWO_RANKS_TWO_MB, **extra)
    with pytest.raises(DumpError) as exc:
        load_dump(path)
    msg = str(exc.value)
    assert "\n" not in msg and str(path.name) in msg and CASES[case] in msg, msg
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert CASES[case] in err and err.count("\n") == 1


def test_step_keys_are_read_and_kept_out_of_the_hparams(tmp_path: Path) -> None:
    path = save_step(tmp_path, step_dump(), None, TWO_RANKS_TWO_MB, separate_critic=True)
    dump = load_dump(path)
    assert (dump.step.world_size, dump.step.micro_batches, dump.step.separate_critic) == (2, 2, True)
    assert "world_size" not in dump.hparams and "separate_critic" not in dump.hparams
    assert dump.tensors["rank"].dtype == torch.int64 and dump.tensors["rank"].tolist() == [
        0,
        0,
        0,
        0,
        1,
        1,
        1,
        1,
    ]
    assert {"micro_batch", "rank"} <= INTEGER_KEYS
