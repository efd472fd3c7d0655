"""The correctness oracle: does another trainer's dumped PPO step match the reference, and if not, where?

========== =====================================================================
module     what it holds
========== =====================================================================
load       reading and validating a dump (spec/dump-format.md), tolerances
settings   the key space: pipeline ``Convention`` + oracle ``Extras`` + ``Hyperparams``
presets    verl, OpenRLHF, TRL, DeepSpeed-Chat (spec/conventions.md)
recompute  every quantity through ``refppo.pipeline`` (the trainer's path)
compare    per-quantity errors and the shape of a difference
diagnose   first divergence + explanation by single convention changes / known bugs
detect     stage-by-stage search of the convention space
report     text and JSON
cli        ``main(argv) -> int`` (``refppo diff``, ``tools/diff_against.py``)
========== =====================================================================

Nothing here imports transformers; the command's import cost is torch's.
"""
