"""Dump makers of ``tools/peers presets``, ``detect`` and ``grpo_peers``: each runs in a peer's side
venv, imports nothing from refppo (but ``adapt_*``, ``trl_ppo``: refppo's capture adapters are what
they test), calls the peer's own installed functions and writes dumps + sidecars."""
