"""The ``--detect`` walk's steps against the pipeline's stage table (issue #20 item 2).

:data:`refppo.oracle.detect.steps.STEPS` names, per step, the stages it evaluates and the keys it
walks; the detection docstring and spec/conventions.md show it (:func:`steps_table`). A key a stage
gains, a stage added to the table or a stale description fails here.
"""

from __future__ import annotations

from pathlib import Path

import refppo.oracle.detect.detection as detection
from refppo.oracle.detect.steps import NOT_WALKED, STEPS, steps_table
from refppo.pipeline.stages import BY_NAME, STAGES, UPDATE_STAGES

SPEC = Path(__file__).resolve().parents[3] / "spec" / "conventions.md"
WALKED = [s for s in STAGES if s.phase != "grad"]
"""The stages the walk evaluates (the gradients are the re-check's: ``diagnose.check``)."""


def _reads(names: tuple[str, ...]) -> set[str]:
    return {k for s in STAGES if s.name in names for k in (*s.keys, *s.hparams)}


def test_the_steps_cover_the_stage_table_in_an_order_it_allows() -> None:
    """Every stage once (kl_loss, evaluated in the policy step, again in the loss step), each after
    the stages that make what it reads (the kl step comes before the score map: neither reads the
    other)."""
    order = list(dict.fromkeys(n for st in STEPS for n in st.stages))
    assert sorted(order) == sorted(s.name for s in WALKED)
    assert {s.name for s in UPDATE_STAGES} <= set(order)
    table = [s.name for s in WALKED]

    def maker(q: str, reader: str) -> str | None:
        """The last stage before ``reader`` in the table that makes ``q`` (the gate's ``mask`` is
        made again in the update: a rollout stage reads the one before it)."""
        before = table[: table.index(reader)]
        return next((n for n in reversed(before) if q in BY_NAME[n].makes), None)

    for i, name in enumerate(order):
        needs = {m for q in BY_NAME[name].reads if (m := maker(q, name)) is not None}
        assert needs <= set(order[:i]), (name, needs - set(order[:i]))


def test_every_key_a_stage_reads_is_walked_or_listed_as_not_walked() -> None:
    walked = [k for st in STEPS for k in st.walks]
    read = _reads(tuple(s.name for s in WALKED))
    assert set(walked) | set(NOT_WALKED) == read
    assert not set(walked) & set(NOT_WALKED)
    for st in STEPS:  # a step walks only what its own stages read
        assert set(st.walks) <= _reads(st.stages), (st.name, set(st.walks) - _reads(st.stages))


def test_the_docstring_and_the_spec_show_the_steps() -> None:
    table = steps_table()
    assert table.count("\n- ``") == len(STEPS) - 1
    assert table in (detection.__doc__ or ""), "paste steps_table() into refppo/oracle/detect/detection.py"
    assert table in SPEC.read_text(), "paste steps_table() into spec/conventions.md (--detect walk)"
