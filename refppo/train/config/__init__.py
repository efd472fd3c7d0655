"""Every hyperparameter of a training run in one typed, frozen config (CleanRL style).

Sections (TOML tables; ``--set SECTION.KEY=VALUE`` on the command line)::

    [model]      policy / reward-model sources, tiny-model sizes, device, dtype
    [task]       the embedded task (warm start, reward model training) and the reward source
    [rollout]    prompts per iteration, generation length, sampling
    [ppo]        epochs × minibatches × micro-batches, grad clipping, plus EVERY field of
                 :class:`refppo.pipeline.settings.Hyperparams` and
                 :class:`refppo.pipeline.settings.Convention`
                 (flattened: ``ppo.cliprange``, ``ppo.loss_agg``), and the score map
                 ``ppo.score_bias``, ``ppo.score_scale``, ``ppo.score_clip`` (the pipeline's step 0)
    [optimizer]  AdamW
    [kl]         fixed or adaptive KL coefficient (the initial β is ``ppo.kl_coef``)
    [run]        iterations, seed, output, logging, checkpoints
    [seam]       the rollout–trainer seam mode (off by default): a rollout engine in its own
                 precision, its raw or top-p log-probs, a policy k iterations stale

Unknown keys raise a :class:`ConfigError` listing the valid keys of that section; derived sizes
(uneven minibatch / micro-batch / rank splits) are checked on construction.

Modules::

    sections   the seven section dataclasses, their field docstrings and their own checks
    seam       the eighth, [seam] (:class:`refppo.train.config.seam.SeamConfig`)
    schema     TrainConfig (the whole run: cross-section checks, per-rank sizes) and load_config
    codec      to / from plain data (TOML, JSON, --set), generic over the root dataclass
    doc        --help-config: every key's type, default and docstring
"""
