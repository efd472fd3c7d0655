"""``refppo train``: the trainer around the per-iteration algorithm of :mod:`refppo.train.iteration`.

One module per part of a run (the numbered skeleton is in :mod:`refppo.train.loop`)::

    loop           Trainer (setup order, step, train) and run()
    setup          the models, reward, critic, optimizers and per-iteration configs (step 0)
    prompts        draw, tokenize, check and left-pad an iteration's prompts (step 1)
    group          rollout.group_size: whole groups of responses per rank (step 1)
    dump           run.dump_iteration: the trainer's own step as a v2 dump (step 3)
    report         the metrics.jsonl record, samples, plot, run.json / config.json (step 6)
    checkpointing  save and --resume (step 6)
    dist           torchrun: rank, all-reduce hook, metrics over ranks
    runtime        TrainingError, seeds, device, dtype, threads, memory
    cli            the `refppo train` command line
"""
