"""The correctness oracle: does another trainer's dumped PPO step match the reference, and if not, where?

================ ==================================================================================
part             what it holds
================ ==================================================================================
``presets/``     the peers' conventions as oracle keys (spec/conventions.md)
``check/``       one check under one setting: ``settings`` (the key space), ``recompute`` (every
                 quantity through the pipeline), ``compare``, ``diagnose`` (first divergence and its
                 explanation), ``grad``/``grad_diagnose`` (dump v2: the step's gradient)
``detect/``      ``--detect``: every convention that reproduces a dump, stage by stage
``rescore/``     re-scoring with the trainer's checkpoints (``--actor``/``--ref``/``--critic``/
                 ``--reward-model``)
``run``          ``check_step(dump, preset=..., overrides=...) -> Outcome`` (the CLI's flow)
``report``       text and JSON
``cli``          ``main(argv) -> int`` (``refppo diff``, ``tools/diff_against.py``)
================ ==================================================================================

The dump itself (keys, loading, validation, writing) is :mod:`refppo.dump`. Nothing here imports
transformers, except ``rescore/`` when a model flag is given; the command's import cost is torch's.
"""
