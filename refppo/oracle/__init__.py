"""The correctness oracle: does another trainer's dumped PPO step match the reference, and if not, where?

============= =====================================================================
module        what it holds
============= =====================================================================
load          reading and validating a dump (spec/dump-format.md), tolerances
settings      the key space: pipeline ``Convention`` + oracle ``Extras`` + ``Hyperparams``
presets       verl, OpenRLHF, TRL, DeepSpeed-Chat (spec/conventions.md)
recompute     every quantity through ``refppo.pipeline`` (the trainer's path)
compare       per-quantity errors and the shape of a difference
diagnose      first divergence + explanation by single convention changes / known bugs
detect        stage-by-stage search of the convention space
report        text and JSON
grad          dump v2: the reference gradient of the whole optimizer step (autograd, pipeline)
grad_diagnose why a gradient differs: ratios by micro-batch/rank, named patterns re-checked
run           ``check_step(dump, preset=..., overrides=...) -> Outcome`` (the CLI's flow)
rescore*      re-scoring with the trainer's checkpoints (``--actor``/``--ref``/``--critic``/
              ``--reward-model``): inputs, read-outs, model-level diagnosis, report, CLI part
cli           ``main(argv) -> int`` (``refppo diff``, ``tools/diff_against.py``)
============= =====================================================================

Nothing here imports transformers, except the ``rescore*`` modules when a model flag is given;
the command's import cost is torch's.
``refppo.oracle.check_step`` is :func:`refppo.oracle.run.check_step` (imported on first use).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("check_step", "Outcome"):
        from refppo.oracle import run

        return getattr(run, name)
    raise AttributeError(f"module 'refppo.oracle' has no attribute {name!r}")
