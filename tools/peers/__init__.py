"""The peer validators: refppo against the peers' OWN installed code, run in side venvs. Not CI.

Usage (refppo's interpreter; the side venvs built by ``tools/build_peer_venvs.sh`` under
``$REFPPO_PEERS_ROOT``     , default ``/work/peervenv``)::

    .venv/bin/python tools/peers VALIDATOR [--venv V ...] [--peers-root DIR] [--keep DIR]
                           [--json-out FILE] [options of the validator]

One harness (:mod:`peers.harness`: the venvs' root, the ``READY`` check, the two-interpreter
protocol with :mod:`peers.peer_side`, the skip/fail bookkeeping and exit codes; :mod:`peers.checks`:
``refppo diff``            in-process, the error measure) and one module per validator holding its cases, its
refppo-side comparison and the peer-side functions it runs:

=========================  ======================================================================
validator                  what runs in the peers' interpreters (and what refppo compares)
=========================  ======================================================================
``presets``                the dump makers of :mod:`peers.makers` (verl, OpenRLHF, SkyRL-train, AReaL,
                           their critic-free estimators, multi-turn holes; TRL's whole
                           ``PPOTrainer.train``) → ``refppo diff --preset P --set ...`` + a control
``adapters``               the peers' own containers through ``refppo.capture.adapters`` → diff,
                           corrupted-field controls
``detect``                 the dumps of ``presets`` (and five more TRL runs) → ``--detect`` from
                           refppo's defaults lists the generating convention
``detect_grads``           gradient-only v2 step dumps of verl/OpenRLHF/SkyRL-train micro-batch code
                           (2 ranks × 2 micro-batches) → ``--detect`` reads the gradient; controls
``grpo_peers``             TRL GRPOTrainer's and AReaL's GRPO family as dumps → preset, control, detect
                           (``--dumps DIR``: the dumps made once there, reused by later runs)
``agg_modes``              verl/SkyRL loss aggregations, every peer's value clip, verl's score on a
                           trailing tool token → ``core``
``group_estimators``       critic-free advantage estimators → ``core.group`` and the pipeline
``gspo``                   verl's and SkyRL's GSPO losses → ``core.gspo`` (value, gradient, twin)
``kl_straight_through``    verl's ``kl_penalty`` with ``+`` → ``core.kl`` (value, gradient, twin)
``kl_unbiased``            OpenRLHF's ``compute_approx_kl(unbiased_gradient=True)`` → ``core.kl``
                           ``grad_is_clip`` (value, gradient, twin)
``trl_grpo``               TRL ``GRPOTrainer._compute_loss`` → the pipeline's loss and gradient
``rescore_trl``            TRL's rollout scoring + its checkpoints → ``refppo diff --actor ...``
``rollout_correction``     verl/OpenRLHF/AReaL/SkyRL/TRL rollout-correction weights, gates and losses
                           → ``core.rollout_correction``, ``core.rollout_losses``, ``core.cispo``
=========================  ======================================================================

Every validator prints one line per case and a summary (cases run, passed, controls mismatched,
max abs error per measure); exit 0 when some case ran and all passed, 1 otherwise (a skip or a
crash is never a pass; nothing run is exit 1), 2 on bad input. The makers and peer-side functions
import nothing from refppo (except where refppo's own capture adapters are what is tested).
"""

VALIDATORS: dict[str, str] = {
    "presets": "peers.presets",
    "adapters": "peers.adapters",
    "detect": "peers.detect",
    "detect_grads": "peers.detect_grads",
    "grpo_peers": "peers.grpo_peers",
    "agg_modes": "peers.agg_modes",
    "group_estimators": "peers.group_estimators",
    "gspo": "peers.gspo",
    "kl_straight_through": "peers.kl_straight_through",
    "kl_unbiased": "peers.kl_unbiased",
    "trl_grpo": "peers.trl_grpo",
    "rescore_trl": "peers.rescore_trl",
    "rollout_correction": "peers.rollout_correction",
}
"""Validator name (the first argument of ``tools/peers``) → its module."""
