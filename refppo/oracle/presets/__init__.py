"""The peers' PPO-step conventions as oracle keys (:mod:`.registry`: ``PRESETS``, ``resolve_preset``)."""
