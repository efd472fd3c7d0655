"""``refppo verify``: every public vectorized core function against its naive twin, on seeded batches.

"Every" is checked by ``tests/verify/test_verify_coverage.py``: it enumerates the public functions of
the ``refppo.core`` modules (``*_naive`` twins excluded) and fails if a case calls none of them
directly; the deliberate exceptions are the argument validators (``check_*``), which return
nothing to compare.

Each case builds a right-padded batch (random lengths, including length-1 rows; some cases also
punch interior holes) whose padded positions hold junk (NaN, ±inf, huge values), runs the
vectorized function and its naive twin (plain Python floats, one token at a time), and compares
them on every output. One table row per (step, device, dtype); the exit status is non-zero if any
row fails. Runs on CPU, and also on CUDA when ``torch.cuda.is_available()``.

The tolerances live in :mod:`refppo.verify.tolerance` (:data:`TOLERANCES`), and the test suite
imports them from there, so the CLI and the property tests judge "equal to the naive twin" by one
rule (:func:`compare`).

Modules: :mod:`~refppo.verify.tolerance` (:data:`TOLERANCES`, :func:`compare`),
:mod:`~refppo.verify.batches` (seeded ragged batches with junk padding, and with interior holes),
:mod:`~refppo.verify.cases` (per-token steps, :data:`CASES`), :mod:`~refppo.verify.cases_adv`
(score map, score positions, critic-free advantages, normalisation) and
:mod:`~refppo.verify.cases_loss` (losses and gradients), :mod:`~refppo.verify.cases_dist` (the
``all_reduce`` paths on two simulated ranks, :mod:`~refppo.verify.ranks`), :mod:`~refppo.verify.cli`
(rows, the table, ``main``). This module re-exports them.
"""
