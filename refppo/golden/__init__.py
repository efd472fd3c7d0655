"""Golden PPO trajectories on tiny real models: build, run (batched or naive), save, compare.

``tools/make_golden.py`` writes ``spec/golden/ppo_<case>.{json,safetensors}``; ``tests/golden``
replays them. Format (schema version :data:`SCHEMA_VERSION`, described in spec/models.md):

- ``.safetensors``: per iteration ``i``: ``it{i}.<field>`` for every field of :data:`TENSOR_FIELDS`
  (rollout tokens and masks, π_old/π_ref log-probs, values, scores, KL, token rewards, advantages,
  returns) and ``it{i}.perm`` ``[epochs, B]`` (row order of each PPO epoch); a case sampled by the
  seam mode's engine also ``it{i}.rollout_logprobs`` ``[B, T]`` and ``it{i}.policy_version`` ``[B]``;
- ``.json``: ``schema_version``, ``case`` (the full configuration), ``tolerances``, ``environment``
  (versions, threads; informative), ``init_checksums`` and ``iterations``: per iteration the
  scalars (``metrics``), per-minibatch ``steps`` scalars, and ``checksums``: for every parameter
  tensor ``[Σp, Σp², Σ|p|]`` in float64 after that iteration's update.

Modules: :mod:`~refppo.golden.cases` (:class:`GoldenCase`, :data:`CASES`, the tolerances, the
fields), :mod:`~refppo.golden.trajectory` (:func:`build`, :func:`run`, checksums),
:mod:`~refppo.golden.check` (:func:`compare`, :func:`max_deviations`), :mod:`~refppo.golden.store`
(:func:`save`, :func:`load`); import each name from its module.
"""
