"""The singleton-group error is an exception TYPE (``SingletonGroupError``), caught by type.

The pipeline used to recognise it by its message text ("have one response") and to parse the group
ids out of that text, so any other ``MaskError`` that happened to contain those words was rewritten
into the singleton message, and a reworded message would have escaped as a bare ``MaskError``.
"""

from __future__ import annotations

import pytest
import torch

from refppo.core.group import group_advantages
from refppo.core.group_naive import group_advantages_naive
from refppo.errors import ConventionError, MaskError, SingletonGroupError
from refppo.pipeline import rollout as m_rollout
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import rollout_quantities

F64 = torch.float64


def _batch() -> dict[str, torch.Tensor]:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    lp = torch.full((4, 3), -1.0, dtype=F64)
    return {
        "scores": torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=F64),
        "old_logprobs": lp,
        "ref_logprobs": lp,
        "mask": mask,
        "group_index": torch.tensor([7, 3, 7, 11]),  # prompts 3 and 11 have one response each
    }


def _run(x: dict[str, torch.Tensor]) -> None:
    rollout_quantities(
        scores=x["scores"], old_logprobs=x["old_logprobs"], ref_logprobs=x["ref_logprobs"], old_values=None,
        mask=x["mask"], hp=Hyperparams(), conv=Convention.of(advantage="grpo"),  # type: ignore[arg-type]  # parsed
        group_index=x["group_index"],
    )  # fmt: skip


def test_core_raises_the_singleton_type_with_its_groups() -> None:
    x = _batch()
    with pytest.raises(SingletonGroupError) as exc:
        group_advantages(x["scores"], x["group_index"], x["mask"], estimator="grpo", singleton="error")
    assert exc.value.groups == [3, 11] and isinstance(exc.value, MaskError)
    with pytest.raises(SingletonGroupError) as naive:
        group_advantages_naive(x["scores"], x["group_index"], x["mask"], estimator="grpo", singleton="error")
    # the twin names the same prompts with the same message (tests/core/test_core_twin_refusals.py)
    assert naive.value.groups == [3, 11] and str(naive.value) == str(exc.value)


def test_pipeline_names_the_prompts_from_the_exception_not_its_text() -> None:
    with pytest.raises(ConventionError, match=r"prompts \[3, 11\] have one response under group_singleton"):
        _run(_batch())


def test_another_mask_error_with_the_same_words_passes_through(monkeypatch: pytest.MonkeyPatch) -> None:
    # a MaskError that is not the singleton error, whose text happens to hold the old marker
    def other(*args: object, **kwargs: object) -> torch.Tensor:
        raise MaskError("mask: rows [2] have one response token too many (not a group problem)")

    monkeypatch.setattr(m_rollout, "group_advantages", other)
    with pytest.raises(MaskError, match=r"rows \[2\] have one response token too many") as exc:
        _run(_batch())
    assert not isinstance(exc.value, ConventionError)


def test_singleton_error_survives_a_process_boundary() -> None:
    """Pickled and back (as a worker pool or torch.multiprocessing would ship it): same type, groups and
    message. The default ``__reduce__`` called ``__init__`` with the message alone: a TypeError."""
    import pickle

    err = SingletonGroupError([3, 11], "group_index: prompts [3, 11] have one response each")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is SingletonGroupError and back.groups == [3, 11] and str(back) == str(err)
